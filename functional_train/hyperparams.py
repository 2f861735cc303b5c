"""Hyperparameters as state: optax's ``inject_hyperparams`` for this library's transforms."""

from __future__ import annotations

import functools
import inspect
import numbers
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch

from .base import GradientTransformation
from .tree import find_state

__all__ = ["inject_hyperparams", "InjectHyperparamsState", "set_hyperparams", "get_hyperparams",
           "injectable"]

# hyperparameters this library's factories accept as a schedule ``count -> value``: an injected
# one is handed to them as a schedule reading the state's tensor (no host read, no rebuild)
_NATIVE = frozenset({"learning_rate"})
# inner transforms kept per value of the hyperparameters read on the host
_CACHE_SIZE = 4


class InjectHyperparamsState(NamedTuple):
    """State of an :func:`inject_hyperparams` transform (optax's fields).

    Attributes:
        count: updates so far (0-dim int64 CPU tensor), the schedules' argument (a schedule's
            value is computed and kept on the CPU: no device synchronisation).
        hyperparams: ``name -> 0-dim float64 CPU tensor``: the value the last update used (at
            init, the value the first will use unless changed). Set them between updates with
            :func:`set_hyperparams` (or, as in optax, ``state.hyperparams[name] = value``);
            scheduled ones are recomputed by every update.
        inner_state: the state of the transform the factory builds.
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


class _Cell:
    """A schedule handed to the factory for a natively injected hyperparameter: returns the
    tensor the current update set (the factory's own count is ignored)."""

    __slots__ = ("name", "value")

    def __init__(self, name: str):
        self.name, self.value = name, None

    def __call__(self, count):
        del count
        if self.value is None:
            raise RuntimeError(f"inject_hyperparams: '{self.name}' read outside an update")
        return self.value


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, torch.Tensor):
        return v.ndim == 0 and (v.is_floating_point() or not v.dtype.is_complex) and (
            v.dtype != torch.bool)
    return isinstance(v, numbers.Real)


def _as_value(v: Any) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64).detach().to("cpu").reshape(())


