"""jpipe's mesh planner: mesh shape x uneven partition x micro-batches x schedule, from profiled costs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jpipe._plan import Plan
from jpipe._state import batch_size_of
from jpipe.partition._profile import CommCost, Profile, interpolate
from jpipe.schedules import Costs, schedule_traits, simulate

DEFAULT_SCHEDULES = ("gpipe", "1f1b", "1f1b-b")
# Relative difference of two predicted step times below which the planner treats them as a tie
# (profiles taken back to back on a shared machine differ by about this much).
TIE = 0.05


class Memory(NamedTuple):
    """Predicted bytes on a plan's fullest device, term by term (:func:`predict_memory`).

    What the device stores (``params``, ``optimizer``) plus the compiled step's
    temporary bytes (:attr:`temp`), the larger of two moments: the loop over ticks
    (:attr:`loop`: ``gathered`` + ``accumulators`` + ``buffers`` + ``tick`` +
    ``old_optimizer``) and the end of the step (``reduction``).

    - ``params``, ``optimizer``: the device's shard of the parameters and the optimizer
      state at the plan's ``shard`` level (stages padded to the largest).
    - ``gathered``: the whole copies of what is stored split: ``pre`` and ``post`` (shard
      set), the stage's parameters (``"parameters"``).
    - ``accumulators``: the float32 gradient accumulators of the stage, ``pre`` and ``post``.
    - ``buffers``: what the schedule holds -- ``in_depth + 1`` stage inputs, ``res_depth``
      slots of a chunk's residuals, ``cot_depth + 1`` cotangents, twice (XLA copies the
      cotangent buffer that a tick both reads and writes).
    - ``tick``: the largest action's temporaries: a backward's copy of its residual slot
      (where it loops over more than one layer), its chunk's gradients, a few activations
      and ``pre``'s gradients; or adding the chunk's gradients into their float32
      accumulator (the gradients, their float32 sum, and a layer's float32 gradient before
      its cast where weights are narrower); or the head's forward and gradient on the last
      stage; plus, with several chunks a device, a copy of the chunk's weights.
    - ``old_optimizer``: the old optimizer state, copied while the new one is written
      over it (held through the loop where the state is split).
    - ``reduction``: the end of the step: the gradients reduced over more than one
      device and their flat copy, and the old optimizer state (where it is whole, as much of
      it as the gradient accumulators displaced from its donated place).

    >>> m = Memory(params=4.0, optimizer=8.0, gathered=1.0, accumulators=4.0, buffers=2.0, tick=8.0,
    ...            old_optimizer=2.0, reduction=10.0)
    >>> m.loop, m.temp, m.total
    (17.0, 17.0, 29.0)
    """

    params: float
    optimizer: float
    gathered: float
    accumulators: float
    buffers: float
    tick: float
    old_optimizer: float
    reduction: float

    @property
    def loop(self) -> float:
        """Temporary bytes while the ticks run."""
        return self.gathered + self.accumulators + self.buffers + self.tick + self.old_optimizer

    @property
    def temp(self) -> float:
        """The step's temporary bytes (what ``jpipe.compiled_memory(...)["temp"]`` measures)."""
        return max(self.loop, self.reduction)

    @property
    def state(self) -> float:
        """Bytes stored between steps: the device's parameters and optimizer state."""
        return self.params + self.optimizer

    @property
    def total(self) -> float:
        """What the device holds at the step's peak: state plus temporaries."""
        return self.state + self.temp

    def explain(self) -> str:
        """The terms as text, in MiB."""
        mib = lambda x: f"{x / 2**20:.3f}"
        terms = ", ".join(f"{k} {mib(v)}" for k, v in self._asdict().items())
        return f"{mib(self.total)} MiB = state {mib(self.state)} + temp {mib(self.temp)} ({terms})"


