"""AvgPipe: N co-located pipelines coupled by elastic averaging with a centre model.

* :func:`elastic_averaging` / :class:`ElasticAveraging` -- the EASGD rule as an
  optax transformation over a replica axis (state :class:`ElasticState`);
  :func:`per_replica` -- an optimizer applied to each replica on its own.
* :func:`ensemble` -- a :class:`jpipe.Staged` as N pipelines batched on a
  leading replica axis, which the executor runs unchanged, one batched kernel
  per tick for all N pipelines.
* :func:`init` -- a :class:`jpipe.TrainState` for N pipelines on each data
  replica, ``R = N x data`` in all, coupled only through the centre (use it
  with :func:`jpipe.train_step` on ``[B, R, ...]`` batches: ``R x B`` samples
  per step); :func:`centre` (alias :func:`to_sequential`) and
  :func:`replicas` read the parameters back.
* :func:`tune` -- picks the number of pipelines N and micro-batches M from
  measured throughput and compiled memory, predicting the rest with the
  schedule simulator.

>>> from jpipe import averaging
>>> averaging.ElasticAveraging(period=2).moving_rate(pipelines=4)
0.225
"""

from jpipe.averaging._elastic import ElasticAveraging, ElasticState, elastic_averaging, per_replica
from jpipe.averaging._ensemble import (
    REPLICA_AXIS,
    batch_slice,
    centre,
    ensemble,
    from_synchronous,
    init,
    replicas,
    split_batch,
    stack_batches,
    to_sequential,
)
from jpipe.averaging._tune import TuneResult, TuneRow, default_candidates, tune

__all__ = [
    "REPLICA_AXIS",
    "ElasticAveraging",
    "ElasticState",
    "TuneResult",
    "TuneRow",
    "batch_slice",
    "centre",
    "default_candidates",
    "elastic_averaging",
    "ensemble",
    "from_synchronous",
    "init",
    "per_replica",
    "replicas",
    "split_batch",
    "stack_batches",
    "to_sequential",
    "tune",
]
