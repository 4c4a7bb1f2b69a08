"""Schedule generators: each is one function from (devices, micro-batches) to a :class:`Table`.

A new schedule is a new function here (or anywhere) that builds per-device
orders and calls :func:`table_from_orders`; nothing else has to change.
"""

from __future__ import annotations

from collections.abc import Callable

from jpipe.schedules._table import Action, Table, table_from_orders


def gpipe(num_devices: int, num_microbatches: int) -> Table:
    """GPipe: every forward, then every backward. Holds all ``M`` micro-batches.

    >>> gpipe(2, 3).orders()[0]
    [Action(kind='F', microbatch=0, stage=0), Action(kind='F', microbatch=1, stage=0), Action(kind='F', microbatch=2, stage=0), Action(kind='B', microbatch=0, stage=0), Action(kind='B', microbatch=1, stage=0), Action(kind='B', microbatch=2, stage=0)]
    """
    orders = [
        [Action("F", mb, s) for mb in range(num_microbatches)]
        + [Action("B", mb, s) for mb in range(num_microbatches)]
        for s in range(num_devices)
    ]
    return table_from_orders(orders, num_microbatches, name="gpipe")


def early_backward(num_devices: int, num_microbatches: int, warmup: Callable[[int], int], name: str) -> Table:
    """DAPPLE's early-backward order with a per-stage warm-up count ``warmup(s)``.

    Stage ``s`` runs ``K = min(warmup(s), M)`` forwards, then alternates one
    backward and one forward, then drains the remaining backwards. It holds at
    most ``K`` micro-batches, whatever ``M`` is.
    """
    orders = []
    for s in range(num_devices):
        k = max(1, min(warmup(s), num_microbatches))
        order = [Action("F", mb, s) for mb in range(k)]
        for r in range(num_microbatches - k):
            order += [Action("B", r, s), Action("F", k + r, s)]
        order += [Action("B", mb, s) for mb in range(num_microbatches - k, num_microbatches)]
        orders.append(order)
    return table_from_orders(orders, num_microbatches, name=name)


def one_f_one_b(num_devices: int, num_microbatches: int) -> Table:
    """DAPPLE policy A (PipeDream-Flush 1F1B): warm-up ``min(P - s, M)``.

    >>> [str(a) for a in one_f_one_b(4, 8).orders()[0]][:6]
    ['F0', 'F1', 'F2', 'F3', 'B0', 'F4']
    """
    return early_backward(num_devices, num_microbatches, lambda s: num_devices - s, "1f1b")


def one_f_one_b_policy_b(num_devices: int, num_microbatches: int) -> Table:
    """DAPPLE policy B: warm-up ``min(2(P - s) - 1, M)``, hiding communication behind compute.

    >>> one_f_one_b_policy_b(4, 8).held_microbatches().tolist()
    [7, 5, 3, 1]
    """
    return early_backward(num_devices, num_microbatches, lambda s: 2 * (num_devices - s) - 1, "1f1b-b")


SCHEDULES: dict[str, Callable[[int, int], Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-b": one_f_one_b_policy_b,
}


def get_schedule(name: str) -> Callable[[int, int], Table]:
    """Looks up a generator by name; raises a ValueError listing the known names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)} "
            "or pass a jpipe.schedules.Table"
        ) from None