class StepTime(NamedTuple):
    """Predicted seconds of one step, term by term (:func:`evaluate`); :attr:`total` is their sum.

    - ``compute``: the busiest device's forwards and backwards as profiled (every micro-batch
      through its stages, stash copies included).
    - ``bubble``: lock-step waiting: ticks last as long as their slowest device.
    - ``communication``: every tick's exchange of activations and cotangents with the pipe
      neighbours.
    - ``contention``: devices that share compute (simulated devices on one host) were profiled
      all computing at once; ticks in which only some compute run faster, so this is <= 0.
    - ``allreduce``: the collectives at the ends of the step (gradients reduced over ``pipe``
      and ``data``, split weights gathered).
    - ``optimizer``: the optimizer update of the largest stage with ``pre`` and ``post``.
    - ``overhead``: what a step costs beyond its parts at the plan's micro-batch size.

    >>> t = StepTime(compute=8e-3, bubble=2e-3, communication=1e-3, contention=-1e-3, allreduce=0.0,
    ...              optimizer=5e-4, overhead=5e-4)
    >>> round(t.total * 1e3, 6)
    11.0
    >>> print(t.explain())  # doctest: +NORMALIZE_WHITESPACE
    11.00 ms = compute 8.00 + bubble 2.00 + communication 1.00 + contention -1.00 + allreduce 0.00
               + optimizer 0.50 + overhead 0.50
    """

    compute: float
    bubble: float
    communication: float
    contention: float
    allreduce: float
    optimizer: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(self)

    def explain(self) -> str:
        """The terms as a sum, in milliseconds."""
        terms = " + ".join(f"{k} {v * 1e3:.2f}" for k, v in self._asdict().items())
        return f"{self.total * 1e3:.2f} ms = {terms}"


class Candidate(NamedTuple):
    """One plan with its predicted step time (s; the total of ``time_terms``, a :class:`StepTime`),
    bubble fraction and peak bytes per device (the total of ``terms``, a :class:`Memory`), and its
    measured step time (s) once :func:`refine` has timed it (else ``None``)."""

    plan: Plan
    step_time: float
    bubble: float
    memory: float
    fits: bool
    measured: float | None = None
    terms: Memory | None = None
    time_terms: StepTime | None = None


class PlanChoice(NamedTuple):
    """What :func:`plan` returns: the chosen plan and every candidate, the chosen first, then fastest
    first (the chosen is the fastest that fits, or, among those predicted within :data:`TIE` of it, the
    one with the least memory, then the fewest micro-batches)."""

    plan: Plan
    candidates: tuple[Candidate, ...]

    def table(self, top: int | None = 20) -> str:
        """The ranked candidates as text (what ``jpipe plan`` prints)."""
        return format_candidates(self.candidates[:top] if top else self.candidates)

    def explain(self, top: int = 3) -> str:
        """Why the ``top`` candidates rank as they do: each prediction's time and memory terms
        (what ``jpipe plan --explain`` prints)."""
        lines = []
        for i, c in enumerate(self.candidates[:top], 1):
            p = c.plan
            lines.append(f"#{i} pipe {p.pipe} x data {p.data}, M={p.microbatches}, {p.schedule}"
                         f"{'+fused' if p.fuse_ticks else ''}:")
            if c.time_terms is not None:
                lines.append(f"    time   {c.time_terms.explain()}")
            if c.terms is not None:
                lines.append(f"    memory {c.terms.explain()}")
        return "\n".join(lines)


