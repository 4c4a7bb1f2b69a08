"""Every test and doctest runs on 8 simulated CPU devices; XLA_FLAGS must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert len(jax.devices()) == 8, f"tests need 8 simulated CPU devices, got {jax.devices()}"
