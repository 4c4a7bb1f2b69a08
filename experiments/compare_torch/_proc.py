"""Bounded subprocesses: start a group of workers, wait with one deadline, stop them all on failure."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerError(RuntimeError):
    """A worker process failed or ran past its deadline; the message carries its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-chars:]


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Terminates the process groups of the workers we started (by their ids), then kills stragglers."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_workers(
    commands: Sequence[Sequence[str]],
    logs: Sequence[Path],
    *,
    env: Mapping[str, str] | Sequence[Mapping[str, str]],
    timeout: float,
    what: str,
) -> None:
    """Runs ``commands`` concurrently (``python -m ...`` from the repository root) with one deadline.

    Each worker's stdout and stderr go to its log. If any worker fails, the
    others are stopped at once (a pipeline rank waiting for a dead peer would
    otherwise hang until the gloo timeout); if the deadline passes, all are stopped.
    Raises :class:`WorkerError` naming the worker and quoting its log.
    """
    envs = [env] * len(commands) if isinstance(env, Mapping) else list(env)
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        try:
            _start_and_wait(commands, logs, envs, procs, files, timeout, what)
        finally:
            _stop(procs)


def _start_and_wait(commands: Sequence[Sequence[str]], logs: Sequence[Path], envs: Sequence[Mapping[str, str]],
                    procs: list[subprocess.Popen], files: contextlib.ExitStack, timeout: float, what: str) -> None:
    for cmd, log, e in zip(commands, logs, envs, strict=True):
        f = files.enter_context(open(log, "w"))  # noqa: SIM115 -- closed by the ExitStack
        full_env = {**os.environ, **e}
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        procs.append(subprocess.Popen([sys.executable, *cmd], cwd=REPO_ROOT, env=full_env, stdout=f,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i = failed[0]
            _stop(procs)
            raise WorkerError(f"{what}: worker {i} exited with status {codes[i]}; its log ({logs[i]}) ends "
                              f"with:\n{_tail(logs[i])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            _stop(procs)
            raise WorkerError(f"{what}: still running after {timeout:.0f} s, stopped; log of worker 0 "
                              f"({logs[0]}) ends with:\n{_tail(logs[0])}")
        time.sleep(0.1)
