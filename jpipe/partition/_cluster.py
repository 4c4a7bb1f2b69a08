"""A cluster of identical servers: devices, links and DAPPLE's communication cost constants."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

GB = 1e9

# Cost constants of the public DAPPLE planner (V100 era), bytes per second.
NVLINK = 25 * GB  # point-to-point inside a server
ETHERNET_25G = 1 * GB  # point-to-point between servers, 25 Gbps Ethernet
ETHERNET_25G_ALLREDUCE = 3 * GB  # NCCL all-reduce bus bandwidth between servers
V100_MEMORY = 16 * GB


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``servers`` identical servers of ``devices_per_server`` devices each.

    Bandwidths are bytes per second: ``intra_server_bandwidth`` between two
    devices of one server, ``inter_server_bandwidth`` point-to-point between two
    servers, ``inter_server_allreduce_bandwidth`` the all-reduce bus bandwidth
    between servers (default 3x point-to-point, the ratio of DAPPLE's
    constants). ``device_memory`` is bytes per device.

    >>> c = Cluster.preset("dapple-A")
    >>> c.num_devices, c.servers, c.devices_per_server
    (16, 2, 8)
    >>> round(c.allreduce_time(1e9, [8]), 4)        # 1 GB over 8 GPUs of one server
    0.0175
    >>> round(c.allreduce_time(1e9, [8, 8]), 4)     # over both servers
    0.625
    """

    servers: int
    devices_per_server: int
    intra_server_bandwidth: float
    inter_server_bandwidth: float
    device_memory: float
    inter_server_allreduce_bandwidth: float | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("servers", "devices_per_server"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{field} must be an int >= 1, got {value!r}")
        for field in ("intra_server_bandwidth", "inter_server_bandwidth", "device_memory"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Cluster.{field} must be > 0, got {getattr(self, field)!r}")
        if self.inter_server_allreduce_bandwidth is None:
            object.__setattr__(self, "inter_server_allreduce_bandwidth", 3 * self.inter_server_bandwidth)

    @property
    def num_devices(self) -> int:
        return self.servers * self.devices_per_server

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """DAPPLE's Table 4 clusters of 16 V100s.

        ``dapple-A``: 2 servers x 8 GPUs, NVLink inside, 25 Gbps Ethernet between;
        ``dapple-B``: 16 servers x 1 GPU, 25 Gbps; ``dapple-C``: 16 x 1, 10 Gbps
        (DAPPLE's 25 Gbps constants scaled by 10/25).
        """
        scale_c = 10 / 25
        presets = {
            "dapple-A": cls(2, 8, NVLINK, ETHERNET_25G, V100_MEMORY, ETHERNET_25G_ALLREDUCE, "dapple-A"),
            "dapple-B": cls(16, 1, NVLINK, ETHERNET_25G, V100_MEMORY, ETHERNET_25G_ALLREDUCE, "dapple-B"),
            "dapple-C": cls(16, 1, NVLINK, ETHERNET_25G * scale_c, V100_MEMORY,
                            ETHERNET_25G_ALLREDUCE * scale_c, "dapple-C"),
        }
        try:
            return presets[name]
        except KeyError:
            raise ValueError(f"unknown cluster preset {name!r}; choose one of {sorted(presets)} or "
                             f"build a Cluster(servers, devices_per_server, ...)") from None

    def allreduce_time(self, size: float, per_server: Sequence[int]) -> float:
        """Seconds to all-reduce ``size`` bytes over devices spread ``per_server`` (counts per server).

        DAPPLE's model: 0 on one device; across servers ``2 size (n-1)/n`` over the
        all-reduce bandwidth; inside one server the same over NVLink, divided by ``n/2``.
        """
        counts = [c for c in per_server if c]
        n = sum(counts)
        if n <= 1 or size <= 0:
            return 0.0
        volume = 2.0 * size * (n - 1) / n
        if len(counts) == 1:
            return volume / self.intra_server_bandwidth / (n / 2)
        return volume / self.inter_server_allreduce_bandwidth

    def transfer_time(self, size: float, src: Sequence[int], dst: Sequence[int]) -> float:
        """Seconds to move ``size`` bytes from a stage on devices ``src`` to one on ``dst`` (counts per server).

        DAPPLE's split/concat model: the sending stage's replicas each hold a
        piece of the micro-batch and the receiving stage's replicas each need one;
        the pieces move concurrently over ``min(|src|, |dst|)`` device pairs, each
        at NVLink speed when both stages sit in one server and at the
        point-to-point network speed otherwise (as in DAPPLE's planner, a
        server's network link is not modelled as shared).

        >>> c = Cluster.preset("dapple-A")
        >>> c.transfer_time(8e6, [8, 0], [0, 8]) * 1e3   # 8 pairs of 1 MB over 1 GB/s
        1.0
        >>> c.transfer_time(8e6, [8, 0], [0, 1]) * 1e3   # everything into one device
        8.0
        """
        if size <= 0:
            return 0.0
        src_servers = [i for i, c in enumerate(src) if c]
        dst_servers = [i for i, c in enumerate(dst) if c]
        pairs = min(sum(src), sum(dst))
        if len(src_servers) == 1 and src_servers == dst_servers:
            return size / (self.intra_server_bandwidth * pairs)
        return size / (self.inter_server_bandwidth * pairs)
