"""DAPPLE's iteration latency model (jpipe's own step model is in ``_search``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Latency(NamedTuple):
    """One iteration under DAPPLE's model: ``total = warmup + steady + end`` seconds."""

    total: float
    warmup: float
    steady: float
    end: float
    pivot: int


def latency_arrays(forward: np.ndarray, backward: np.ndarray, allreduce: np.ndarray,
                   microbatches: int) -> tuple[np.ndarray, ...]:
    """DAPPLE's latency for many plans at once: arrays ``[stages, plans]`` -> ``[plans]`` each.

    Returns ``(total, warmup, steady, end, pivot)``.
    """
    F = np.asarray(forward, dtype=float)
    B = np.asarray(backward, dtype=float)
    AR = np.asarray(allreduce, dtype=float)
    if F.ndim == 1:
        F, B, AR = F[:, None], B[:, None], AR[:, None]
    S, J = F.shape
    m1 = microbatches - 1
    C = F + B
    zeros = np.zeros((1, J))
    cum_c = np.concatenate([zeros, np.cumsum(C, 0)])
    cum_f = np.concatenate([zeros, np.cumsum(F, 0)])
    cum_b = np.concatenate([zeros, np.cumsum(B, 0)])
    cols = np.arange(J)
    Q = np.full(J, S - 1)
    # Pivot: the stage that paces the steady phase (later stages win ties).
    for s in range(S - 2, -1, -1):
        between = cum_c[Q, cols] - cum_c[s + 1]
        take = m1 * C[s] > m1 * C[Q, cols] + between
        Q = np.where(take, s, Q)
    warmup = cum_f[Q + 1, cols]
    steady = m1 * C[Q, cols]
    s_idx = np.arange(S)[:, None]
    before = cum_b[Q + 1, cols][None, :] - cum_b[:-1]  # s <= Q: sum_{a=s..Q} B_a
    after = -(cum_b[1:] - cum_b[Q, cols][None, :])  # s > Q: -sum_{a=Q..s} B_a
    end = np.max(AR + np.where(s_idx <= Q[None, :], before, after), axis=0)
    return warmup + steady + end, warmup, steady, end, Q


def exposed_allreduce_table(backward: np.ndarray, allreduce: np.ndarray) -> np.ndarray:
    """``E[lo, hi]``: seconds of stage ``[lo, hi)``'s gradient all-reduce left after its last backward.

    ``backward[l]`` is layer ``l``'s backward of one micro-batch and
    ``allreduce[l]`` the all-reduce of its gradient. The last micro-batch's
    backward runs layers ``hi-1`` down to ``lo``; layer ``l``'s gradient is ready
    once its backward ends, and the all-reduces run one at a time on one link
    in that order: ``end_l = max(end_{l+1}, ready_l) + allreduce[l]``.
    ``E[lo, hi] = end_lo - (the stage's backward)``. One pass per ``lo`` fills
    every ``hi`` at once (``O(L^2)``).
    """
    back = np.asarray(backward, dtype=float)
    ar = np.asarray(allreduce, dtype=float)
    L = len(back)
    cum = np.concatenate([[0.0], np.cumsum(back)])
    exposed = np.zeros((L + 1, L + 1))
    end = np.zeros(L + 1)  # end[hi]: when the all-reduces so far of stage [l, hi) finish
    for lo in range(L - 1, -1, -1):
        hi = np.arange(lo + 1, L + 1)
        ready = cum[hi] - cum[lo]
        end[hi] = np.maximum(end[hi], ready) + ar[lo]
        exposed[lo, hi] = end[hi] - ready
    return exposed


def overlapped_allreduce(backward: Sequence[float], allreduce: Sequence[float]) -> float:
    """Seconds of a stage's gradient all-reduce that its last backward does not hide.

    DAPPLE's planner (``cc_overlap.rs`` in AlibabaPAI/DAPPLE) all-reduces each
    layer's gradient on its own, as soon as the last micro-batch's backward
    has produced it: gradients are ready from the last layer to the first, so
    the backward of the layers before a layer hides that layer's all-reduce,
    and only the first layer's all-reduce (ready last) is always exposed.
    ``backward[l]``, ``allreduce[l]`` are per layer, in forward order.

    >>> overlapped_allreduce([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])   # hidden but the first layer's
    0.5
    >>> overlapped_allreduce([1.0, 1.0, 1.0], [3.0, 3.0, 3.0])   # link-bound: 1 s + 9 s, backward ends at 3 s
    7.0

    Where jpipe differs from that code (it reads profiled backward times, not
    half of forward + backward; the windows are one replica's backward of its
    share of the micro-batch; the link runs one all-reduce at a time, where
    the code's slack sum lets a later all-reduce use an earlier idle window)
    it follows the description in the paper.
    """
    if len(backward) != len(allreduce) or not len(backward):
        raise ValueError(f"backward and allreduce need one entry per layer; got lengths {len(backward)}, "
                         f"{len(allreduce)}")
    return float(exposed_allreduce_table(np.asarray(backward), np.asarray(allreduce))[0, -1])


def dapple_latency(forward: Sequence[float], backward: Sequence[float], allreduce: Sequence[float],
                   microbatches: int) -> Latency:
    """DAPPLE's iteration latency of a pipeline: warm-up, steady phase on the pivot, end phase.

    ``forward[s]``, ``backward[s]`` are one micro-batch's seconds on stage
    ``s`` (transfers between stages are stages of their own, with zero
    all-reduce); ``allreduce[s]`` the gradient all-reduce of stage ``s`` that
    starts after its last backward (all of it, or with DAPPLE's overlap only
    what :func:`overlapped_allreduce` leaves exposed):

    - ``T_w = sum_{s<=Q} F_s``, ``T_s = (M-1)(F_Q + B_Q)``,
    - ``T_e = max_s AR_s + (sum_{a=s..Q} B_a if s <= Q else -sum_{a=Q..s} B_a)``,

    where the pivot ``Q`` starts at the last stage and moves to ``s`` when
    ``(M-1)(F_s+B_s) > (M-1)(F_Q+B_Q) + sum_{s<s'<Q}(F_s'+B_s')``.

    >>> lat = dapple_latency([1.0, 1.0], [2.0, 2.0], [0.0, 0.0], microbatches=4)
    >>> lat.total, lat.pivot        # 2 F + 3 (F+B) + 2 B: GPipe's (M+S-1)(F+B)
    (15.0, 1)
    >>> dapple_latency([1.0], [2.0], [5.0], microbatches=4).total   # data parallel: M (F+B) + AR
    17.0
    """
    if not (len(forward) == len(backward) == len(allreduce)) or not forward:
        raise ValueError(f"forward, backward and allreduce need one entry per stage; got lengths "
                         f"{len(forward)}, {len(backward)}, {len(allreduce)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    total, warmup, steady, end, pivot = latency_arrays(np.asarray(forward), np.asarray(backward),
                                                       np.asarray(allreduce), microbatches)
    return Latency(float(total[0]), float(warmup[0]), float(steady[0]), float(end[0]), int(pivot[0]))
