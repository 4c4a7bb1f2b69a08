"""DAPPLE's planner for a general cluster: stages, non-uniform replication, device placement."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jpipe.partition._cluster import Cluster
from jpipe.partition._cost import exposed_allreduce_table, latency_arrays
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
    prefix = lambda x: np.concatenate([[0.0], np.cumsum(x)])
    return _Costs(prefix(f), prefix(b), prefix(w), prefix(o), prefix(a), cut)


@functools.lru_cache(maxsize=1 << 16)
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
    """Devices per stage DAPPLE considers: a power of two, or whole servers."""
    opts = {2 ** i for i in range(int(math.log2(n)) + 1)}
    opts |= {per_server * i for i in range(1, n // per_server + 1)}
    return sorted(x for x in opts if 1 <= x <= n)


class _Evaluator:
    """Latency and memory of plans whose last two stages vary over a range of split points."""

    def __init__(self, c: _Costs, global_batch: int, cluster: Cluster, min_samples: int,
                 optimizer_factor: float | None, overlap: bool = True):
        self.c, self.G, self.cluster, self.min_samples = c, global_batch, cluster, min_samples
        self.optimizer_factor = optimizer_factor
        self.overlap = overlap
        self.divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        self._exposed: dict[tuple[float, int], np.ndarray] = {}

    def allreduce(self, lo: np.ndarray | int, hi: np.ndarray | int, alloc: tuple[int, ...], per: int,
                  overlapped: bool) -> np.ndarray:
        """Seconds of stage ``[lo, hi)``'s all-reduce after its last backward (``per`` samples a replica);
        ``overlapped``: only what that backward leaves exposed."""
        seconds_per_byte = self.cluster.allreduce_time(1.0, alloc)
        c = self.c
        if not overlapped:
            return seconds_per_byte * (c.w[hi] - c.w[lo])
        key = (seconds_per_byte, per)
        if key not in self._exposed:
            self._exposed[key] = exposed_allreduce_table(np.diff(c.b) * per, np.diff(c.w) * seconds_per_byte)
        return self._exposed[key][lo, hi]

    def microbatch(self, max_replicas: int) -> int:
        """Samples per micro-batch: the smallest divisor of the batch with ``min_samples`` per replica of the
        widest stage."""
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
            per = math.ceil(b / r)  # samples are whole: the replica with the most paces the stage
            F[2 * s] = (c.f[hi] - c.f[lo]) * per
            B[2 * s] = (c.b[hi] - c.b[lo]) * per
            w = c.w[hi] - c.w[lo]
            AR[2 * s] = self.allreduce(lo, hi, alloc, per, overlapped=self.overlap and K == 1)
            opt = (c.o[hi] - c.o[lo]) if self.optimizer_factor is None else self.optimizer_factor * w
            held = min(K - s, M)
            mem = 2 * w + opt + held * (c.a[hi] - c.a[lo]) * per
            feasible &= mem <= cl.device_memory
            if s < K - 1:
                t = cl.transfer_time(1.0, alloc, stages[s + 1][2]) * b * c.cut[np.asarray(hi) - 1]
                F[2 * s + 1] = t
                B[2 * s + 1] = t
        total, _, _, _, pivot = latency_arrays(F, B, AR, M)
        return np.where(feasible, total, np.inf), pivot, M, b


SEARCHES = ("dapple", "full")


def dapple_plan(profile: Profile, global_batch: int, cluster: Cluster, *, search: str = "dapple",
                min_samples_per_replica: int | None = None, optimizer_factor: float | None = None,
                beam: int = 1, overlap: bool = True) -> DapplePlan:
    """DAPPLE's planner: the fastest stages, replica counts and device placement for ``cluster``.

    Every plan is scored with :func:`jpipe.partition.dapple_latency`
    (transfers between stages are stages of their own, see
    :meth:`Cluster.transfer_time`). A stage runs on a power-of-two number of
    devices or on whole servers. A micro-batch gives each replica of the most
    replicated stage ``min_samples_per_replica`` samples (default: the
    profile batch size, the batch the times were measured at; times scale
    linearly from it), so ``M = global_batch / (that x max replicas)``.

    ``search="dapple"`` is the space of DAPPLE's published planner, whose
    decisions (Table 4) are data parallel, straight pipelines (one device per
    stage, every device used) or two stages ``a:b`` (any split, any replica
    counts, placed Fresh / Append / Scatter First). ``search="full"`` is the
    dynamic programme over "the first ``j`` layers are planned on ``m``
    devices; the remaining layers form one last stage replicated on every other
    device" (keeping the ``beam`` best plans per state): each step splits that
    last stage at every layer boundary, giving the new stage ``k`` devices
    placed by each policy; every "S stages x r replicas" plan with a balanced
    split is also scored. It finds deeper hybrid plans (``4:4:4:4``) that the
    latency model prefers at times but DAPPLE never reports.

    ``overlap=True`` (default) is the overlap model of DAPPLE's planner code
    (AlibabaPAI/DAPPLE): data parallelism all-reduces each layer's gradient
    while the last micro-batch's backward goes on through the layers before it
    (``cc_overlap.rs``; :func:`jpipe.partition.overlapped_allreduce`), so it
    pays only the exposed part. A pipeline stage's all-reduce starts after its
    own last backward and overlaps only the backward still running on the
    stages before it, the end phase of :func:`dapple_latency`
    (``sync_pipeline.rs`` charges ``max_i (AR_i - i x slot)``; the paper
    describes the same end phase). ``overlap=False`` charges data parallelism
    ``M (F + B) + AR``, with no overlap. Overlapping every stage's all-reduce
    with its own backward too (not what DAPPLE modelled) would match 7 of the 9
    published Table 4 cells instead of 8.

    Plans whose stage needs more than ``cluster.device_memory`` (``2 W +
    optimizer state + K_s`` micro-batches of activations, ``K_s`` the 1F1B
    warm-up) are skipped; ``optimizer_factor`` overrides the profile's
    optimizer-state bytes as a multiple of the weights.

    >>> from jpipe.partition import Cluster, LayerCost, Profile
    >>> layer = LayerCost("l", forward=0.01, backward=0.02, activation_bytes=1e6, param_bytes=4e8)
    >>> plan = dapple_plan(Profile(layers=(layer,) * 32, microbatch_size=4), 64, Cluster.preset("dapple-B"))
    >>> plan.pattern, plan.split          # big weights, slow network: no all-reduce at all
    ('straight', '2:2:2:2:2:2:2:2:2:2:2:2:2:2:2:2')
    """
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    if min_samples_per_replica is None:
        min_samples_per_replica = profile.microbatch_size
    c = _costs(profile)
    L = profile.num_layers
    ev = _Evaluator(c, global_batch, cluster, min_samples_per_replica, optimizer_factor, overlap)
    everything = tuple(cluster.devices_per_server for _ in range(cluster.servers))
    dp_latency = float(ev.evaluate([(0, L, everything)], 1)[0][0])
    candidates = [(dp_latency, [(0, L, everything, "fresh")])]
    if search == "dapple":
        candidates += _two_stage_plans(ev, L, cluster)
        candidates += _straight_plans(ev, L, cluster)
    else:
        candidates += _dp_plans(ev, L, cluster, beam)
        candidates += _uniform_plans(ev, L, cluster)
    latency, raw = min(candidates, key=lambda c: c[0])
    if not math.isfinite(latency):
        raise ValueError(f"no plan fits in {cluster.device_memory / 1e9:.1f} GB per device; use a cluster "
                         f"with more memory or devices, or a smaller global batch")
    return _finish(raw, ev, cluster, dp_latency)


def _rest(cluster: Cluster, used: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(cluster.devices_per_server - u for u in used)


def _two_stage_plans(ev: _Evaluator, L: int, cluster: Cluster) -> list[tuple[float, list]]:
    """The best ``a:b`` plan per (a, placement): every split, scored at once."""
    N, dps = cluster.num_devices, cluster.devices_per_server
    options = _replica_options(N, dps)
    empty = (0,) * cluster.servers
    splits = np.arange(1, L)
    out = []
    if L < 2:
        return out
    for k in options:
        if k >= N or (N - k) not in options:
            continue
        seen = set()
        for policy in POLICIES:
            alloc = _place(empty, k, policy, dps)
            if alloc is None or alloc in seen:
                continue
            seen.add(alloc)
            second = _rest(cluster, alloc)
            lat = ev.evaluate([(0, splits, alloc), (splits, L, second)], len(splits))[0]
            i = int(np.argmin(lat))
            out.append((float(lat[i]), [(0, int(splits[i]), alloc, policy), (int(splits[i]), L, second, "rest")]))
    return out


def _minmax_split(work: np.ndarray, L: int, stages: int) -> list[int]:
    """Boundaries of ``stages`` contiguous ranges minimising the largest ``work[hi] - work[lo]``."""
    INF = np.inf
    best = np.full(L + 1, INF)
    best[1:] = work[1:] - work[0]
    arg = np.zeros((stages, L + 1), int)
    for s in range(1, stages):
        new = np.full(L + 1, INF)
        for j in range(s + 1, L + 1):
            i = np.arange(s, j)
            cost = np.maximum(best[i], work[j] - work[i])
            t = int(np.argmin(cost))
            new[j], arg[s, j] = cost[t], i[t]
        best = new
    bounds = [L]
    for s in range(stages - 1, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    return [0] + bounds[::-1]


def _placed_plans(ev: _Evaluator, cluster: Cluster, replicas: Sequence[int],
                  bounds: Sequence[int]) -> list[tuple[float, list]]:
    """Stages ``[bounds[s], bounds[s+1])`` on ``replicas[s]`` devices, once per distinct placement."""
    out, seen = [], set()
    for policy in POLICIES:
        used = (0,) * cluster.servers
        raw = []
        for s, k in enumerate(replicas):
            alloc = _place(used, k, policy, cluster.devices_per_server)
            if alloc is None:
                break
            used = tuple(u + a for u, a in zip(used, alloc))
            raw.append((bounds[s], bounds[s + 1], alloc, policy))
        allocs = tuple(a for _, _, a, _ in raw)
        if len(raw) < len(replicas) or allocs in seen:
            continue
        seen.add(allocs)
        out.append((float(ev.evaluate([(lo, hi, a) for lo, hi, a, _ in raw], 1)[0][0]), raw))
    return out


def _straight_plans(ev: _Evaluator, L: int, cluster: Cluster) -> list[tuple[float, list]]:
    """One device per stage on every device, split to balance F+B, each placement policy."""
    N = cluster.num_devices
    if N < 2 or L < N:
        return []
    return _placed_plans(ev, cluster, [1] * N, _minmax_split(ev.c.f + ev.c.b, L, N))


def dapple_plan_for(profile: Profile, global_batch: int, cluster: Cluster, replicas: Sequence[int],
                    split: Sequence[int] | None = None, *, overlap: bool = True,
                    min_samples_per_replica: int | None = None,
                    optimizer_factor: float | None = None) -> DapplePlan:
    """One plan shape scored as :func:`dapple_plan` scores it, on its best device placement.

    ``replicas[s]`` devices run stage ``s``, whose layers are ``split[s]``
    (default: the split that balances forward + backward). Its ``latency`` is
    ``inf`` where a stage does not fit in ``cluster.device_memory``. Use it to
    ask what a plan that the planner did not choose would cost.

    >>> from jpipe.partition import Cluster, LayerCost, Profile
    >>> layer = LayerCost("l", forward=0.01, backward=0.02, activation_bytes=1e6, param_bytes=4e8)
    >>> prof = Profile(layers=(layer,) * 32, microbatch_size=4)
    >>> plan = dapple_plan_for(prof, 64, Cluster.preset("dapple-A"), replicas=(8, 8), split=(16, 16))
    >>> plan.pattern, plan.split, plan.latency > dapple_plan(prof, 64, Cluster.preset("dapple-A")).latency
    ('8:8', '16:16', True)
    """
    L, costs = profile.num_layers, _costs(profile)
    if sum(replicas) != cluster.num_devices or min(replicas) < 1:
        raise ValueError(f"replicas {tuple(replicas)} must be >= 1 each and use all {cluster.num_devices} devices")
    if split is None:
        bounds = _minmax_split(costs.f + costs.b, L, len(replicas))
    else:
        if len(split) != len(replicas) or sum(split) != L or min(split) < 1:
            raise ValueError(f"split {tuple(split)} needs one entry >= 1 per stage of replicas "
                             f"{tuple(replicas)}, summing to the {L} layers")
        bounds = [0, *np.cumsum(split).tolist()]
    if min_samples_per_replica is None:
        min_samples_per_replica = profile.microbatch_size
    ev = _Evaluator(costs, global_batch, cluster, min_samples_per_replica, optimizer_factor, overlap)
    everything = tuple(cluster.devices_per_server for _ in range(cluster.servers))
    dp_latency = float(ev.evaluate([(0, L, everything)], 1)[0][0])
    placed = _placed_plans(ev, cluster, list(replicas), bounds)
    if not placed:
        raise ValueError(f"replicas {tuple(replicas)} cannot be placed on {cluster.servers} servers of "
                         f"{cluster.devices_per_server} devices")
    return _finish(min(placed, key=lambda c: c[0])[1], ev, cluster, dp_latency)


def _dp_plans(ev: _Evaluator, L: int, cluster: Cluster, beam: int) -> list[tuple[float, list]]:
    """The ``search="full"`` dynamic programme; returns the best plan of every state."""
    N, dps = cluster.num_devices, cluster.devices_per_server
    options = _replica_options(N, dps)
    option_set = set(options)
    empty = (0,) * cluster.servers
    # state (j, m) -> up to `beam` entries (latency with the rest as one stage, stages, used)
    State = tuple[float, list, tuple[int, ...]]
    best: dict[tuple[int, int], list[State]] = {(0, 0): [(math.inf, [], empty)]}

    def offer(key: tuple[int, int], entry: State) -> None:
        entries = best.setdefault(key, [])
        if len(entries) == beam and entry[0] >= entries[-1][0]:
            return
        entries.append(entry)
        entries.sort(key=lambda e: e[0])
        del entries[beam:]

    # worst kept latency per state: a split only reaches Python when it beats it
    bar = np.full((L + 1, N + 1), np.inf)
    for j in range(L - 1):
        splits = np.arange(j + 1, L)
        for m in sorted(mm for (jj, mm) in best if jj == j):
            for _, prefix, used in list(best[(j, m)]):
                fixed = [(lo, hi, alloc) for lo, hi, alloc, _ in prefix]
                for k in options:
                    if m + k >= N or (N - m - k) not in option_set:
                        continue
                    seen = set()
                    for policy in POLICIES:
                        alloc = _place(used, k, policy, dps)
                        if alloc is None or alloc in seen:
                            continue
                        seen.add(alloc)
                        used2 = tuple(u + a for u, a in zip(used, alloc))
                        lat = ev.evaluate(fixed + [(j, splits, alloc), (splits, L, _rest(cluster, used2))],
                                          len(splits))[0]
                        for i in np.flatnonzero(lat < bar[splits, m + k]):
                            key = (int(splits[i]), m + k)
                            offer(key, (float(lat[i]), prefix + [(j, int(splits[i]), alloc, policy)], used2))
                            if len(best[key]) == beam:
                                bar[key] = best[key][-1][0]
    return [(e[0], e[1] + [(key[0], L, _rest(cluster, e[2]), "rest")])
            for key, es in best.items() if key != (0, 0) for e in es]


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
        fwd = (c.f[hi] - c.f[lo]) * math.ceil(b / sum(alloc))
        t = cluster.transfer_time(c.cut[hi - 1] * b, alloc, raw[s + 1][2])
        ratio = max(ratio, t / fwd if fwd > 0 else math.inf)
    return DapplePlan(tuple(stages), M, b, float(total[0]), int(pivot[0]) // 2, dp_latency, ratio)
