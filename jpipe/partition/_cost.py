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


def dapple_latency(forward: Sequence[float], backward: Sequence[float], allreduce: Sequence[float],
                   microbatches: int) -> Latency:
    """DAPPLE's iteration latency of a pipeline: warm-up, steady phase on the pivot, end phase.

    ``forward[s]``, ``backward[s]`` are one micro-batch's seconds on stage
    ``s`` (transfers between stages are stages of their own, with zero
    all-reduce); ``allreduce[s]`` the gradient all-reduce of stage ``s``:

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
