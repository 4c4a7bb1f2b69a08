"""Does the planner predict real step times? Profile, predict and measure plans on a genuine 2-device cluster.

On a CPU-only machine (the default) two processes under ``jax.distributed`` (one CPU device each,
gloo collectives over 127.0.0.1, started by ``jpipe.distributed.launch_local``) form the cluster.
With accelerators present, or with ``--local``, the script runs in this process on the first two
local devices instead -- the same code path, unchanged.

0. On CPU each process gets its share of the cores (one each on a 2-core machine) and
   single-threaded XLA: two processes sharing cores would make a data-parallel step (both compute
   at once) look slower than the profile, which times one device alone. With one core each, every
   thread but the computing ones gets the shortest time slice, so that gloo's threads preempt the
   compute the moment they wake (Linux >= 6.12; elsewhere they wait for the scheduler's tick).
1. Profile the model on the cluster with ``jpipe.partition.Profiler``: every process times the
   layers on its own device, the exchange and the all-reduces run over both devices, and every time
   is the slowest process's, so that every process plans from the same numbers (and builds the
   same partitions). The planner gets the mean of ``--profile-rounds`` profiles taken back to back
   (``Profiler.measure(rounds=...)``, 40-80 s here): one profile's exchange missed the long run's
   by up to 2.8x. The profiler also times a step with each process computing alone, the other
   waiting: with two processes on two vCPUs a device computed 1.05-1.7x slower while the other computed too,
   and the simulator charges a tick by how many devices compute in it (``Profile.contention``).
2. Ask the planner (``jpipe.partition.search``) for the ranked candidates over the devices: on 2,
   ``pipe=2, data=1`` with M in ``--microbatches`` x ``--schedules``, and ``pipe=1, data=2``.
   Then ``partition.refine`` with its defaults times the best predicted (those within 25 % of the
   best prediction, at most 3; 5 steps in each of 3 rounds) and chooses the fastest of them: the
   choice a user gets who asks for a measured refinement (``jpipe plan --measure 3``).
3. Measure every candidate's mean step time (``partition.robust_mean``: the planner adds up means)
   with ``jpipe.train_step`` on the 2-device mesh, each process feeding only its own rows
   (``local_rows`` / ``global_batch``); the plans are timed in turns (``--rounds``) so that a shared
   machine's changing load hits them alike; the rounds' means give each mean's standard error.
   The table also gives each plan's minor page faults per timed step (this process's): a step
   whose temporary buffer glibc maps afresh every time pays for its pages every time.
4. Profile again in every round, in turns with the plans (``partition.Profiler`` compiled the runs
   once; ``--repeats`` calls each). The mean of these profiles saw the machine as the plans
   did: on this VM its speed drifts by 5-35 % over the minutes between the first profile and the
   measurement, which moved every error of the first prediction alike.
5. Print, for the planner's own prediction (the first profile) and for the prediction from the mean
   of the profiles in turns: predicted vs measured, the relative error, Spearman's rank correlation and
   whether the choice is the fastest measured plan (and, when it is not, whether the gap is within
   twice the standard error of the difference: a tie this measurement cannot break; also paired by
   round, the rounds' differences cancelling the load that hits both plans of a round alike); the
   same for the choice after ``partition.refine``.

    python experiments/planner_accuracy.py                 # 2 CPU processes (5-15 min here)
    python experiments/planner_accuracy.py --local         # first 2 local devices (GPUs)
    python experiments/planner_accuracy.py --simulated --devices 8 --microbatches 1 2 4 8
                                                           # 8 simulated CPU devices in one process
    python experiments/planner_accuracy.py --devices 1     # one device: compute only (one GPU)
    python experiments/planner_accuracy.py --json out.json # also write the rows

Target (issue 5): every prediction within 25 % and the fastest plan chosen.

Results, session by session, with what each change did and what is still off:
``experiments/planner_accuracy.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulated", action="store_true",
                   help="--devices simulated CPU devices in this one process (XLA's host platform device count)")
    p.add_argument("--local", action="store_true",
                   help="use the first --devices local devices of this process (default when accelerators exist)")
    p.add_argument("--devices", type=int, default=2,
                   help="devices in the cluster: CPU processes of one device each, or local devices (default 2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    p.add_argument("--steps", type=int, default=5, help="timed steps per plan and round")
    p.add_argument("--rounds", type=int, default=8, help="rounds of timing, every plan in turn")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10, help="profiler repeats per part in one profile")
    p.add_argument("--profile-rounds", type=int, default=8,
                   help="profiles taken back to back and averaged for the planner (partition.mean_profile)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the launcher kills the run")
    p.add_argument("--json", default=None, help="also write the table's rows to this JSON file")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------------
# What every process runs


def _key(plan) -> tuple:
    return (plan.pipe, plan.data, plan.microbatches, str(plan.schedule) + ("+fused" if plan.fuse_ticks else ""))


def _row(rows: list[dict], plan) -> dict | None:
    """The measured row of ``plan`` (None if it was not measured)."""
    return next((r for r in rows if (r["pipe"], r["data"], r["microbatches"], r["schedule"]) == _key(plan)), None)


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    import numpy as np

    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _own_cores(processes: int = 2) -> int:
    """Gives this process its share of the cores (``len(cores) // processes``, at least one) and XLA one
    compute thread, so that the CPU processes are independent devices, as on a real cluster, not
    programs competing for cores. Returns how many cores this process got."""
    cores = sorted(os.sched_getaffinity(0))
    index = int(os.environ.get("JPIPE_PROCESS_ID", "0"))
    share = len(cores) // processes or len(cores)  # fewer cores than processes: all share all of them
    if share < len(cores):
        os.sched_setaffinity(0, set(cores[index * share:(index + 1) * share]))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    return share


def _thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds used so far by each thread of this process (Linux ``/proc``; empty elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return out


# sched_setattr(2) by architecture: Python's os module has no binding for it
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
SHORT_SLICE_NS = 100_000  # the shortest slice Linux accepts (0.1 ms)


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def _set_slice(tid: int, nanoseconds: int) -> bool:
    """Sets thread ``tid``'s time slice under the normal policy (``SCHED_OTHER``, nice 0; 0 = the
    kernel's default). True if the kernel took it: Linux >= 6.12 (EEVDF's custom slices)."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), policy=0, runtime=nanoseconds)
    if libc.syscall(number, tid, ctypes.byref(attr), 0) != 0:
        return False  # the thread ended, or an older kernel
    got = _SchedAttr()
    return libc.syscall(number + 1, tid, ctypes.byref(got), ctypes.sizeof(got), 0) == 0 and (
        nanoseconds == 0 or got.runtime == nanoseconds)  # sched_getattr follows sched_setattr


