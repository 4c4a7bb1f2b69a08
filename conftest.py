"""Every test and doctest runs on 8 simulated CPU devices; XLA_FLAGS must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

assert len(jax.devices()) == 8, f"tests need 8 simulated CPU devices, got {jax.devices()}"

import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs when it is done: one pytest process compiles
    thousands of them, and holding them all grows memory for the rest of the run."""
    yield
    jax.clear_caches()
