"""Multi-process runs on JAX's multi-controller runtime (``jax.distributed``).

jpipe needs nothing special across processes: :func:`initialize` starts
``jax.distributed`` (explicit ``coordinator/num_processes/process_id``, the
``JPIPE_*`` variables :func:`launch_local` sets, or JAX's own detection of
SLURM, Open MPI, TPU pods, ...), then every process builds the same plan with
:func:`jpipe.init` over all processes' devices and calls :func:`jpipe.train_step`
with a global batch made from the rows it loads itself (:func:`local_rows`,
:func:`global_batch`). :func:`mesh_devices` orders devices so that ``pipe``
(stages on different hosts) or ``data`` (replicas on different hosts) crosses
processes.

:func:`launch_local` runs N processes on this machine over loopback
(127.0.0.1), for tests and experiments; on CPU they talk through gloo.

>>> from jpipe import distributed
>>> distributed.parse_coordinator("127.0.0.1:1234")
('127.0.0.1', 1234)
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ENV_COORDINATOR = "JPIPE_COORDINATOR"
ENV_NUM_PROCESSES = "JPIPE_NUM_PROCESSES"
ENV_PROCESS_ID = "JPIPE_PROCESS_ID"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_LOOPBACK = ("127.0.0.1", "localhost")


class ProcessInfo(NamedTuple):
    """This process's place in the run."""

    process_id: int
    num_processes: int
    local_devices: list
    devices: list