def _communication_threads_short_slice(warm_up: Callable[[], Sequence[float]]) -> tuple[list[str], float, float]:
    """Gives every thread of this process but the computing ones the shortest time slice, so that
    the collectives' communication threads, which sleep most of the time, preempt the compute the
    moment they wake. Returns ``(names of the threads changed, median step seconds before, after)``.

    With one core per process, gloo's thread woken to receive otherwise waits behind a busy compute
    thread until the scheduler's next tick (4 ms here: ``CONFIG_HZ=250``): a pipelined step, which
    exchanges every tick, measured ~40 ms instead of ~25 ms, quantised in 4 ms steps. Under EEVDF
    (Linux >= 6.12) a woken thread with a shorter slice than the running one preempts it; the weights,
    hence the shares of the core, stay equal, so nothing can starve. (Sessions 5-13 gave the
    computing threads ``SCHED_IDLE`` instead. That inverts priorities: gloo's loop thread spins on
    ``epoll_wait`` while a pair's mutex is held -- ``Pair::handleEvents`` only try-locks it -- and a
    ``SCHED_IDLE`` compute thread holding that mutex then gets almost no CPU: data=2 steps of 146-210
    ms instead of 32-55 ms, the loop thread using 42 % of the core in ``epoll_wait``, ``perf`` showed.)

    The computing threads are those that used at least half the busiest one's CPU time during the
    first ``warm_up()`` (pipelined steps, returning their seconds); ``warm_up()`` runs again after."""
    before = _thread_cpu_seconds()
    without = statistics.median(warm_up())
    used = {t: s - before.get(t, 0.0) for t, s in _thread_cpu_seconds().items()}
    busiest = max(used.values(), default=0.0)
    changed = []
    for tid, seconds in used.items():
        if seconds < busiest / 2 and _set_slice(tid, SHORT_SLICE_NS):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    changed.append(f.read().strip())
            except OSError:
                pass  # the thread ended
    return changed, without, statistics.median(warm_up())


