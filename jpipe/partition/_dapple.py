"""DAPPLE's planner for a general cluster: stages, non-uniform replication, device placement."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jpipe.partition._cluster import Cluster
from jpipe.partition._cost import latency_arrays
from jpipe.partition._profile import Profile

POLICIES = ("fresh", "append", "scatter")


class Stage(NamedTuple):
    """Layers ``[start, stop)`` replicated on ``replicas`` devices (``devices``: global ids)."""

    layers: tuple[int, int]
    replicas: int
    devices: tuple[int, ...]
    placement: str = ""

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


class DapplePlan(NamedTuple):
    """A DAPPLE plan and its predicted iteration latency (seconds).

    ``pattern`` is ``"DP"`` (one stage on every device), ``"straight"`` (no
    stage replicated) or the replica counts (``"8:8"``, ``"15:1"``); ``split``
    the layers per stage (``"23:25"``). ``comm_ratio`` is the largest ratio of a
    cross-stage transfer to the forward compute of the stage before it (the
    number in parentheses in DAPPLE's Table 4).
    """

    stages: tuple[Stage, ...]
    microbatches: int
    microbatch_size: int
    latency: float
    pivot: int
    data_parallel_latency: float
    comm_ratio: float

    @property
    def pattern(self) -> str:
        if len(self.stages) == 1:
            return "DP"
        if all(s.replicas == 1 for s in self.stages):
            return "straight"
        return ":".join(str(s.replicas) for s in self.stages)

    @property
    def split(self) -> str:
        return ":".join(str(s.num_layers) for s in self.stages)

    @property
    def speedup_over_dp(self) -> float:
        return self.data_parallel_latency / self.latency

    def __str__(self) -> str:
        if self.pattern == "DP":
            return "DP"
        if self.pattern == "straight":
            return f"straight, split {self.split} ({self.comm_ratio:.2f})"
        return f"{self.pattern}, split {self.split} ({self.comm_ratio:.2f})"


class _Costs(NamedTuple):
    """Per-sample prefix sums over layers (pre in layer 0, post in the last layer)."""

    f: np.ndarray  # [L + 1] forward seconds per sample
    b: np.ndarray  # backward
    w: np.ndarray  # parameter bytes
    o: np.ndarray  # optimizer-state bytes
    a: np.ndarray  # activation bytes per sample kept for the backward
    cut: np.ndarray  # [L] bytes per sample crossing a boundary after layer i (last entry unused)


def _costs(profile: Profile) -> _Costs:
    pbs = float(profile.microbatch_size)
    layers = list(profile.layers)
    f = np.array([l.forward for l in layers]) / pbs
    b = np.array([l.backward for l in layers]) / pbs
    w = np.array([l.param_bytes for l in layers], dtype=float)
    o = np.array([l.optimizer_bytes for l in layers], dtype=float)
    a = np.array([l.residual_bytes or l.activation_bytes for l in layers], dtype=float) / pbs
    for part, idx in ((profile.pre, 0), (profile.post, -1)):
        if part is not None:
            f[idx] += part.forward / pbs
            b[idx] += part.backward / pbs
            w[idx] += part.param_bytes
            o[idx] += part.optimizer_bytes
            a[idx] += (part.residual_bytes or part.activation_bytes) / pbs
    cut = np.array(list(profile.cut_bytes) + [0.0]) / pbs
    prefix = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
    return _Costs(prefix(f), prefix(b), prefix(w), prefix(o), prefix(a), cut)


def _place(used: tuple[int, ...], k: int, policy: str, per_server: int) -> tuple[int, ...] | None:
    """Counts per server of a new stage of ``k`` devices, given devices ``used`` per server."""
    free = [per_server - u for u in used]
    if sum(free) < k:
        return None
    take = [0] * len(used)
    if policy == "scatter":  # one device at a time round-robin over servers with room
        left = k
        while left:
            for i in range(len(used)):
                if left and free[i] - take[i] > 0:
                    take[i] += 1
                    left -= 1
        return tuple(take)
    if policy == "fresh":  # unused servers first, then the emptiest used ones
        order = sorted(range(len(used)), key=lambda i: (used[i] > 0, -free[i], i))
    else:  # append: servers already in use first (fullest first), then fresh ones
        order = sorted(range(len(used)), key=lambda i: (used[i] == 0, free[i], i))
    left = k
    for i in order:
        n = min(left, free[i])
        take[i] += n
        left -= n
    return tuple(take)


def _replica_options(n: int, per_server: int) -> list[int]:
    """Replica counts the search tries for one stage on a cluster of ``n`` devices."""
    if n <= 32:
        return list(range(1, n + 1))
    opts = {2 ** i for i in range(int(math.log2(n)) + 1)}
    opts |= {per_server * i for i in range(1, n // per_server + 1)}
    opts |= {n - x for x in list(opts) if n - x > 0}
    return sorted(x for x in opts if 1 <= x <= n)


class _Evaluator:
    """Latency and memory of plans whose last two stages vary over a range of split points."""

    def __init__(self, c: _Costs, global_batch: int, cluster: Cluster, min_samples: int,
                 optimizer_factor: float | None):
        self.c, self.G, self.cluster, self.min_samples = c, global_batch, cluster, min_samples
        self.optimizer_factor = optimizer_factor
        self.divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]

    def microbatch(self, max_replicas: int) -> int:
        need = max_replicas * self.min_samples
        return next((d for d in self.divisors if d >= need), self.G)

    def evaluate(self, stages: Sequence[tuple[np.ndarray | int, np.ndarray | int, tuple[int, ...]]],
                 width: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``stages``: (start, stop, counts per server); start/stop may be arrays of ``width`` plans."""
        c, cl = self.c, self.cluster
        reps = [sum(alloc) for _, _, alloc in stages]
        if max(reps) > self.G:
            return np.full(width, np.inf), np.zeros(width, int), 0, 0
        b = self.microbatch(max(reps))
        M = self.G // b
        K = len(stages)
        F = np.empty((2 * K - 1, width))
        B = np.empty((2 * K - 1, width))
        AR = np.zeros((2 * K - 1, width))
        feasible = np.ones(width, bool)
        for s, (lo, hi, alloc) in enumerate(stages):
            r = reps[s]
            F[2 * s] = (c.f[hi] - c.f[lo]) * (b / r)
            B[2 * s] = (c.b[hi] - c.b[lo]) * (b / r)
            w = c.w[hi] - c.w[lo]
            AR[2 * s] = cl.allreduce_time(1.0, alloc) * w
            opt = (c.o[hi] - c.o[lo]) if self.optimizer_factor is None else self.optimizer_factor * w
            held = min(K - s, M)
            mem = 2 * w + opt + held * (c.a[hi] - c.a[lo]) * (b / r)
            feasible &= mem <= cl.device_memory
            if s < K - 1:
                t = cl.transfer_time(1.0, alloc, stages[s + 1][2]) * b * c.cut[np.asarray(hi) - 1]
                F[2 * s + 1] = t
                B[2 * s + 1] = t
        total, _, _, _, pivot = latency_arrays(F, B, AR, M)
        return np.where(feasible, total, np.inf), pivot, M, b


def dapple_plan(profile: Profile, global_batch: int, cluster: Cluster, *, min_samples_per_replica: int = 1,
                optimizer_factor: float | None = None, beam: int = 1) -> DapplePlan:
    """DAPPLE's planner: the fastest stages, replica counts and device placement for ``cluster``.

    Dynamic programming over "the first ``j`` layers are planned on ``m``
    devices; the remaining layers form one last stage replicated on every other
    device" (keeping the ``beam`` best plans per state). Each step splits that last stage in two at every layer boundary,
    giving the new stage ``k`` devices placed by Fresh First (unused servers
    first), Append First (servers in use first) or Scatter First (spread over
    servers), and keeps, per ``(j, m)``, the plan with the lowest latency
    (:func:`jpipe.partition.dapple_latency`, transfers as stages of their own).
    Micro-batches are as small as ``min_samples_per_replica`` samples per replica
    of the most replicated stage allow (profiled times scale linearly from the
    profile batch size, as in DAPPLE). Plans whose stage needs more than
    ``cluster.device_memory`` (``2 W + optimizer state + K_s`` micro-batches of
    activations, ``K_s`` the 1F1B warm-up) are skipped; ``optimizer_factor``
    overrides the profile's optimizer-state bytes as a multiple of the weights.
    Every "S stages x r replicas" plan with a balanced split is also evaluated.

    >>> from jpipe.partition import Cluster, LayerCost, Profile
    >>> layer = LayerCost("l", forward=0.01, backward=0.02, activation_bytes=1e6, param_bytes=4e8)
    >>> plan = dapple_plan(Profile(layers=(layer,) * 32, microbatch_size=4), 64, Cluster.preset("dapple-B"))
    >>> plan.pattern, plan.split          # big weights, slow network: no all-reduce at all
    ('straight', '2:2:2:2:2:2:2:2:2:2:2:2:2:2:2:2')
    """
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    c = _costs(profile)
    L, N, dps = profile.num_layers, cluster.num_devices, cluster.devices_per_server
    ev = _Evaluator(c, global_batch, cluster, min_samples_per_replica, optimizer_factor)
    options = _replica_options(N, dps)
    option_set = set(options) | {0}
    empty = (0,) * cluster.servers

    def rest(used: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(dps - u for u in used)

    # state (j, m) -> up to `beam` entries (latency with the rest as one stage, stages, used)
    State = tuple[float, list, tuple[int, ...]]
    best: dict[tuple[int, int], list[State]] = {}

    def offer(key: tuple[int, int], entry: State) -> None:
        entries = best.setdefault(key, [])
        if len(entries) == beam and entry[0] >= entries[-1][0]:
            return
        entries.append(entry)
        entries.sort(key=lambda e: e[0])
        del entries[beam:]

    total, _, _, _ = ev.evaluate([(0, L, rest(empty))], 1)
    dp_latency = float(total[0])
    offer((0, 0), (dp_latency, [], empty))
    for j in range(L - 1):
        splits = np.arange(j + 1, L)
        for m in sorted(mm for (jj, mm) in best if jj == j):
            for _, prefix, used in list(best[(j, m)]):
                fixed = [(lo, hi, alloc) for lo, hi, alloc, _ in prefix]
                for k in options:
                    if m + k >= N or (N > 32 and (m + k) not in option_set):
                        continue
                    seen = set()
                    for policy in POLICIES:
                        alloc = _place(used, k, policy, dps)
                        if alloc is None or alloc in seen:
                            continue
                        seen.add(alloc)
                        used2 = tuple(u + a for u, a in zip(used, alloc))
                        lat, _, _, _ = ev.evaluate(fixed + [(j, splits, alloc), (splits, L, rest(used2))],
                                                   len(splits))
                        for i in np.flatnonzero(np.isfinite(lat)):
                            offer((int(splits[i]), m + k),
                                  (float(lat[i]), prefix + [(j, int(splits[i]), alloc, policy)], used2))
    candidates = [(e[0], e[1] + [(key[0], L, rest(e[2]), "rest")]) for key, es in best.items() for e in es]
    candidates += _uniform_plans(ev, L, cluster)
    latency, raw = min(candidates, key=lambda c: c[0])
    if not math.isfinite(latency):
        raise ValueError(f"no plan fits in {cluster.device_memory / 1e9:.1f} GB per device; use a cluster "
                         f"with more memory or devices, or a smaller global batch")
    return _finish(raw, ev, cluster, dp_latency)


def _balanced_split(c: _Costs, L: int, stages: int) -> list[int]:
    """Boundaries splitting layers into ``stages`` contiguous ranges of about equal F+B."""
    work = c.f + c.b
    total = work[-1]
    bounds = [0]
    for s in range(1, stages):
        target = total * s / stages
        j = int(np.clip(np.searchsorted(work, target), bounds[-1] + 1, L - (stages - s)))
        if j > bounds[-1] + 1 and abs(work[j - 1] - target) < abs(work[j] - target):
            j -= 1
        bounds.append(j)
    return bounds + [L]


def _uniform_plans(ev: _Evaluator, L: int, cluster: Cluster) -> list[tuple[float, list]]:
    """Every "S stages x r replicas" plan with a balanced split, each placed Fresh First."""
    out = []
    N, dps = cluster.num_devices, cluster.devices_per_server
    for stages in range(2, min(N, L) + 1):
        if N % stages:
            continue
        r = N // stages
        bounds = _balanced_split(ev.c, L, stages)
        used = (0,) * cluster.servers
        raw = []
        for s in range(stages):
            alloc = _place(used, r, "fresh", dps)
            used = tuple(u + a for u, a in zip(used, alloc))
            raw.append((bounds[s], bounds[s + 1], alloc, "fresh"))
        lat = float(ev.evaluate([(lo, hi, a) for lo, hi, a, _ in raw], 1)[0][0])
        out.append((lat, raw))
    return out


def _finish(raw: list, ev: _Evaluator, cluster: Cluster, dp_latency: float) -> DapplePlan:
    dps = cluster.devices_per_server
    next_free = [0] * cluster.servers
    stages = []
    for lo, hi, alloc, policy in raw:
        devices = []
        for server, count in enumerate(alloc):
            devices += [server * dps + next_free[server] + i for i in range(count)]
            next_free[server] += count
        stages.append(Stage((int(lo), int(hi)), sum(alloc), tuple(devices), policy))
    plain = [(lo, hi, alloc) for lo, hi, alloc, _ in raw]
    total, pivot, M, b = ev.evaluate(plain, 1)
    c = ev.c
    ratio = 0.0
    for s in range(len(raw) - 1):
        lo, hi, alloc, _ = raw[s]
        fwd = (c.f[hi] - c.f[lo]) * b / sum(alloc)
        t = cluster.transfer_time(c.cut[hi - 1] * b, alloc, raw[s + 1][2])
        ratio = max(ratio, t / fwd if fwd > 0 else math.inf)
    return DapplePlan(tuple(stages), M, b, float(total[0]), int(pivot[0]) // 2, dp_latency, ratio)
