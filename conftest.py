"""Every test and doctest runs on 8 simulated CPU devices; XLA_FLAGS must be set before jax is imported.

The session shares one persistent compilation cache, empty at its start, with every process it
launches (``jpipe train`` in a subprocess, the README's blocks, ``jax.distributed`` workers): the
same program is compiled once per session, not once per test or per process. A program is keyed
by its HLO, options and backend, so nothing a test changes (a monkeypatched executor, another
plan) can be served a stale program.
"""

import atexit
import gc
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jpipe-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # programs that compile in milliseconds are cheaper to recompile than to write and read back
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax

assert len(jax.devices()) == 8, f"tests need 8 simulated CPU devices, got {jax.devices()}"

import pytest


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs_before_the_map_limit():
    """Each compiled CPU program maps its code into memory (hundreds of regions for a pipelined
    step); Linux allows a process 65,530 (vm.max_map_count), past which XLA's next compile
    segfaults. Modules that compile a program per test (test_executor) pass that within the module."""
    yield
    if _mapped_regions() > 30_000:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs when it is done: one pytest process compiles
    thousands of them, and holding them all grows memory for the rest of the run."""
    yield
    jax.clear_caches()