def compile_plan(model, optimizer, plan, batches: list[dict], devices: list) -> tuple:
    """``(state, step, global batches, compile seconds)`` of ``plan`` on ``devices``, ``step`` being
    ``jpipe.train_step`` compiled for it. ``batches`` are host arrays of the whole global batch, the
    same on every process; each process feeds only its own rows of them."""
    import jax

    import jpipe
    from jpipe import distributed

    size = len(next(iter(batches[0].values())))
    devs = distributed.mesh_devices(plan.pipe, plan.data, "pipe", devices)
    mesh = jpipe.make_mesh(plan.pipe, plan.data, devs)
    mine = distributed.local_rows(mesh, size)
    placed = [distributed.global_batch(mesh, {k: v[mine] for k, v in b.items()}, size) for b in batches]
    state = jpipe.init(model, plan, optimizer, placed[0], rng=jax.random.key(0), devices=devs)
    t0 = time.perf_counter()
    step = jpipe.train_step.lower(state, placed[0]).compile()
    return state, step, placed, time.perf_counter() - t0


def launch_processes(worker, args: list, processes: int, timeout: float) -> int:
    """Runs ``worker(*args)`` in ``processes`` local processes of one CPU device each (``jax.distributed``),
    prints process 0's output (and a failed process's tail to stderr); returns the exit status for ``sys.exit``."""
    from jpipe import distributed

    start = time.perf_counter()
    results = distributed.launch_local(worker, num_processes=processes, devices_per_process=1, timeout=timeout,
                                       args=args)
    print(results[0].output, end="")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"--- process {r.process_id}: exit {r.returncode}{' (killed)' if r.killed else ''}\n"
              f"{r.output[-3000:]}", file=sys.stderr)
    print(f"({processes} processes, {time.perf_counter() - start:.0f}s in all)")
    return 1 if failed else 0