def injectable(factory: Callable) -> Callable:
    """Decorate a transform factory so that the transforms it builds remember how (their
    ``update.built_with = (factory, arguments)``): :class:`~functional_train.TorchOptimizer`
    uses it to turn ``adamw(1e-3)`` into ``inject_hyperparams(adamw)(learning_rate=1e-3)``."""

    sig = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args, **kwargs):
        tx = factory(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        tx.update.built_with = (build, dict(bound.arguments))  # type: ignore[attr-defined]
        return tx

    build.__wrapped_factory__ = factory  # type: ignore[attr-defined]
    return build


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation], *,
                       static_args: tuple = ()) -> Callable[..., GradientTransformation]:
    """Make the numeric hyperparameters of ``inner_factory`` part of the state (optax
    ``inject_hyperparams``): ``inject_hyperparams(ft.adamw)(learning_rate=1e-3, b1=0.9)``.

    Injected: every argument given (positionally or by name) that is a real number, a 0-dim
    real tensor or a schedule ``count -> value``, unless its name is in ``static_args``,
    ``mask`` (a callable that is not a schedule), or an integer for a parameter whose default
    is an integer (``optim_bits``, ``rank``, ``block_size``...). Their values live in
    :attr:`InjectHyperparamsState.hyperparams` as 0-dim float64 CPU tensors, can be read for
    logging and set between updates (:func:`set_hyperparams`); schedules are evaluated at the
    state's count on every update (0 on the first).

    How the inner transform sees them:

    * ``learning_rate`` (every alias of this library takes a schedule there) is handed to the
      factory as a schedule that returns the state's tensor: changing it costs nothing, reads
      nothing on the host, and a compiled step does not recompile (``ft.step``'s fused kernels
      take it as their tensor learning rate).
    * Every other injected hyperparameter (and ``learning_rate`` for a factory of another
      library) is read on the host (a CPU tensor: no device synchronisation) and the inner
      transform is rebuilt when a value changes (the last few builds are cached). Under
      ``torch.compile`` such a read is a graph break: inject only the learning rate into a
      ``fullgraph=True`` step, or pass the others as plain numbers.

    The numbers equal the un-injected transform's bit for bit (float64 values are exact for
    Python floats). No collective of its own: the hyperparameters are the same on every rank
    (set them alike).

    Returns:
        a factory with ``inner_factory``'s parameters returning a
        :class:`~functional_train.GradientTransformation` whose state is
        :class:`InjectHyperparamsState`.

    Raises:
        TypeError: ``inner_factory`` is not callable; at call, arguments that do not fit it.
        ValueError: as ``inner_factory`` for out-of-range values (checked at construction on
            the initial values, and whenever a host-read value changes).
    """
    if not callable(inner_factory):
        raise TypeError(f"inject_hyperparams: inner_factory must be callable, "
                        f"got {type(inner_factory).__name__}")
    base = getattr(inner_factory, "__wrapped_factory__", inner_factory)
    sig = inspect.signature(inner_factory)
    ours = (getattr(base, "__module__", "") or "").startswith("functional_train")

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        injected, static = {}, {}
        for name, value in arguments.items():
            p = sig.parameters[name]
            int_default = (isinstance(p.default, int) and not isinstance(p.default, bool))
            if name in static_args or name == "mask" or p.kind in (p.VAR_POSITIONAL,
                                                                   p.VAR_KEYWORD):
                static[name] = value
            elif callable(value) and not isinstance(value, torch.Tensor):
                injected[name] = value
            elif _is_number(value) and not (int_default and isinstance(value, int)):
                injected[name] = value
            else:
                static[name] = value
        native = {n for n in injected if n in _NATIVE and ours}
        cells = {n: _Cell(n) for n in native}
        schedules = {n: v for n, v in injected.items()
                     if callable(v) and not isinstance(v, torch.Tensor)}

        def initial(name):
            v = injected[name]
            return _as_value(v(0) if name in schedules else v)

        builds: OrderedDict = OrderedDict()

        def build(host_values: tuple):
            hit = builds.get(host_values)
            if hit is None:
                kw = dict(static)
                kw.update(cells)
                kw.update(zip(host_names, host_values))
                hit = builds[host_values] = inner_factory(**kw)
                while len(builds) > _CACHE_SIZE:
                    builds.popitem(last=False)
            else:
                builds.move_to_end(host_values)
            return hit

        host_names = tuple(n for n in injected if n not in native)
        # validate and build once on the initial values
        first = build(tuple(float(initial(n)) for n in host_names))

        def init_fn(params):
            hp = {n: initial(n) for n in injected}
            # the count on the CPU, like the values: evaluating a schedule and storing its
            # value never waits for a device
            return InjectHyperparamsState(torch.zeros((), dtype=torch.int64), hp,
                                          first.init(params))

        def resolve(state):
            """``(inner transform, hyperparams of this update)``, with the cells set."""
            if not isinstance(state, InjectHyperparamsState):
                raise ValueError("inject_hyperparams: expected the InjectHyperparamsState "
                                 f"from init, got {type(state).__name__}")
            hp = dict(state.hyperparams)
            missing = [n for n in injected if n not in hp]
            if missing:
                raise ValueError(f"inject_hyperparams: the state has no hyperparameter(s) "
                                 f"{missing}; it comes from another transform")
            for n, v in hp.items():  # (optax's idiom may have put a Python number there)
                if not isinstance(v, torch.Tensor):
                    if not _is_number(v):
                        raise TypeError(f"inject_hyperparams: hyperparams['{n}'] must be a real "
                                        f"number or a 0-dim real tensor, got {type(v).__name__}")
                    hp[n] = _as_value(v)
            for n, fn in schedules.items():
                hp[n] = _as_value(fn(state.count))
            for n, cell in cells.items():
                cell.value = hp[n]
            inner = build(tuple(float(hp[n]) for n in host_names)) if host_names else first
            return inner, hp

        def update_fn(updates, state, params=None, *, mesh=None, **extra):
            inner, hp = resolve(state)
            updates, inner_state = inner.update(updates, state.inner_state, params, mesh=mesh,
                                                **extra)
            return updates, InjectHyperparamsState(state.count + 1, hp, inner_state)

        inner_update = first.update
        for attr in ("accepts_unreduced", "accepts_view", "passes_unreduced"):
            if hasattr(inner_update, attr):
                setattr(update_fn, attr, getattr(inner_update, attr))
        update_fn.resolve = resolve  # type: ignore[attr-defined]  (ft.step: the fused kernels)
        # names given as tensors (TorchOptimizer keeps them as tensors in its param_groups)
        update_fn.given_as_tensors = frozenset(  # type: ignore[attr-defined]
            n for n, v in injected.items() if isinstance(v, torch.Tensor))
        return GradientTransformation(init_fn, update_fn)

    wrapped.__wrapped_factory__ = base  # type: ignore[attr-defined]
    return wrapped


def set_hyperparams(state: Any, **values) -> Any:
    """A copy of ``state`` with the named hyperparameters of its (one)
    :class:`InjectHyperparamsState` set to ``values`` (numbers or 0-dim tensors; pure: the given
    state is not modified). A scheduled hyperparameter is recomputed by the next update anyway.

    Raises:
        ValueError: no, or several, InjectHyperparamsState in ``state``; a name it does not hold.
        TypeError: a value that is not a real number or a 0-dim real tensor.
    """
    def visit(node):
        if isinstance(node, InjectHyperparamsState):
            unknown = sorted(set(values) - set(node.hyperparams))
            if unknown:
                raise ValueError(f"set_hyperparams: no hyperparameter(s) {unknown}; the state "
                                 f"holds {sorted(node.hyperparams)}")
            hp = dict(node.hyperparams)
            for k, v in values.items():
                if not _is_number(v):
                    raise TypeError(f"set_hyperparams: {k} must be a real number or a 0-dim "
                                    f"real tensor, got {type(v).__name__}")
                hp[k] = _as_value(v)
            found.append(1)
            return node._replace(hyperparams=hp)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*[visit(c) for c in node])
        if isinstance(node, (list, tuple)):
            return type(node)(visit(c) for c in node)
        if isinstance(node, dict):
            return {k: visit(v) for k, v in node.items()}
        return node

    found: list = []
    out = visit(state)
    if len(found) != 1:
        raise ValueError(f"set_hyperparams: expected one InjectHyperparamsState in the state, "
                         f"found {len(found)}")
    return out


def get_hyperparams(state: Any) -> dict:
    """The ``hyperparams`` dict of the (one) :class:`InjectHyperparamsState` in ``state``.

    Raises:
        ValueError: no, or several, InjectHyperparamsState in ``state``.
    """
    return find_state(state, InjectHyperparamsState, "get_hyperparams").hyperparams
