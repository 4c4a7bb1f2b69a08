"""Pipeline schedules as data: generators, validation and rendering. No JAX in here.

>>> from jpipe import schedules
>>> t = schedules.one_f_one_b(num_devices=4, num_microbatches=8)
>>> t.held_microbatches().tolist()
[4, 3, 2, 1]
"""

from jpipe.schedules._csv import format_orders, load_table, read_orders
from jpipe.schedules._generators import (
    SCHEDULES,
    TRAITS,
    Traits,
    advance_forward,
    early_backward,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    one_f_one_b_policy_b,
    schedule_traits,
    zb_h1,
    zb_h2,
    zero_bubble,
)
from jpipe.schedules._plot import gantt_png, main_show
from jpipe.schedules._render import ascii_gantt
from jpipe.schedules._simulate import Costs, SimResult, simulate
from jpipe.schedules._table import (
    BACKWARD,
    FIELDS,
    FORWARD,
    IDLE,
    NO_SLOT,
    WEIGHT,
    Action,
    ScheduleError,
    Table,
    fuse_ticks,
    table_from_orders,
)
from jpipe.schedules._validate import validate

__all__ = [
    "BACKWARD",
    "FIELDS",
    "FORWARD",
    "IDLE",
    "NO_SLOT",
    "SCHEDULES",
    "TRAITS",
    "WEIGHT",
    "Action",
    "Costs",
    "ScheduleError",
    "SimResult",
    "Table",
    "Traits",
    "advance_forward",
    "ascii_gantt",
    "early_backward",
    "format_orders",
    "fuse_ticks",
    "gantt_png",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "load_table",
    "main_show",
    "one_f_one_b",
    "one_f_one_b_policy_b",
    "read_orders",
    "schedule_traits",
    "simulate",
    "table_from_orders",
    "validate",
    "zb_h1",
    "zb_h2",
    "zero_bubble",
]
