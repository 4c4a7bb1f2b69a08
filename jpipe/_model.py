"""Model description: ``pre -> L x layer -> post -> loss`` as pure functions of parameters.

Each part is a Flax NNX module constructor (``rngs -> nnx.Module``) or a Flax
Linen module instance. :class:`Staged` turns both into the same pure form,
``init(key, x) -> params`` and ``apply(params, x, keys) -> y``, where ``params`` is a
nested dict of arrays (NNX: the pure dict of its ``nnx.Param`` state; Linen: its
``params`` collection). The executor only ever sees the pure form.

Stochastic layers (dropout) draw from ``keys``: ``None`` is a deterministic call
(evaluation: NNX modules in ``eval()`` mode, Linen modules called with
``deterministic=True`` or ``train=False`` where their ``__call__`` takes it), else one
key per sample. A stochastic part runs sample by sample (``jax.vmap``), each sample
with its own key, so a sample's masks depend only on the step, the part and the
sample's index in the global batch: not on the mesh, the micro-batch size or the
schedule. The keys come from :func:`sample_keys`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

PyTree = Any
Params = dict[str, Any]


class Component(NamedTuple):
    """A module in pure form: ``init(key, example_input) -> params`` and ``apply(params, x, keys=None) -> y``.

    ``keys`` is ``None`` for a deterministic call, else one key per sample of ``x`` (its
    leading axis). ``stochastic`` says whether ``apply`` uses them: a bool where the module
    shows it (NNX: it holds random-number streams), else ``uses_rng(params, x) -> bool``,
    which traces a training call (Linen; :meth:`Staged.check` asks it).
    """

    init: Callable[[jax.Array, PyTree], Params]
    apply: Callable[..., PyTree]
    stochastic: bool | Callable[[Params, PyTree], bool] = False


def sample_keys(key: jax.Array, part: int | jax.Array, first: int | jax.Array, count: int) -> jax.Array:
    """The keys of samples ``first .. first + count - 1`` of the global batch for model part ``part``
    (``0`` is ``pre``, ``1 + i`` layer ``i``, ``num_layers + 1`` ``post``), from the step's ``key``.

    >>> import jax
    >>> a = sample_keys(jax.random.key(0), 2, 0, 4)
    >>> b = sample_keys(jax.random.key(0), 2, 2, 2)
    >>> a.shape, bool((jax.random.key_data(a[2:]) == jax.random.key_data(b)).all())
    ((4,), True)
    """
    part_key = jax.random.fold_in(key, part)
    return jax.vmap(lambda i: jax.random.fold_in(part_key, i))(first + jnp.arange(count))


def _per_sample(call: Callable[[PyTree, jax.Array], PyTree], x: PyTree, keys: jax.Array) -> PyTree:
    """``call`` on each sample of ``x`` as a batch of one, with that sample's key."""
    def one(sample: PyTree, key: jax.Array) -> PyTree:
        out = call(jax.tree.map(lambda a: a[None], sample), key)
        return jax.tree.map(lambda a: a[0], out)

    return jax.vmap(one)(x, keys)


def _mode_keywords(module: nn.Module) -> Callable[[bool], dict[str, bool]]:
    """How a Linen module's ``__call__`` is told training from evaluation, if it takes a flag."""
    try:
        names = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        names = {}
    if "deterministic" in names:
        return lambda training: {"deterministic": not training}
    for name in ("train", "training", "is_training"):
        if name in names:
            return lambda training, name=name: {name: training}
    return lambda training: {}


