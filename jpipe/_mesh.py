"""The device mesh: a ``pipe`` axis for stages and a ``data`` axis for replicas."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

PIPE, DATA = "pipe", "data"


def make_mesh(pipe: int, data: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(pipe, data)`` mesh over ``devices`` (default: all devices of the runtime).

    Stage ``s`` lives on row ``s``; each row's ``data`` devices hold replicas of it.

    >>> import jax
    >>> mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    >>> mesh.axis_names
    ('pipe', 'data')
    """
    for name, value in (("pipe", pipe), ("data", data)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    available = list(jax.devices()) if devices is None else list(devices)
    if pipe * data != len(available):
        hint = ""
        if devices is None and len(available) < pipe * data and available[0].platform == "cpu":
            hint = (f"; on a machine without accelerators, simulate {pipe * data} CPU devices with "
                    f"jax.config.update('jax_num_cpu_devices', {pipe * data}) before any other JAX call")
        raise ValueError(
            f"pipe x data = {pipe} x {data} = {pipe * data} but there are {len(available)} devices; "
            f"choose pipe and data whose product is {len(available)}, or pass `devices=` with "
            f"{pipe * data} devices{hint}"
        )
    if devices is None:  # let JAX order devices by the physical topology
        return jax.make_mesh((pipe, data), (PIPE, DATA), axis_types=(AxisType.Auto, AxisType.Auto))
    return Mesh(np.asarray(available, dtype=object).reshape(pipe, data), (PIPE, DATA),
                axis_types=(AxisType.Auto, AxisType.Auto))