def parse_coordinator(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, with a clear error for anything else.

    >>> parse_coordinator("10.0.0.1:8476")
    ('10.0.0.1', 8476)
    """
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:8476, the address of process 0), "
                         f"got {address!r}")
    return host, int(port)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
    cpu_collectives: str | None = "gloo",
) -> ProcessInfo:
    """Starts ``jax.distributed``; call it first, before any other JAX call.

    With ``coordinator`` (``HOST:PORT`` of process 0), ``num_processes`` and
    ``process_id`` it joins that run. Without them it reads ``JPIPE_COORDINATOR``,
    ``JPIPE_NUM_PROCESSES`` and ``JPIPE_PROCESS_ID`` (set by :func:`launch_local`),
    and failing those lets JAX detect the cluster (SLURM, Open MPI, TPU, ...).

    A process that stops sending heartbeats for ``heartbeat_timeout_seconds``
    is declared dead and JAX then terminates every other process with
    "Terminating process because the JAX distributed service detected fatal
    errors" instead of letting it wait forever in a collective. CPU
    collectives across processes use ``cpu_collectives`` (gloo). A loopback
    coordinator also binds to loopback only. Returns this process's place.
    Calling it again with the same run is a no-op.
    """
    import jax

    if coordinator is None and num_processes is None and process_id is None and ENV_COORDINATOR in os.environ:
        coordinator = os.environ[ENV_COORDINATOR]
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
        process_id = int(os.environ[ENV_PROCESS_ID])
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if coordinator is not None and None in given.values():
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(f"with a coordinator, also give {' and '.join(missing)} "
                         f"(--num-processes N --process-id I, I from 0 to N-1)")
    bind = None
    if coordinator is not None:
        host, _ = parse_coordinator(coordinator)
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id must be an int from 0 to num_processes - 1 = {num_processes - 1}, "
                             f"got {process_id!r}")
        if host in _LOOPBACK:
            bind = coordinator
    if coordinator is not None and process_id == 0 and not jax.distributed.is_initialized():
        _check_port_free(coordinator, loopback=bind is not None)
    if jax.distributed.is_initialized():
        if process_id is not None and (jax.process_index(), jax.process_count()) != (process_id, num_processes):
            raise RuntimeError(f"jax.distributed is already initialised as process {jax.process_index()} of "
                               f"{jax.process_count()}, not {process_id} of {num_processes}")
        return _info()
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout, heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            shutdown_timeout_seconds=shutdown_timeout_seconds, coordinator_bind_address=bind)
    except (ValueError, RuntimeError) as e:
        if coordinator is None:
            raise RuntimeError(
                f"could not detect a multi-process environment ({e}); outside SLURM, Open MPI or a TPU pod "
                f"give the run explicitly: --coordinator HOST:PORT --num-processes N --process-id I "
                f"(jpipe.distributed.initialize(coordinator, num_processes, process_id))") from e
        if "backend" in str(e).lower() or "before" in str(e).lower():
            raise RuntimeError(f"{e}. Call jpipe.distributed.initialize() before any other JAX call "
                               f"(jax.devices(), creating arrays, jpipe.init, ...)") from e
        raise
    _agree_on_the_count(num_processes, coordinator)
    return _info()


def _agree_on_the_count(num_processes: int | None, coordinator: str | None, timeout_s: int = 60) -> None:
    """A handshake through the coordinator's key-value store: each process states the number of
    processes it was started with, and every process refuses the run where one differs.

    JAX takes the count from process 0 and lets a process that says otherwise join in silence. All
    processes raise together, so that none waits in its first collective (or in the shutdown barrier
    at exit) for one that has given up.
    """
    import jax
    from jax._src import distributed as jax_distributed  # the store JAX's own barriers use

    client = jax_distributed.global_state.client
    count, me = jax.process_count(), jax.process_index()
    client.key_value_set(f"jpipe/num_processes/{me}", str(count if num_processes is None else num_processes))
    views = {p: int(client.blocking_key_value_get(f"jpipe/num_processes/{p}", timeout_s * 1000))
             for p in range(count)}
    wrong = {p: n for p, n in views.items() if n != count}
    if wrong:
        said = ", ".join(f"process {p} with {n}" for p, n in sorted(wrong.items()))
        raise RuntimeError(
            f"the run at {coordinator or 'the detected coordinator'} has {count} processes (process 0's "
            f"--num-processes), but {said}; start every process with the same --num-processes")


def _check_port_free(coordinator: str, loopback: bool) -> None:
    """Process 0 listens on the coordinator's port: refuse at once where something else already does
    (JAX's own error would come only after its initialization timeout, as "another task died")."""
    import socket

    host, port = parse_coordinator(coordinator)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator's server binds
        try:
            sock.bind((host if loopback else "", port))
        except OSError as e:
            raise ValueError(f"the coordinator port {port} is already in use on this host ({e.strerror}): "
                             f"another run, or one still exiting, listens there; choose another port in "
                             f"--coordinator {host}:PORT (the same on every process)") from None


def detected_num_processes() -> int | None:
    """How many processes :func:`initialize` without arguments would join, read from the environment
    before JAX starts (``None`` where only JAX can tell, e.g. on TPU pods).

    ``JPIPE_NUM_PROCESSES`` (:func:`launch_local`), else SLURM's ``SLURM_NTASKS`` or Open MPI's
    ``OMPI_COMM_WORLD_SIZE`` where JAX would detect that cluster. ``jpipe train`` uses it to give
    each process its share of CPU devices before JAX creates them.
    """
    env = os.environ
    try:
        if ENV_COORDINATOR in env:
            return int(env[ENV_NUM_PROCESSES])
        slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
        if all(k in env for k in slurm):  # what JAX's SLURM detection needs
            return int(env["SLURM_NTASKS"])
        if "OMPI_MCA_orte_hnp_uri" in env and "OMPI_COMM_WORLD_SIZE" in env:  # JAX's Open MPI detection
            return int(env["OMPI_COMM_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return None


def _info() -> ProcessInfo:
    import jax

    return ProcessInfo(jax.process_index(), jax.process_count(), list(jax.local_devices()), list(jax.devices()))


def mesh_devices(pipe: int, data: int, across: str = "pipe", devices: Sequence[Any] | None = None) -> list:
    """``pipe x data`` devices ordered for :func:`jpipe.init`'s ``devices=``.

    ``across="pipe"`` puts consecutive stages on different processes where it
    can (each process holds whole ``data`` rows: stages on different hosts);
    ``across="data"`` puts the replicas of a stage on different processes
    (each process holds whole ``pipe`` columns).

    >>> import jax
    >>> len(mesh_devices(4, 2, devices=jax.devices()))
    8
    """
    import jax

    if across not in ("pipe", "data"):
        raise ValueError(f"across must be 'pipe' or 'data', got {across!r}")
    devs = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    if len(devs) != pipe * data:
        raise ValueError(f"pipe x data = {pipe} x {data} = {pipe * data} but there are {len(devs)} devices")
    if across == "pipe":  # process-major fills rows: stage s on the process holding row s
        return devs
    # process-major fills columns: replica r on the process holding column r
    return [devs[r * pipe + s] for s in range(pipe) for r in range(data)]


def local_rows(mesh: Any, global_batch_size: int) -> slice:
    """The rows of the global batch this process must load (its devices' ``data`` shards).

    >>> import jax, jpipe
    >>> local_rows(jpipe.make_mesh(4, 2), 16)  # a single process loads everything
    slice(0, 16, None)
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpipe._mesh import DATA

    sharding = NamedSharding(mesh, P(DATA))
    spans = sorted({idx[0].indices(global_batch_size)[:2]
                    for idx in sharding.addressable_devices_indices_map((global_batch_size,)).values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:
        raise ValueError(f"process {jax.process_index()} holds non-contiguous data shards {spans}; "
                         f"order devices with jpipe.distributed.mesh_devices")
    return slice(start, stop)


def global_batch(mesh: Any, local_batch: Any, global_batch_size: int) -> Any:
    """A global batch (sharded over ``data``) from each process's own rows ``local_rows(...)``.

    Every process passes the rows it loaded; no process needs the others' data.

    >>> import jax, jax.numpy as jnp, jpipe
    >>> mesh = jpipe.make_mesh(4, 2)
    >>> b = global_batch(mesh, {"x": jnp.ones((16, 3))}, 16)
    >>> b["x"].shape, b["x"].sharding.spec
    ((16, 3), P('data',))
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpipe._mesh import DATA

    rows = local_rows(mesh, global_batch_size)
    sharding = NamedSharding(mesh, P(DATA))

    def make(a: Any) -> jax.Array:
        if a.shape[0] != rows.stop - rows.start:
            raise ValueError(f"process {jax.process_index()} must pass rows {rows.start}:{rows.stop} of the "
                             f"global batch ({rows.stop - rows.start} rows), got {a.shape[0]}")
        return jax.make_array_from_process_local_data(sharding, a, (global_batch_size, *a.shape[1:]))

    return jax.tree.map(make, local_batch)


# ---------------------------------------------------------------------------------------------
# Local launcher


@dataclasses.dataclass
class ProcessResult:
    """How one launched process ended: exit code (negative: killed by that signal), output."""

    process_id: int
    returncode: int
    output: str
    elapsed_s: float
    killed: bool  # killed by the launcher (timeout, or another process failed)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LaunchError(RuntimeError):
    """A local multi-process run failed or timed out."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_BOOTSTRAP = """
import importlib.util, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # as when running the file as a script
spec = importlib.util.spec_from_file_location("_jpipe_launched", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
getattr(module, sys.argv[2])(*json.loads(sys.argv[3]))
"""


def launch_local(
    script_or_fn: str | os.PathLike | Callable[..., Any],
    num_processes: int = 2,
    devices_per_process: int = 1,
    timeout: float = 120.0,
    *,
    args: Sequence[Any] = (),
    grace: float = 0.0,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> list[ProcessResult]:
    """Runs ``num_processes`` Python processes on this machine as one ``jax.distributed`` run.

    ``script_or_fn`` is a script path (run with ``args`` as its command-line
    arguments) or a module-level function (called with ``args``, which must be
    JSON values). Each process gets ``devices_per_process`` CPU devices and
    ``JPIPE_COORDINATOR=127.0.0.1:PORT``, ``JPIPE_NUM_PROCESSES``,
    ``JPIPE_PROCESS_ID``, so that :func:`initialize` with no arguments joins
    the run (loopback only). When a process fails, the others get ``grace``
    seconds to exit on their own, then all are killed; so are all at
    ``timeout``. Returns each process's result in process order; with
    ``check=True`` raises :class:`LaunchError` unless all exited with 0.

    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    >>> _ = script.write_text("import os; print('process', os.environ['JPIPE_PROCESS_ID'])")
    >>> [r.output.strip() for r in launch_local(script, num_processes=2, timeout=30, check=True)]
    ['process 0', 'process 1']
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("num_processes and devices_per_process must be >= 1")
    command = _command(script_or_fn, args)
    base = _environment(num_processes, devices_per_process, env)

    logs = [tempfile.TemporaryFile(mode="w+b") for _ in range(num_processes)]  # noqa: SIM115 (closed below)
    start = time.monotonic()
    procs = [subprocess.Popen(command, env={**base, ENV_PROCESS_ID: str(i)}, stdout=logs[i],
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
             for i in range(num_processes)]
    try:
        ended, killed = _wait(procs, start, timeout, grace)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
                p.wait()
    results = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append(ProcessResult(i, p.returncode, log.read().decode(errors="replace"), ended[i], i in killed))
        log.close()
    if check and not all(r.ok for r in results):
        raise LaunchError("\n".join(
            f"--- process {r.process_id}: exit {r.returncode}{' (killed by the launcher)' if r.killed else ''} "
            f"after {r.elapsed_s:.1f}s\n{r.output[-3000:]}" for r in results))
    return results


def _command(script_or_fn: str | os.PathLike | Callable[..., Any], args: Sequence[Any]) -> list[str]:
    """The command line of one process of :func:`launch_local`."""
    if callable(script_or_fn):
        fn = script_or_fn
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise ValueError(f"launch_local needs a module-level function, got {fn.__qualname__}")
        return [sys.executable, "-c", _BOOTSTRAP, inspect.getfile(fn), fn.__name__, json.dumps(list(args))]
    path = Path(script_or_fn)
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path}")
    return [sys.executable, str(path), *map(str, args)]


def _environment(num_processes: int, devices_per_process: int, env: dict[str, str] | None) -> dict[str, str]:
    """The environment every process of :func:`launch_local` shares (each adds its process id)."""
    base = dict(os.environ)
    flags = " ".join(f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG))
    base["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices_per_process}".strip()
    base.setdefault("JAX_PLATFORMS", "cpu")
    base["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    base.update(env or {})
    base.update({ENV_COORDINATOR: f"127.0.0.1:{free_port()}", ENV_NUM_PROCESSES: str(num_processes)})
    return base


def _wait(procs: list[subprocess.Popen], start: float, timeout: float,
          grace: float) -> tuple[dict[int, float], set[int]]:
    """Waits for every process; kills the rest ``grace`` seconds after one fails, or all at ``timeout``.
    Returns each process's seconds to its end and the ones killed."""
    ended: dict[int, float] = {}
    killed: set[int] = set()
    first_failure: float | None = None
    while len(ended) < len(procs):
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = now - start
                if p.returncode != 0 and first_failure is None:
                    first_failure = now
        overdue = now - start > timeout
        failed = first_failure is not None and now - first_failure >= grace
        if (overdue or failed) and len(ended) < len(procs):
            for i, p in enumerate(procs):
                if i not in ended:
                    _kill(p)
                    killed.add(i)
            for i, p in enumerate(procs):
                if i not in ended:
                    p.wait()
                    ended[i] = time.monotonic() - start
            break
        time.sleep(0.05)
    return ended, killed


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL a process this module started, and its process group (it leads its own session)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except ProcessLookupError:
            pass