def _linen_component(module: nn.Module) -> Component:
    mode = _mode_keywords(module)

    def init(key: jax.Array, x: PyTree) -> Params:
        variables = module.init({"params": key, "dropout": key}, x, **mode(False))
        extra = set(variables) - {"params"}
        if extra:
            raise ValueError(
                f"{type(module).__name__} has variable collections {sorted(extra)} besides 'params'; "
                "jpipe stages must be pure functions of their parameters (no batch statistics or "
                "other mutable state)"
            )
        return variables.get("params", {})

    def apply(params: Params, x: PyTree, keys: jax.Array | None = None) -> PyTree:
        if keys is None:
            return module.apply({"params": params}, x, **mode(False))
        return _per_sample(lambda xi, key: module.apply({"params": params}, xi, rngs={"dropout": key},
                                                        **mode(True)), x, keys)

    def uses_rng(params: Params, x: PyTree) -> bool:
        try:  # a training call without keys: Linen refuses it where a layer draws random numbers
            jax.eval_shape(lambda p, xi: module.apply({"params": p}, xi, **mode(True)), params, x)
        except flax.errors.InvalidRngError:
            return True
        return False

    return Component(init, apply, stochastic=uses_rng)


def _rngs_by_keyword(constructor: Callable) -> bool:
    """Whether ``constructor`` takes ``rngs`` keyword-only (``def __init__(self, *, rngs)``, NNX's usual form)."""
    try:
        # a class's own __init__: NNX's metaclass shows (*args, **kwargs) for the class itself
        target = constructor.__init__ if isinstance(constructor, type) else constructor
        param = inspect.signature(target).parameters.get("rngs")
    except (TypeError, ValueError):  # no signature to read: pass it positionally
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def _nnx_component(constructor: Callable[[nnx.Rngs], nnx.Module], what: str) -> Component:
    by_keyword = _rngs_by_keyword(constructor)

    def build(key: jax.Array) -> nnx.Module:
        rngs = nnx.Rngs(key)
        module = constructor(rngs=rngs) if by_keyword else constructor(rngs)
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"{what} must be a Flax NNX module constructor (rngs -> nnx.Module) or a Linen "
                f"module instance; calling it returned {type(module).__name__}"
            )
        return module

    abstract = nnx.eval_shape(lambda: build(jax.random.key(0)))
    graphdef, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
    # Non-parameter state (e.g. an unused Rngs) is kept as constants from one instance; a module
    # holding random-number streams (nnx.Dropout keeps its Rngs) is stochastic.
    _, _, rest = nnx.split(build(jax.random.key(0)), nnx.Param, ...)
    streams = [path for path, v in nnx.to_flat_state(rest) if isinstance(v, nnx.RngKey)]

    def fresh(tree: Any) -> Any:
        return jax.tree.map(lambda v: v, tree)  # a new State we may fill and mutate in place

    def merged(params: Params, key: jax.Array | None) -> nnx.Module:
        state = fresh(abstract_params)
        nnx.replace_by_pure_dict(state, params)
        extra = fresh(rest)
        if key is not None:  # every stream restarts from the sample's key (a stream of its own each)
            flat = dict(nnx.to_flat_state(extra))
            for i, path in enumerate(streams):
                flat[path].set_value(jax.random.fold_in(key, i))
                count = path[:-1] + ("count",)
                if count in flat:
                    flat[count].set_value(jnp.zeros_like(flat[count].get_value()))
        module = nnx.merge(graphdef, state, extra)
        if key is None and streams:
            module.eval()  # dropout off
        return module

    def init(key: jax.Array, x: PyTree) -> Params:
        del x
        return nnx.to_pure_dict(nnx.split(build(key), nnx.Param, ...)[1])

    def apply(params: Params, x: PyTree, keys: jax.Array | None = None) -> PyTree:
        if keys is None or not streams:
            return merged(params, None)(x)
        return _per_sample(lambda xi, key: merged(params, key)(xi), x, keys)

    return Component(init, apply, stochastic=bool(streams))


