"""jpipe: pipeline-parallel training for JAX/Flax as one SPMD program.

>>> import jpipe
>>> jpipe.Plan(pipe=4, data=2, microbatches=8).schedule
'1f1b'
"""

from jpipe import averaging, schedules
from jpipe._init import init
from jpipe._mesh import make_mesh
from jpipe._model import Staged
from jpipe._plan import Plan
from jpipe._state import TrainState
from jpipe._train import (
    NonFiniteError,
    compiled_memory,
    sequential_layers,
    step_rng,
    to_sequential,
    train_step,
    value_and_grad,
)
from jpipe.averaging import ElasticAveraging
from jpipe.partition import plan

__version__ = "0.1.0"

__all__ = [
    "ElasticAveraging",
    "NonFiniteError",
    "Plan",
    "Staged",
    "TrainState",
    "averaging",
    "compiled_memory",
    "init",
    "make_mesh",
    "plan",
    "schedules",
    "sequential_layers",
    "step_rng",
    "to_sequential",
    "train_step",
    "value_and_grad",
]
