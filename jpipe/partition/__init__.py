"""Planning: profile a model, model its cost, search partitions, replication and mesh shapes.

- :func:`profile` measures a :class:`jpipe.Staged` model on the current backend
  (:class:`Profiler` compiles once and measures again when asked;
  :func:`mean_profile` averages such profiles);
  :func:`read_graph_profile` reads DAPPLE's published PipeDream graph profiles.
- :func:`dapple_latency` and :func:`dapple_plan` are DAPPLE's latency model and
  planner for a general :class:`Cluster` (:func:`overlapped_allreduce`: its
  data-parallel overlap; :func:`dapple_plan_for`: the cost of a given plan shape).
- :func:`plan` (also ``jpipe.plan``) picks jpipe's mesh shape, partition,
  micro-batches and schedule from profiled costs; :func:`refine` times the
  best few predicted plans (:func:`measure_plans`) and chooses by measurement.
  :func:`predict_memory` is its memory model (a :class:`Memory`, term by term: what
  a device stores plus the compiled step's temporaries); :func:`memory_profile`
  gives the sizes it needs from shapes alone.

>>> from jpipe import partition
>>> partition.Cluster.preset("dapple-B").num_devices
16
"""

from jpipe.partition._cluster import Cluster
from jpipe.partition._cost import Latency, dapple_latency, overlapped_allreduce
from jpipe.partition._dapple import DapplePlan, Stage, dapple_plan, dapple_plan_for
from jpipe.partition._measure import measure_plans, refine
from jpipe.partition._profile import (
    CommCost,
    GraphNode,
    LayerCost,
    Profile,
    Profiler,
    load,
    mean_profile,
    measure_comm,
    memory_profile,
    profile,
    read_graph,
    read_graph_profile,
    robust_line,
    robust_mean,
)
from jpipe.partition._search import (
    TIE,
    Candidate,
    Memory,
    PlanChoice,
    StepTime,
    balanced_partition,
    device_memory,
    evaluate,
    format_candidates,
    microbatch_sizes,
    plan,
    predict_memory,
    profile_sizes,
    search,
    stage_costs,
)

__all__ = [
    "TIE",
    "Candidate",
    "Cluster",
    "CommCost",
    "DapplePlan",
    "GraphNode",
    "Latency",
    "LayerCost",
    "Memory",
    "PlanChoice",
    "Profile",
    "Profiler",
    "Stage",
    "StepTime",
    "balanced_partition",
    "dapple_latency",
    "dapple_plan",
    "dapple_plan_for",
    "device_memory",
    "evaluate",
    "format_candidates",
    "load",
    "mean_profile",
    "measure_comm",
    "measure_plans",
    "memory_profile",
    "microbatch_sizes",
    "overlapped_allreduce",
    "plan",
    "predict_memory",
    "profile",
    "profile_sizes",
    "read_graph",
    "read_graph_profile",
    "refine",
    "robust_line",
    "robust_mean",
    "search",
    "stage_costs",
]