def as_component(part: Any, what: str) -> Component:
    """Turns an NNX constructor or a Linen module into a :class:`Component`."""
    if isinstance(part, Component):
        return part
    if isinstance(part, nn.Module):
        return _linen_component(part)
    if isinstance(part, nnx.Module):
        raise TypeError(
            f"{what} is an nnx.Module instance; pass a constructor instead, e.g. "
            f"`lambda rngs: {type(part).__name__}(..., rngs=rngs)`, so that jpipe can create "
            "each copy with its own parameters"
        )
    if callable(part):
        return _nnx_component(part, what)
    raise TypeError(
        f"{what} must be a Flax NNX module constructor (rngs -> nnx.Module) or a Linen module "
        f"instance, got {type(part).__name__}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Staged:
    """A model as ``pre``, ``num_layers`` copies of ``layer``, ``post`` and a ``loss``.

    ``pre`` maps a micro-batch (a pytree of arrays, batch on the leading axis) to
    hidden activations, each ``layer`` maps hidden to hidden (same shape and
    dtype), ``post`` maps hidden to outputs and ``loss(outputs, microbatch)``
    returns the micro-batch's mean loss. The first pipeline stage also runs
    ``pre``, the last also runs ``post`` and the loss. ``check_batch``, if
    given, checks every batch on the host before :func:`jpipe.train_step` runs
    it (e.g. that integer labels are in range, which no traced code can report);
    it raises ``ValueError`` naming the problem.

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> class Embed(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(3, 8, rngs=rngs)
    ...     def __call__(self, mb):
    ...         return self.linear(mb["x"])
    >>> model = Staged(
    ...     pre=Embed,
    ...     layer=lambda rngs: nnx.Linear(8, 8, rngs=rngs),
    ...     post=lambda rngs: nnx.Linear(8, 1, rngs=rngs),
    ...     num_layers=4,
    ...     loss=lambda out, mb: jnp.mean((out[:, 0] - mb["y"]) ** 2),
    ... )
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4)}
    >>> params = model.init_params(jax.random.key(0), batch)
    >>> len(params["layers"])
    4
    >>> float(model.loss_value(params, batch)) >= 0
    True
    """

    pre: Any
    layer: Any
    post: Any
    num_layers: int
    loss: Callable[[PyTree, PyTree], jax.Array]
    check_batch: Callable[[PyTree], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {self.num_layers!r}")
        object.__setattr__(self, "_pre", as_component(self.pre, "pre"))
        object.__setattr__(self, "_layer", as_component(self.layer, "layer"))
        object.__setattr__(self, "_post", as_component(self.post, "post"))

    # -- the pure functions the executor composes -------------------------------------------
    # ``keys``: ``None`` to run deterministically (evaluation), else one key per sample (sample_keys)
    def embed(self, pre_params: Params, microbatch: PyTree, keys: jax.Array | None = None) -> jax.Array:
        return self._pre.apply(pre_params, microbatch, keys)

    def layer_apply(self, layer_params: Params, hidden: jax.Array,
                    keys: jax.Array | None = None) -> jax.Array:
        return self._layer.apply(layer_params, hidden, keys)

    def head_loss(self, post_params: Params, hidden: jax.Array, microbatch: PyTree,
                  keys: jax.Array | None = None) -> jax.Array:
        return self.loss(self._post.apply(post_params, hidden, keys), microbatch)

    @property
    def components(self) -> tuple[Component, Component, Component]:
        """``pre``, ``layer`` and ``post`` as pure :class:`Component` s (``init``/``apply`` pairs),
        whatever framework they were written in: what a wrapper such as
        :func:`jpipe.averaging.ensemble` builds a new model from."""
        return self._pre, self._layer, self._post

    @property
    def stochastic(self) -> bool:
        """Whether a part draws random numbers when training (dropout): then each training step
        needs a key (``jpipe.init(..., rng=...)``). Linen parts are known after :meth:`check`."""
        return any(s is True for s in self.stochastic_parts())

    def stochastic_parts(self) -> tuple:
        """Per part (``pre``, ``layer``, ``post``): ``True`` if it draws random numbers when training,
        ``False`` if not, ``None`` while unknown (a Linen part before :meth:`check`)."""
        known = getattr(self, "_traced_stochastic", None)
        if known is not None:
            return known
        return tuple(c.stochastic for c in (self._pre, self._layer, self._post))

    def check(self, microbatch: PyTree) -> jax.ShapeDtypeStruct:
        """Traces ``pre``, a ``layer`` and ``post`` with the loss on ``microbatch``'s shapes (nothing
        runs) and returns the hidden state's shape; a part that does not fit raises ``ValueError``
        naming the part and the shapes. ``jpipe.init`` calls it first.

        >>> import jax.numpy as jnp
        >>> from jpipe import models
        >>> model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
        >>> model.check({"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 1))})
        ShapeDtypeStruct(shape=(4, 8), dtype=float32)
        """
        key = jax.random.key(0)
        try:
            pre = jax.eval_shape(self._pre.init, key, microbatch)
            hidden = jax.eval_shape(self._pre.apply, pre, microbatch)
        except Exception as e:
            raise ValueError(f"pre cannot take the micro-batch {_describe(microbatch)}: "
                             f"{type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(hidden, jax.ShapeDtypeStruct):
            raise ValueError(f"pre must return one array (the hidden state the stages pass on), got "
                             f"{_describe(hidden)}")
        try:
            layer = jax.eval_shape(self._layer.init, key, hidden)
            out = jax.eval_shape(self._layer.apply, layer, hidden)
        except Exception as e:
            raise ValueError(f"layer cannot take the hidden state {_shape(hidden)} that pre returns: "
                             f"{type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(out, jax.ShapeDtypeStruct) or (out.shape, out.dtype) != (hidden.shape, hidden.dtype):
            raise ValueError(f"layer maps the hidden state {_shape(hidden)} to {_describe(out)}; every "
                             f"layer must keep the hidden shape and dtype (stages pass it on to one another)")
        try:
            post = jax.eval_shape(self._post.init, key, hidden)
            loss = jax.eval_shape(self.head_loss, post, hidden, microbatch)
        except Exception as e:
            raise ValueError(f"post or the loss cannot take the hidden state {_shape(hidden)} and the "
                             f"micro-batch: {type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
            raise ValueError(f"the loss returns {_describe(loss)}, not a scalar; return the micro-batch's "
                             f"mean loss (e.g. jnp.mean(...))")
        parts = ((self._pre, pre, microbatch), (self._layer, layer, hidden), (self._post, post, hidden))
        object.__setattr__(self, "_traced_stochastic", tuple(
            c.stochastic if isinstance(c.stochastic, bool) else bool(c.stochastic(p, x))
            for c, p, x in parts))
        return hidden

    # -- the plain sequential model ----------------------------------------------------------
    def init_stacked(self, key: jax.Array, example_batch: PyTree) -> Params:
        """Parameters with the layers stacked on a leading ``num_layers`` axis."""
        # One compiled program instead of dozens of small eager ones (seconds per model).
        return jax.jit(self._init_stacked)(key, example_batch)

    def _init_stacked(self, key: jax.Array, example_batch: PyTree) -> Params:
        return self.init_slots(key, example_batch, np.arange(self.num_layers))

    def init_slots(self, key: jax.Array, example_batch: PyTree, slots: np.ndarray) -> Params:
        """``{"pre", "layers", "post"}`` with ``layers`` shaped ``[*slots.shape, ...]``: slot ``i`` holds
        layer ``slots[i]`` of the sequential model, zeros where ``slots[i] < 0``.

        Each layer's key depends only on ``key`` and its index, so the values do not
        depend on how the layers are laid out: traced under ``jax.jit`` with output
        shardings, each device computes only the slots it holds.

        >>> import jax, numpy as np
        >>> from jpipe import models
        >>> model = models.mlp(in_dim=3, hidden=4, out_dim=1, num_layers=3)
        >>> batch = {"x": np.ones((2, 3), np.float32), "y": np.zeros((2, 1), np.float32)}
        >>> both = model.init_slots(jax.random.key(0), batch, np.array([[2, -1], [0, 1]]))
        >>> seq = model.init_stacked(jax.random.key(0), batch)
        >>> k = lambda p: p["layers"]["linear"]["kernel"]
        >>> bool((k(both)[0, 0] == k(seq)[2]).all()), bool((k(both)[0, 1] == 0).all())
        (True, True)
        """
        k_pre, k_layers, k_post = jax.random.split(key, 3)
        pre = self._pre.init(k_pre, example_batch)
        hidden = jax.eval_shape(self._pre.apply, pre, example_batch)
        h = jnp.zeros(hidden.shape, hidden.dtype)
        slots = np.asarray(slots)
        rows = slots.reshape(-1, slots.shape[-1])  # the leading axes vectorised, the last one a loop:
        keys = jax.random.split(k_layers, self.num_layers)[np.maximum(rows, 0)]  # one layer's temporaries

        def one(key_used: tuple[jax.Array, jax.Array]) -> Params:
            key, used = key_used
            return jax.tree.map(lambda a: jnp.where(used, a, jnp.zeros((), a.dtype)), self._layer.init(key, h))

        layers = jax.vmap(lambda k, u: jax.lax.map(one, (k, u)))(keys, jnp.asarray(rows >= 0))
        layers = jax.tree.map(lambda a: a.reshape(*slots.shape, *a.shape[2:]), layers)
        post = self._post.init(k_post, h)
        return {"pre": pre, "layers": layers, "post": post}

    def init_params(self, key: jax.Array, example_batch: PyTree) -> Params:
        """``{"pre": ..., "layers": [num_layers dicts], "post": ...}`` -- the sequential layout."""
        return unstack_layers(self.init_stacked(key, example_batch))

    def hidden_shape(self, pre_params: Params, microbatch: PyTree) -> jax.ShapeDtypeStruct:
        return jax.eval_shape(self.embed, pre_params, microbatch)

    def loss_value(self, params: Params, batch: PyTree, rng: jax.Array | None = None) -> jax.Array:
        """The loss of the plain (unpipelined) model on ``batch``; params in sequential layout.

        Without ``rng`` stochastic layers are off (evaluation). With it they draw from
        :func:`sample_keys` of ``rng``, as a pipelined training step does from its step's key
        (:func:`jpipe.step_rng`), so the two agree exactly.
        """
        size = jax.tree.leaves(batch)[0].shape[0]
        keys = (lambda part: None) if rng is None else (lambda part: sample_keys(rng, part, 0, size))
        h = self.embed(params["pre"], batch, keys(0))
        layers = params["layers"]
        if isinstance(layers, (list, tuple)):
            for i, p in enumerate(layers):
                h = self.layer_apply(p, h, keys(1 + i))
        elif rng is None:
            h, _ = jax.lax.scan(lambda h, p: (self.layer_apply(p, h), None), h, layers)
        else:
            h, _ = jax.lax.scan(lambda h, pi: (self.layer_apply(pi[0], h, keys(1 + pi[1])), None), h,
                                (layers, jnp.arange(self.num_layers)))
        return self.head_loss(params["post"], h, batch, keys(self.num_layers + 1))


def unstack_layers(params: Params) -> Params:
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        n = jax.tree.leaves(layers)[0].shape[0]
        layers = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]
    return {**params, "layers": list(layers)}


def _shape(a: Any) -> str:
    return f"{a.dtype}{list(a.shape)}"


def _describe(tree: PyTree) -> str:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if len(leaves) == 1 and not leaves[0][0]:
        return _shape(leaves[0][1]) if hasattr(leaves[0][1], "shape") else repr(leaves[0][1])
    return "{" + ", ".join(f"{jax.tree_util.keystr(p) or '.'}: {_shape(a) if hasattr(a, 'shape') else repr(a)}"
                           for p, a in leaves) + "}"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