def worker(argv: list[str], local: bool) -> None:
    args = parse(argv)
    n = args.devices
    cores = 0 if local else _own_cores(n)  # before jax starts its runtime
    import jax
    import numpy as np
    import optax

    import jpipe
    from jpipe import distributed, models, partition

    if local:
        devices = list(jax.local_devices())[:n]
        if len(devices) < n:
            raise SystemExit(f"--local needs {n} local devices, this process has {len(jax.local_devices())}; "
                             f"pass --devices {len(jax.local_devices())}, or run without --local on a CPU machine "
                             f"({n} processes)")
        mode = f"1 process, {devices[0].platform} devices {[d.id for d in devices]}"
    else:
        info = distributed.initialize()
        devices = list(jax.devices())
        if len(devices) != n:
            raise SystemExit(f"expected {n} devices over the processes, got {len(devices)}")
        mode = f"{info.num_processes} processes x {len(info.local_devices)} {devices[0].platform} device"
    me = jax.process_index()

    def say(*a) -> None:
        if me == 0:
            print(*a, flush=True)

    B = args.batch_size
    model = models.gpt(256, args.seq_len, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers)
    rng = np.random.default_rng(0)
    full = [{"tokens": rng.integers(0, 256, (B, args.seq_len), dtype=np.int32),
             "targets": rng.integers(0, 256, (B, args.seq_len), dtype=np.int32)} for _ in range(4)]
    optimizer = optax.adam(1e-3)

    if cores == 1:  # pipelined steps (after their compilation): they compute and exchange as the plans do
        warm = dict(zip(("state", "step", "batches"),
                        compile_plan(model, optimizer, jpipe.Plan(pipe=2, data=n // 2, microbatches=2, schedule="1f1b"),
                                     full, devices)))

        def warm_up(steps: int) -> list[float]:
            times = []
            for i in range(steps):
                start = time.perf_counter()
                warm["state"], metrics = warm["step"](warm["state"], warm["batches"][i % len(warm["batches"])])
                jax.block_until_ready((warm["state"], metrics))
                times.append(time.perf_counter() - start)
            return times

        warm_up(2)
        changed, before, after = _communication_threads_short_slice(lambda: warm_up(30))
        say(f"threads given a {SHORT_SLICE_NS / 1e6:g} ms slice (process 0): {len(changed)} "
            f"({', '.join(sorted(set(changed))) or 'none: kernel older than 6.12?'}); a pipelined step's median "
            f"{before * 1e3:.1f} ms before, {after * 1e3:.1f} ms after")
        del warm

    # 1. profile (the micro-batch jpipe.plan profiles at: the batch split over the devices)
    mb = {k: v[: B // n] for k, v in full[0].items()}
    sizes = partition.microbatch_sizes(n, B, max(args.microbatches))  # every size a candidate uses

    t0 = time.perf_counter()
    profiler = partition.Profiler(model, mb, optimizer=optimizer, devices=devices, microbatch_sizes=sizes,
                                  repeats=args.repeats)
    # every time is the slowest process's: the same profile on every process; several profiles back to
    # back, averaged: one profile's exchange (a few seconds) missed the long run's by up to 2.8x
    prof = profiler.measure(rounds=args.profile_rounds)
    say(f"cluster: {mode}; GPT d_model {args.d_model}, {args.layers} layers, seq {args.seq_len}, "
        f"global batch {B}")
    say(f"profile ({time.perf_counter() - t0:.1f}s), forward/backward ms by micro-batch size:")
    for size in sizes:
        at = prof.scaled(size)
        say(f"  {size:>3}: pre {at.pre.forward * 1e3:.3f}/{at.pre.backward * 1e3:.3f}, "
            f"layer {at.layers[0].forward * 1e3:.3f}/{at.layers[0].backward * 1e3:.3f}, "
            f"post {at.post.forward * 1e3:.3f}/{at.post.backward * 1e3:.3f}")
    say(f"optimizer update ms: pre {prof.pre.update * 1e3:.3f}, layer {prof.layers[0].update * 1e3:.3f}, "
        f"post {prof.post.update * 1e3:.3f}")
    say(f"contention: a step with every device computing took {prof.contention:.2f}x its time with one device "
        f"computing alone (the simulator charges a tick by how many devices compute in it)")
    c = prof.comm
    if c is not None:  # one device: no communication to profile
        say("comm: exchange added to a computing tick " + ", ".join(f"{b / 1024:.0f} KiB {t * 1e6:.0f} us" for b, t in c.exchange)
            + "; all-reduce " + ", ".join(f"{b / 1024:.0f} KiB {t * 1e6:.0f} us" for b, t in c.allreduce))

    # 2. predict
    choice = partition.search(prof, n, B, schedules=args.schedules, max_microbatches=max(args.microbatches))
    cands = [cd for cd in choice.candidates
             if cd.plan.microbatches in (1, *args.microbatches)]
    cands.sort(key=lambda cd: _key(cd.plan))  # the same order on every process
    say("\nplanner's ranked candidates:\n" + choice.table())
    # 2b. measure the best predicted with the library's defaults (those within 25 % of the best, at most 3)
    t0 = time.perf_counter()
    refined = partition.refine(choice, model, full[0], devices=devices, optimizer=optimizer)
    timed = [cd for cd in refined.candidates if cd.measured is not None]
    say(f"\npartition.refine measured the {len(timed)} best predicted ({time.perf_counter() - t0:.1f}s):\n"
        + refined.table(top=len(timed)))

    # 3. measure: compile every plan, then time them in turns (--rounds rounds of --steps steps each), so
    # that a change in the machine's load hits every plan alike; robust mean over all timed steps
    runs = []
    for cand in cands:
        state, step, batches, compile_s = compile_plan(model, optimizer, cand.plan, full, devices)
        for i in range(args.warmup):
            state, metrics = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        runs.append({"cand": cand, "state": state, "step": step, "batches": batches, "times": [], "round_means": [], "faults": 0,
                     "compile_s": compile_s})
    in_turns, profile_s = [], 0.0
    for _ in range(args.rounds):
        for run in runs:
            # one untimed step first: a plan's first step after another plan's runs cold (caches,
            # the allocator's free lists), which a training run, stepping one plan, never pays
            run["state"], metrics = run["step"](run["state"], run["batches"][-1])
            jax.block_until_ready((run["state"], metrics))
            times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for i in range(args.steps):
                t0 = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], run["batches"][i % len(run["batches"])])
                jax.block_until_ready((run["state"], metrics))
                times.append(time.perf_counter() - t0)
            run["times"] += times
            run["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            run["round_means"].append(partition.robust_mean(times))
        # 4. and the profile again in every round, in turns with the plans (compiled once: no compile here)
        t0 = time.perf_counter()
        in_turns.append(profiler.measure())
        profile_s += time.perf_counter() - t0
    turns = partition.mean_profile(in_turns)
    say(f"\nprofiled again in every round ({profile_s / args.rounds:.1f}s a round)")
    rows = []
    for run in runs:
        plan, cand = run["cand"].plan, run["cand"]
        measured = partition.robust_mean(run["times"])  # means add up; the planner predicts a mean
        # the standard error of the mean from the rounds' means: it includes the machine's drift
        error_ms = 1e3 * statistics.stdev(run["round_means"]) / len(run["round_means"]) ** 0.5 \
            if len(run["round_means"]) > 1 else 0.0
        in_turns_cand = partition.evaluate(turns, plan, B)
        rows.append({"pipe": plan.pipe, "data": plan.data, "microbatches": plan.microbatches,
                     "schedule": _key(plan)[3], "partition": list(plan.partition or ()),
                     "predicted_ms": cand.step_time * 1e3, "measured_ms": measured * 1e3,
                     "in_turns_ms": in_turns_cand.step_time * 1e3, "memory": cand.memory,
                     "median_ms": statistics.median(run["times"]) * 1e3, "standard_error_ms": error_ms,
                     "error": cand.step_time / measured - 1, "in_turns_error": in_turns_cand.step_time / measured - 1,
                     "compile_s": run["compile_s"], "spread_ms": [1e3 * min(run["times"]), 1e3 * max(run["times"])],
                     "faults_per_step": run["faults"] / len(run["times"]),
                     "round_means_ms": [1e3 * t for t in run["round_means"]]})
    del runs

    # 5. report
    fastest = min(rows, key=lambda r: r["measured_ms"])
    name = lambda r: f"{r['pipe']}x{r['data']} M={r['microbatches']} {r['schedule']}"
    chosen = _row(rows, choice.plan)
    # from the profiles in turns, the planner would choose the fastest predicted plan (less memory first on a tie)
    chosen_in_turns = min(rows, key=lambda r: (r["in_turns_ms"], r["memory"]))
    say(f"\n{'pipe':>4} {'data':>4} {'M':>3} {'schedule':<8} {'part':<6} {'predicted ms':>12} {'in turns':>9} "
        f"{'measured ms':>15} {'median':>7} {'(min-max)':>15} {'faults':>7} {'error':>7} {'error':>7}")
    say(f"{'':>29} {'(1st profile)':>12} {'(mean)':>9} {'':>48} {'/step':>7} {'(1st)':>7} {'(turns)':>7}")
    for r in sorted(rows, key=lambda r: r["measured_ms"]):
        tag = "".join(t for t, c in ((" <- planner's choice", chosen), (" <- choice from the profiles in turns", chosen_in_turns))
                      if r is c)
        say(f"{r['pipe']:>4} {r['data']:>4} {r['microbatches']:>3} {r['schedule']:<8} "
            f"{','.join(map(str, r['partition'])) or '-':<6} {r['predicted_ms']:>12.2f} {r['in_turns_ms']:>9.2f} "
            f"{r['measured_ms']:>8.2f} +-{r['standard_error_ms']:<4.2f} {r['median_ms']:>7.2f} "
            f"{r['spread_ms'][0]:>7.1f}-{r['spread_ms'][1]:<7.1f} {r['faults_per_step']:>7.0f} {r['error']:>+7.1%} {r['in_turns_error']:>+7.1%}{tag}")

    def verdict(pick) -> dict:
        """Whether ``pick`` is the fastest measured plan (or, when it is not, a tie within two standard
        errors of the difference: of the two means, and of the rounds' paired differences)."""
        hit = pick is fastest
        say(f"  choice {name(pick)} measured {pick['measured_ms']:.2f} ms -> the fastest: {'yes' if hit else 'NO'}")
        tie, paired_tie = False, False
        if not hit:
            # two means that differ by less than twice their combined standard error are not told apart
            gap = pick["measured_ms"] - fastest["measured_ms"]
            noise = (pick["standard_error_ms"] ** 2 + fastest["standard_error_ms"] ** 2) ** 0.5
            tie = gap <= 2 * noise
            say(f"  {gap:.2f} ms ({gap / fastest['measured_ms']:.1%}) slower than the fastest; two standard errors "
                f"of the difference: {2 * noise:.2f} ms -> "
                + ("a tie within this measurement's noise" if tie else "significantly slower"))
            # the plans ran in turns, so a round's load hits both alike: the rounds' differences cancel it
            gaps = [a - b for a, b in zip(pick["round_means_ms"], fastest["round_means_ms"])]
            if len(gaps) > 1:
                paired = statistics.stdev(gaps) / len(gaps) ** 0.5
                paired_tie = statistics.mean(gaps) <= 2 * paired
                say(f"  paired by round: {statistics.mean(gaps):.2f} ms slower ({sum(g > 0 for g in gaps)}/{len(gaps)} "
                    f"rounds slower), two standard errors {2 * paired:.2f} ms -> "
                    + ("a tie" if paired_tie else "significantly slower"))
        return {"chosen": name(pick), "chosen_is_fastest": hit, "chosen_ties_fastest_within_noise": tie,
                "chosen_ties_fastest_paired": paired_tie}

    def judged(what: str, key: str, pick) -> dict:
        """How the predictions under ``key`` do: worst error, rank correlation, and :func:`verdict` on ``pick``."""
        errors = [r["error" if key == "predicted" else f"{key}_error"] for r in rows]
        worst = max(map(abs, errors))
        rho = spearman([r[f"{key}_ms"] for r in rows], [r["measured_ms"] for r in rows])
        say(f"{what}: max |error| {worst:.1%}, {sum(abs(e) <= 0.25 for e in errors)}/{len(rows)} within 25% "
            f"(target: all: {'yes' if worst <= 0.25 else 'NO'}); Spearman rho {rho:.3f}")
        return {"max_abs_error": worst, "spearman": rho, **verdict(pick)}

    say(f"\nplans: {len(rows)}; fastest measured {name(fastest)} {fastest['measured_ms']:.2f} ms")
    if chosen is None:
        raise SystemExit(f"the planner chose {choice.plan}, which is not among the measured plans")
    first = judged("predicted from the profile before the measurement", "predicted", chosen)
    mean = judged(f"predicted from the mean of the {len(in_turns)} profiles taken in turns with the plans",
                  "in_turns", chosen_in_turns)
    say(f"the first profile's choice after partition.refine timed the best {len(timed)} predicted "
        f"({', '.join(f'{name(_row(rows, cd.plan))} {cd.measured * 1e3:.2f} ms' for cd in timed)}):")
    after_refine = verdict(_row(rows, refined.plan))
    drift = statistics.mean(r["in_turns_ms"] / r["predicted_ms"] for r in rows) - 1
    say(f"machine speed: the profiles in turns with the plans predict {drift:+.1%} on average against the first "
        f"profile (a drift of this size moves every error of the first prediction alike)")
    if me == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "rows": rows, "first_profile": first, "profiles_in_turns": mean,
                       "refined": {**after_refine, "measured_ms": {name(_row(rows, cd.plan)): cd.measured * 1e3
                                                                   for cd in timed}},
                       "profile_drift": drift, "profile": json.loads(prof.to_json()),
                       "profile_in_turns": json.loads(turns.to_json())}, f, indent=1)


def main() -> None:
    args = parse()
    if args.devices < 1 or (args.devices > 1 and args.devices % 2):
        raise SystemExit(f"--devices {args.devices}: pass 1 or an even number")
    if args.simulated:  # before JAX starts: its CPU client reads the flag once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
        worker(sys.argv[1:], local=True)
        return
    local = args.local or args.devices == 1
    if not local:
        import jax  # a look at the backend only; the launched processes start their own runtime

        if jax.default_backend() != "cpu":
            print(f"accelerators found ({jax.default_backend()}): running on the first {args.devices} local devices")
            local = True
    if local:
        worker(sys.argv[1:], local=True)
        return
    sys.exit(launch_processes(worker, [sys.argv[1:], False], args.devices, args.timeout))


if __name__ == "__main__":
    main()