def format_candidates(candidates: Sequence[Candidate]) -> str:
    """A text table: rank, pipe x data, micro-batches, schedule, partition, time, bubble, memory (and the
    measured time, where :func:`refine` measured any)."""
    timed = any(c.measured is not None for c in candidates)
    head = f"{'#':>3} {'pipe':>4} {'data':>4} {'M':>4} {'schedule':<12} {'partition':<22} " \
           f"{'step ms':>9}{' measured' if timed else ''} {'bubble':>7} {'MiB/dev':>9} fits"
    rows = [head]
    for i, c in enumerate(candidates, 1):
        p = c.plan
        part = ",".join(map(str, p.partition)) if p.partition else "-"
        if len(part) > 22:
            part = part[:19] + "..."
        name = str(p.schedule) + ("+fused" if p.fuse_ticks else "")
        measured = "" if not timed else f"{'-':>9}" if c.measured is None else f"{c.measured * 1e3:>9.2f}"
        rows.append(f"{i:>3} {p.pipe:>4} {p.data:>4} {p.microbatches:>4} {name:<12} {part:<22} "
                    f"{c.step_time * 1e3:>9.2f}{' ' * timed}{measured} {c.bubble:>7.1%} {c.memory / 2**20:>9.1f} "
                    f"{'yes' if c.fits else 'NO'}")
    return "\n".join(rows)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def balanced_partition(profile: Profile, stages: int) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's forward + backward.

    Dynamic programming over contiguous layer ranges; ``pre`` costs count on
    the first stage and ``post`` costs on the last. Among partitions with the
    same slowest stage, the one with the smallest sum of squared stage times wins.

    >>> from jpipe.partition import LayerCost, Profile
    >>> layer = LayerCost("l", 1.0, 2.0, 0, 0)
    >>> pre = LayerCost("pre", 3.0, 3.0, 0, 0)     # 3 + 3 + 3 (its forward re-runs in the backward)
    >>> post = LayerCost("post", 3.0, 6.0, 0, 0)   # each costs as much as 3 layers
    >>> balanced_partition(Profile(layers=(layer,) * 12, microbatch_size=1, pre=pre, post=post), 3)
    (3, 6, 3)
    """
    L = profile.num_layers
    if not 1 <= stages <= L:
        raise ValueError(f"cannot split {L} layers into {stages} stages; use 1 <= stages <= {L}")
    work = np.array([l.forward + l.backward for l in profile.layers])
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    pre = 0.0 if profile.pre is None else profile.pre.forward * 2 + profile.pre.backward
    post = 0.0 if profile.post is None else profile.post.forward + profile.post.backward

    def cost(s: int, lo: int, hi: int) -> float:
        c = prefix[hi] - prefix[lo]
        if s == 0:
            c += pre
        if s == stages - 1:
            c += post
        return c

    # best[s][j]: (bottleneck, sum of squares, boundaries) for layers [0, j) on stages 0..s
    INF = (math.inf, math.inf, ())
    best = [[INF] * (L + 1) for _ in range(stages)]
    for j in range(1, L - stages + 2):
        c = cost(0, 0, j)
        best[0][j] = (c, c * c, (j,))
    for s in range(1, stages):
        for j in range(s + 1, L + 1):
            if s == stages - 1 and j != L:
                continue
            options = []
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf:
                    continue
                c = cost(s, i, j)
                options.append((max(prev[0], c), prev[1] + c * c, prev[2] + (j,)))
            if options:
                best[s][j] = min(options, key=lambda o: (round(o[0], 12), o[1]))
    bounds = (0,) + best[stages - 1][L][2]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def stage_costs(profile: Profile, partition: Sequence[int]) -> tuple[list[float], list[float]]:
    """Per-stage forward and backward seconds as jpipe's executor runs them.

    The first stage's forward runs ``pre``; its backward re-runs ``pre``'s
    forward and runs its backward. The last stage's forward runs ``post``, the
    loss and their gradient (``value_and_grad``), so ``post``'s backward is in
    the forward tick.
    """
    fwd, bwd, start = [], [], 0
    n = len(partition)
    for s, count in enumerate(partition):
        layers = profile.layers[start:start + count]
        start += count
        f = sum(l.forward for l in layers)
        b = sum(l.backward for l in layers)
        if s == 0 and profile.pre is not None:
            f += profile.pre.forward
            b += profile.pre.forward + profile.pre.backward
        if s == n - 1 and profile.post is not None:
            f += profile.post.forward + profile.post.backward
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd


def _allreduce(comm: CommCost | None, size: float, n: int) -> float:
    return 0.0 if comm is None else comm.allreduce_time(size, n)


def _reduce_scatter(comm: CommCost | None, size: float, n: int) -> float:
    return 0.0 if comm is None else comm.reduce_scatter_time(size, n)


def _all_gather(comm: CommCost | None, size: float, n: int) -> float:
    return 0.0 if comm is None else comm.all_gather_time(size, n)


def _stage(prof: Profile, plan: Plan) -> tuple[int, int]:
    """(layers a chunk holds, padded to the largest stage; chunks a device holds)."""
    return max(plan.stage_partition(prof.num_layers)), plan.virtual_stages


def _reductions(prof: Profile, plan: Plan, comm: CommCost | None) -> float:
    """Seconds of the executor's collectives at the ends of a step, for the plan's ``shard`` level.

    Gradients are reduced in float32 (their accumulators' bytes): ``pre``/``post``'s over the whole
    mesh, the stage's over ``data`` -- all-reduced (``shard=None``) or reduce-scattered to where the
    optimizer state lives (half the ring traffic). Where ``pre``/``post`` are stored split they are
    all-gathered whole for the step; the stage's parameters are all-gathered over ``data``: the
    updated ones at ``"optimizer"`` (stored whole on every data replica), at the step's start at
    ``"parameters"``. One collective each, whatever the number of tensors.
    """
    layers, chunks = _stage(prof, plan)
    layer = prof.layers[0]
    io = [p for p in (prof.pre, prof.post) if p is not None]
    n = plan.pipe * plan.data
    io_grads = sum(p.accumulator_bytes for p in io)
    stage_grads = chunks * layers * layer.accumulator_bytes
    if plan.shard is None:
        return _allreduce(comm, io_grads, n) + _allreduce(comm, stage_grads, plan.data)
    io_params = sum(p.param_bytes for p in io)
    stage_params = chunks * layers * layer.param_bytes
    return (_reduce_scatter(comm, io_grads, n) + _reduce_scatter(comm, stage_grads, plan.data)
            + _all_gather(comm, io_params, n) + _all_gather(comm, stage_params, plan.data))


def predict_memory(profile: Profile, plan: Plan, global_batch: int) -> Memory:
    """Predicted bytes on the plan's fullest device: what it stores plus the compiled step's
    temporaries, term by term (see :class:`Memory`), from the profile's sizes -- parameter,
    optimizer-state and float32 accumulator bytes of a layer, ``pre`` and ``post`` in their dtypes,
    and a layer's activation and residual bytes at the plan's micro-batch -- and the schedule's
    buffer depths. Every device of the mesh runs the same program, so each holds as much.

    Derived from the executor (``jpipe._executor``) and calibrated against
    ``jpipe.compiled_memory`` on CPU: within 10 % of the measured state plus temp on the plans
    of ``tests/test_planner_memory.py``.

    >>> from jpipe.partition import LayerCost, Profile
    >>> layer = LayerCost("l", 0, 0, activation_bytes=1e3, param_bytes=1e6, optimizer_bytes=2e6,
    ...                   residual_bytes=3e3)
    >>> prof = Profile(layers=(layer,) * 8, microbatch_size=4)
    >>> m = predict_memory(prof, Plan(pipe=4, data=2, microbatches=4, shard="optimizer"), 32)
    >>> m.params, m.optimizer, m.accumulators       # 2 layers a stage; the state split over data
    (2000000.0, 2000000.0, 2000000.0)
    >>> m.tick == 2 * 2e6                           # the chunk's gradients and their float32 sum
    True
    """
    b = global_batch / (plan.data * plan.microbatches)
    prof = profile.scaled(b)
    layers, chunks = _stage(prof, plan)
    layer = prof.layers[0]
    table = plan.unvalidated_table()
    n, data, shard = plan.pipe * plan.data, plan.data, plan.shard
    pre_p = 0.0 if prof.pre is None else prof.pre.param_bytes
    post_p = 0.0 if prof.post is None else prof.post.param_bytes
    io = [p for p in (prof.pre, prof.post) if p is not None]
    io_params = pre_p + post_p
    io_opt = sum(p.optimizer_bytes for p in io)
    io_grads = sum(p.accumulator_bytes for p in io)
    stage_params = chunks * layers * layer.param_bytes      # padded to the largest stage
    stage_opt = chunks * layers * layer.optimizer_bytes
    stage_grads = chunks * layers * layer.accumulator_bytes
    # what a device stores (jpipe._sharding): pre/post and optimizer state over the whole mesh once split
    if shard is None:
        params, optimizer = io_params + stage_params, io_opt + stage_opt
    elif shard == "optimizer":
        params, optimizer = io_params / n + stage_params, io_opt / n + stage_opt / data
    else:
        params, optimizer = io_params / n + stage_params / data, io_opt / n + stage_opt / data
    # what is stored split is gathered whole for the step (nothing is split on one device; stages over data)
    split_stages = shard == "parameters" and data > 1
    gathered = (io_params if shard is not None and n > 1 else 0.0) + (stage_params if split_stages else 0.0)
    accumulators = stage_grads + io_grads
    act = layer.activation_bytes
    # one micro-batch's residuals of a chunk; with stages of unequal lengths every layer runs masked
    # (a lax.cond, whose residuals keep the layer's weights too)
    uneven = len(set(plan.stage_partition(prof.num_layers))) > 1
    chunk_res = layers * (layer.residual_bytes + (layer.mask_bytes if uneven else 0.0))
    res_slots = 0 if plan.remat else table.res_depth
    buffers = (table.in_depth + 1) * act + res_slots * chunk_res + 2 * (table.cot_depth + 1) * act
    tick = _largest_action(prof, plan, table, layers, chunks, chunk_res)
    # the old optimizer state is copied while the new one is written over it: through the loop where
    # it is split (at "parameters", with the parameters split alike, about half of it); where it is
    # whole, XLA puts the loop's buffers in its donated place meanwhile and the copy counts at the end
    split_opt = (io_opt / n if shard is not None and n > 1 else 0.0) + \
        (stage_opt / data if shard is not None and data > 1 else 0.0)
    old_optimizer = split_opt * (0.5 if split_stages else 1.0)
    # the end of the step: each reduced group of gradients (over more than one device) and its flat copy,
    # with the old optimizer state -- where it is whole, as much of it as the accumulators displaced
    # (the NaN guard selects between the old and the updated state only after checking the updated
    # parameters, so XLA writes most of the update in place; calibrated against compiled_memory on CPU)
    reduced = (io_grads if n > 1 else 0.0) + (stage_grads if data > 1 else 0.0)
    displaced = optimizer if shard is not None else min(optimizer, accumulators)
    reduction = 2 * reduced + displaced
    return Memory(float(params), float(optimizer), float(gathered), float(accumulators), float(buffers),
                  float(tick), float(old_optimizer), float(reduction))


def _largest_action(prof: Profile, plan: Plan, table: Any, layers: int, chunks: int, chunk_res: float) -> float:
    """:attr:`Memory.tick`: the temporaries of the largest action of a tick, at the profile's scale."""
    layer = prof.layers[0]
    act = layer.activation_bytes
    pre_p = 0.0 if prof.pre is None else prof.pre.param_bytes
    post_p = 0.0 if prof.post is None else prof.post.param_bytes
    # the largest action: a backward holds the chunk's gradients, pre's gradient (or its zeros on later
    # stages), a few activations, and, where its loop over layers runs more than once, a copy of its
    # residual slot out of the stash (a run-time index; with one slot the copy folds away; with remat
    # the residuals are recomputed) ...
    looped = layers > 1
    slot = chunk_res if looped and (plan.remat or table.res_depth > 1) else 0.0
    chunk_params, chunk_grads = layers * layer.param_bytes, layers * layer.accumulator_bytes
    backward = slot + chunk_params + pre_p + _TICK_ACTIVATIONS * act
    # ... then adds them into the float32 accumulator: the gradients, their float32 sum, and, for
    # weights narrower than float32 in a loop over layers, a layer's float32 gradient before its cast ...
    narrow = layer.accumulator_bytes != layer.param_bytes
    accumulate = chunk_params + chunk_grads + (layer.accumulator_bytes if looped and narrow else 0.0)
    # ... or the last stage's forward runs the head and its gradient
    head = 0.0 if prof.post is None else prof.post.residual_bytes + post_p + 2 * act
    # (with several chunks a device, the chunk's weights are a run-time slice of the stack: a copy)
    tick = max(backward, accumulate, head) + (chunk_params if chunks > 1 else 0.0)
    return tick


# activations a backward holds beyond its residuals (the cotangents in and out, a layer's intermediates,
# the tick's zeros); calibrated against compiled_memory on CPU (6.5-8 for the MLP's, 16 for the GPT's)
_TICK_ACTIVATIONS = 8


def _contention(contention: float, pipe: int, data: int) -> list[float] | None:
    """The simulator's factor per number of stages computing in a tick (each on ``data`` devices), from a
    profile timed with all ``pipe x data`` devices computing, ``contention`` times slower than one alone:
    linear in the number of devices computing between ``1 / contention`` (one) and 1 (all)."""
    n = pipe * data
    if contention == 1.0 or n == 1:
        return None
    return [(1 + (contention - 1) * (k * data - 1) / (n - 1)) / contention for k in range(1, pipe + 1)]


def evaluate(profile: Profile, plan: Plan, global_batch: int, comm: CommCost | None = None) -> Candidate:
    """Predicted step time, bubble and peak memory per device of ``plan`` for ``profile``.

    ``profile`` is rescaled to the plan's micro-batch ``global_batch / (data x M)``;
    the step is the schedule simulator's lock-step makespan (every tick costs the
    slowest device's action plus the exchange of one micro-batch's activations
    and cotangents with the pipe neighbours) plus the gradient all-reduces
    (``pre``/``post`` over ``pipe``, then everything over ``data``) plus the
    optimizer update of the largest stage with ``pre`` and ``post``, plus what a step costs
    beyond its parts at the plan's micro-batch size (``profile.step_overhead_at``). Where the
    schedule holds more than one micro-batch's residuals on a device, every forward and backward
    also pays one copy of a stash slot (``profile.stash_copy``). Where devices slow each other
    down (``profile.contention`` > 1), a tick in which only some stages compute charges their
    actions less than the profiled cost (:func:`_contention`). The collectives at the ends of
    the step follow the plan's ``shard`` level (:func:`_reductions`). Memory is
    :func:`predict_memory`'s total: what the fullest device stores at the plan's ``shard`` level plus
    the compiled step's temporaries (the candidate's ``terms`` break it down); the step time is the
    total of the candidate's ``time_terms`` (a :class:`StepTime`).
    """
    comm = profile.comm if comm is None else comm
    b = global_batch / (plan.data * plan.microbatches)
    prof = profile.scaled(b)
    partition = plan.stage_partition(prof.num_layers)
    layer = prof.layers[0]
    hidden_bytes = layer.activation_bytes
    table = plan.unvalidated_table()  # registered generators are validated by the test suite
    fwd, bwd = stage_costs(prof, partition)
    max_layers = max(partition)
    if table.res_depth > 1 and prof.stash_copy and not plan.remat:
        # every device's stash has the deepest stage's slots, each the largest stage's residuals, and
        # its slot index is known only at run time: a forward copies into a slot, a backward out of it
        copy = interpolate(prof.stash_copy, max_layers * layer.residual_bytes)
        fwd, bwd = [f + copy for f in fwd], [b + copy for b in bwd]
    per_tick = comm.exchange_time(hidden_bytes) if (comm is not None and plan.pipe > 1) else 0.0
    factors = _contention(profile.contention, plan.pipe, plan.data)
    sim = simulate(table, Costs(forward=fwd, backward=bwd, comm=per_tick, contention=factors), mode="lockstep")
    communication = table.num_ticks * per_tick if table.num_devices > 1 else 0.0
    alone = sim if factors is None else simulate(table, Costs(forward=fwd, backward=bwd), mode="lockstep")
    ticks = alone.makespan - (communication if factors is None else 0.0)  # the ticks' actions, as profiled
    compute = float(np.max(alone.busy))
    io = [p for p in (prof.pre, prof.post) if p is not None]
    time_terms = StepTime(
        compute=compute,
        bubble=ticks - compute,
        communication=communication,
        contention=sim.makespan - communication - ticks,
        # the executor's ends of step: gradients reduced (or reduce-scattered), split weights gathered
        allreduce=_reductions(prof, plan, comm),
        # then every device runs the optimizer on its stage's layers and on pre and post
        optimizer=max_layers * layer.update + sum(p.update for p in io),
        overhead=profile.step_overhead_at(b),
    )
    time_terms = StepTime(*map(float, time_terms))
    terms = predict_memory(profile, plan, global_batch)
    bubble = float(sim.bubble_fraction)
    return Candidate(plan, time_terms.total, bubble, float(terms.total), True, terms=terms, time_terms=time_terms)


def microbatch_sizes(num_devices: int, global_batch: int, max_microbatches: int = 64) -> list[int]:
    """Every micro-batch size :func:`search` considers: ``global_batch / (data x M)``, smallest first.

    >>> microbatch_sizes(2, 16)
    [1, 2, 4, 8, 16]
    """
    sizes = {global_batch // (data * m) for data in _divisors(num_devices) if global_batch % data == 0
             for m in _divisors(global_batch // data) if m <= max_microbatches}
    return sorted(sizes)


def profile_sizes(num_devices: int, global_batch: int, max_microbatches: int = 64, count: int = 4) -> list[int]:
    """At most ``count`` of :func:`microbatch_sizes`, spread from the smallest to the largest: the
    sizes :func:`plan` profiles at (times between them are interpolated).

    >>> profile_sizes(8, 64)
    [1, 4, 16, 64]
    """
    sizes = microbatch_sizes(num_devices, global_batch, max_microbatches)
    if len(sizes) <= count:
        return sizes
    return sorted({sizes[round(i * (len(sizes) - 1) / (count - 1))] for i in range(count)})


def search(profile: Profile, num_devices: int, global_batch: int, *, memory_limit: float | None = None,
           schedules: Sequence[str] = DEFAULT_SCHEDULES, max_microbatches: int = 64) -> PlanChoice:
    """Ranks every (pipe x data, partition, micro-batches, schedule) for a profiled model.

    ``pipe`` runs over the divisors of ``num_devices`` up to the number of
    layers, ``data`` is the rest, the micro-batch count over the divisors of
    the per-replica batch (at most ``max_microbatches``), the partition is the
    :func:`balanced_partition` for ``pipe`` stages. The choice is the fastest
    plan whose memory fits ``memory_limit`` bytes per device; plans predicted
    within :data:`TIE` of it count as a tie, won by the least memory, then the
    fewest micro-batches. When no plan fits, the error names the smallest.

    >>> from jpipe.partition import LayerCost, Profile
    >>> layer = LayerCost("l", 1e-3, 2e-3, activation_bytes=1e3, param_bytes=1e6, optimizer_bytes=2e6)
    >>> choice = search(Profile(layers=(layer,) * 8, microbatch_size=4), num_devices=4, global_batch=16)
    >>> choice.plan.pipe * choice.plan.data
    4
    """
    L = profile.num_layers
    out: list[Candidate] = []
    for pipe in _divisors(num_devices):
        if pipe > L:
            continue
        data = num_devices // pipe
        if global_batch % data:
            continue
        scaled = profile.scaled(global_batch / data)  # partition on this replica's work
        partition = balanced_partition(scaled, pipe)
        for m in _divisors(global_batch // data):
            if m > max_microbatches:
                continue
            for schedule in (schedules if pipe > 1 else ("1f1b",)):
                traits = schedule_traits(schedule)
                if m < traits.min_microbatches(pipe):
                    continue  # the same table as another schedule's
                for fused in (False, True) if traits.fuses else (False,):
                    plan = Plan(pipe=pipe, data=data, microbatches=m, schedule=schedule,
                                partition=partition, fuse_ticks=fused)
                    cand = evaluate(profile, plan, global_batch)
                    fits = memory_limit is None or cand.memory <= memory_limit
                    out.append(cand._replace(fits=fits))
    if not out:
        raise ValueError(f"no plan for {num_devices} devices and a batch of {global_batch}: the batch must "
                         f"be divisible by the data-parallel size; use a batch that is a multiple of "
                         f"{num_devices}")
    out.sort(key=lambda c: (not c.fits, c.step_time, c.memory))  # equal time: less memory first
    if not out[0].fits:
        least = min(out, key=lambda c: c.memory)
        p = least.plan
        raise ValueError(
            f"no plan fits in {memory_limit / 2**20:.1f} MiB per device: the smallest, pipe {p.pipe} x data "
            f"{p.data} with {p.microbatches} micro-batches ({p.schedule}), needs {least.memory / 2**20:.1f} MiB; "
            f"allow at least that much memory per device, use more devices or a smaller model or batch")
    # predictions this close are within the model's error: the one with less memory, then fewer
    # micro-batches, goes first, so that the choice does not flip with a profile's noise
    close = [c for c in out if c.fits and c.step_time <= out[0].step_time * (1 + TIE)]
    first = min(close, key=lambda c: (c.memory, c.plan.microbatches, c.step_time))
    out.remove(first)
    return PlanChoice(first.plan, (first, *out))


def device_memory(devices: Sequence[Any]) -> float | None:
    """Bytes of memory the first of ``devices`` reports (``None`` where it reports none, as on CPU)."""
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def plan(model: Any, example_batch: Any, devices: Sequence[Any] | None = None,
         memory_limit: float | None = None, *, profile: Profile | None = None,
         schedules: Sequence[str] = DEFAULT_SCHEDULES, optimizer: Any = None,
         max_microbatches: int = 64, profile_rounds: int = 1,
         progress: Callable[[str], None] | None = None) -> PlanChoice:
    """Profiles ``model`` and returns the fastest predicted :class:`jpipe.Plan` that fits, with a ranked table.

    Searches mesh shapes (``pipe x data = len(devices)``), uneven partitions
    (:func:`balanced_partition`: ``pre`` on the first stage, ``post`` on the
    last), micro-batch counts and schedules, predicting each step with
    :func:`evaluate`. ``memory_limit`` is bytes per device (default: what the
    device reports, else no limit). Pass a ``profile`` to skip measuring, or
    ``profile_rounds`` > 1 to plan from the mean of that many profiles taken back
    to back (:func:`partition.profile`'s ``rounds``): on a shared machine one
    profile of a few seconds can catch a slow spell and rank plans by it. ``progress``, if
    given, is called with a line per phase: what it profiles, then how many candidates it ranked.

    >>> import jax, jax.numpy as jnp, jpipe, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 1))}
    >>> choice = jpipe.plan(model, batch, devices=jax.devices()[:4])
    >>> choice.plan.pipe * choice.plan.data, len(choice.candidates) > 5
    (4, True)
    """
    import jax

    from jpipe.partition._profile import profile as measure

    if profile_rounds < 1:
        raise ValueError(f"profile_rounds must be >= 1 (profiles averaged), got {profile_rounds}")
    devices = list(jax.devices() if devices is None else devices)
    batch = batch_size_of(example_batch)
    if profile is None:
        mb = max(1, batch // len(devices))
        microbatch = jax.tree.map(lambda a: a[:mb], example_batch)
        sizes = profile_sizes(len(devices), batch, max_microbatches)
        profile = measure(model, microbatch, optimizer=optimizer, devices=devices, microbatch_sizes=sizes,
                          rounds=profile_rounds, progress=progress)
    if memory_limit is None:
        memory_limit = device_memory(devices)
    choice = search(profile, len(devices), batch, memory_limit=memory_limit, schedules=schedules,
                    max_microbatches=max_microbatches)
    if progress is not None:
        fits = sum(c.fits for c in choice.candidates)
        progress(f"planning: ranked {len(choice.candidates)} candidate plans ({fits} fit in memory)")
    return choice

