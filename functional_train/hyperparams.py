"""Hyperparameters as state: optax's ``inject_hyperparams`` for this library's transforms."""

from __future__ import annotations

import functools
import inspect
import numbers
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _validate as V
from .autograd import host_value
from .base import GradientTransformation
from .engine import elementwise as E
from .engine.scalars import counted, schedule_numbers
from .spec import (
    BuiltWith,
    Injected,
    attach_factory_spec,
    attach_spec,
    factory_spec,
    transform_spec,
)
from .tree import find_state

__all__ = [
    "inject_hyperparams",
    "InjectHyperparamsState",
    "set_hyperparams",
    "get_hyperparams",
    "injectable",
]

# hyperparameters this library's factories accept as a schedule ``count -> value``: an injected
# one is handed to them as a schedule reading the state's tensor (no host read, no rebuild)
_NATIVE = frozenset({"learning_rate"})
# inner transforms kept per value of the hyperparameters read on the host
_CACHE_SIZE = 4


class InjectHyperparamsState(NamedTuple):
    """State of an :func:`inject_hyperparams` transform (optax's fields).

    Attributes:
        count: updates so far (0-dim int64 CPU tensor), the schedules' argument (a schedule's
            value is computed and kept on the CPU: no device synchronisation). Eagerly, inside
            a :func:`~functional_train.partition` it is read on the host (a CPU read: no
            device synchronisation), so that param groups injecting the same schedule
            evaluate it once per update.
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
    """What the factory receives for a natively injected hyperparameter: a schedule (for
    ``learning_rate``) returning the tensor the current update set (the factory's own count is
    ignored), or a placeholder its transforms read with :func:`value_of` (the others).

    The value is each thread's own eagerly (threads stepping one transform at once each read
    their own update's), and one attribute, which dynamo follows, under ``torch.compile``."""

    __slots__ = ("name", "traced", "local")
    injected = True  # _validate passes it through: its values are checked by inject_hyperparams

    def __init__(self, name: str):
        self.name, self.traced = name, None
        # (not made while dynamo traces, which cannot: then on the first eager update)
        self.local = None if torch.compiler.is_compiling() else threading.local()

    def set(self, value: Any) -> None:
        if torch.compiler.is_compiling():
            self.traced = value
            return
        if self.local is None:
            self.local = threading.local()
        self.local.value = value

    def __call__(self, count=None):
        del count
        if torch.compiler.is_compiling():
            value = self.traced
        else:
            value = getattr(self.local, "value", None)  # (None: no local, or none set)
        if value is None:
            raise RuntimeError(f"inject_hyperparams: '{self.name}' read outside an update")
        return value

    def __repr__(self) -> str:
        return f"<injected {self.name}>"

    def __reduce__(self):
        # (pickled and copied without its value: the last update's, read during an update
        # only, and set by each)
        return _Cell, (self.name,)


def value_of(x: Any) -> Any:
    """A hyperparameter's value at this update: ``x`` itself for a number; for one injected
    natively by :func:`inject_hyperparams`, the state's 0-dim float64 tensor under
    ``torch.compile`` (an input of the graph: changing it does not recompile) or when it is
    traced (it requires grad, or ``torch.func`` differentiates or batches it:
    :func:`~functional_train._validate.is_traced`), and that tensor's float otherwise (a CPU
    tensor: no device synchronisation; the same float the un-injected transform would hold, so
    the numbers are its own bit for bit)."""
    if type(x) is _Cell:
        v = x()
        return v if torch.compiler.is_compiling() or V.is_traced(v) else float(v)
    return x


def is_injected(x: Any) -> bool:
    """Whether ``x`` is a hyperparameter injected natively (read with :func:`value_of`)."""
    return type(x) is _Cell


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, torch.Tensor):  # (0-dim, or one element as torch.optim takes a lr)
        return (
            v.numel() == 1
            and (v.is_floating_point() or not v.dtype.is_complex)
            and (v.dtype != torch.bool)
        )
    return isinstance(v, numbers.Real)


def _as_value(v: Any) -> torch.Tensor:
    """A hyperparameter's value as the state holds it: a 0-dim float64 CPU tensor, detached
    unless traced (differentiated or batched by ``torch.func``, or requiring grad: it stays a
    function of its input, on its device)."""
    if V.is_traced(v):
        return v.to(torch.float64).reshape(())
    return torch.as_tensor(v, dtype=torch.float64).detach().to("cpu").reshape(())


def _scheduled_value(v: Any) -> torch.Tensor:
    """:func:`_as_value` of a schedule's value at this update, a new tensor: as it is where it
    is already one (eagerly, a plain 0-dim float64 CPU tensor: no operator a step)."""
    return v if V.plain_cpu(v, torch.float64) else _as_value(v)


def _host_read_error(name: str, where: str) -> str:
    return (
        f"inject_hyperparams: '{name}' of {where} is read on the host (the transform is rebuilt "
        f"when it changes), so it cannot be differentiated or batched by torch.func: pass it "
        f"as a number, or use a hyperparameter the factory reads as a tensor"
    )


def _checked_values(x: torch.Tensor) -> list:
    """The floats the host-side checks see for a value: every element behind a traced one
    (each batch element of a ``vmap``), else its own float."""
    return V.base_values(x) if V.is_traced(x) else [float(x)]


def _check_learning_rate(value: Any, where: str) -> None:
    """The library's check of a learning rate (:func:`~functional_train._validate.
    learning_rate`, which ``sgd``, ``adam``, ``adamw``, ``lamb``, ``muon`` and
    ``scale_by_learning_rate`` apply at construction: a finite number >= 0; torch.optim's
    "Invalid learning rate" is its ``< 0`` part) on a value set after construction: a number,
    or a 0-dim float64 CPU tensor (read on the host: no device synchronisation). ``adafactor`` and
    ``came``, which refuse a constant 0, take a 0 set later (a scheduler's warmup starts
    there, as their schedules may). Eagerly only: a compiled step cannot read it (the values
    set eagerly were checked there).

    Raises:
        ValueError: a NaN, infinite or negative value (naming ``where`` and the value).
    """
    if not torch.compiler.is_compiling():
        V.learning_rate(value, where=where)


def injectable(
    factory: Callable = None, *, tensors: tuple = (), nonzero_tensors: tuple = ()
) -> Callable:
    """Decorate a transform factory so that the transforms it builds remember how (the
    ``built_with`` of their spec, :class:`~functional_train.spec.BuiltWith`):
    :class:`~functional_train.TorchOptimizer` uses it to turn ``adamw(1e-3)`` into
    ``inject_hyperparams(adamw)(learning_rate=1e-3)``. The factory's own
    :class:`~functional_train.spec.FactorySpec` records the decorated function and the
    arguments below.

    ``tensors``: the hyperparameters the factory's transforms read per update with
    :func:`value_of` (so :func:`inject_hyperparams` hands them over natively, as tensors, with
    no rebuild); ``nonzero_tensors``: those it does natively only when their initial value is
    not 0 (a 0 there drops a transform from the chain, e.g. sgd's momentum, so the state's
    structure would depend on the value). ``learning_rate`` is native for every factory of
    this library."""
    if factory is None:
        return lambda f: injectable(f, tensors=tensors, nonzero_tensors=nonzero_tensors)

    sig = inspect.signature(factory)

    @functools.wraps(factory)
    def build(*args, **kwargs):
        tx = factory(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        attach_spec(tx.update, built_with=BuiltWith(build, dict(bound.arguments)))
        return tx

    return attach_factory_spec(
        build,
        wraps=factory,
        tensors=frozenset(tensors),
        nonzero_tensors=frozenset(nonzero_tensors),
    )


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation], *, static_args: tuple = ()
) -> Callable[..., GradientTransformation]:
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
      factory as a schedule that returns the state's tensor: changing it rebuilds nothing,
      and a compiled step does not recompile (``ft.step``'s fused kernels take it as their
      tensor learning rate). Given as a number (not a schedule), its initial value is checked
      by the factory, as at construction, and every value set later as a learning rate (a
      finite number >= 0) where it is set: by :func:`set_hyperparams` (which
      :class:`~functional_train.TorchOptimizer` calls with its group's value at every step),
      and by the next update for a number put in the dict by optax's idiom. The update reads
      no learning-rate tensor on the host: a value written into the state's tensor in place
      is not checked.
    * Every numeric hyperparameter of this library's aliases is handed over the same way (the
      factory declares them with :func:`injectable`): ``b1``, ``b2``, ``eps`` and
      ``weight_decay`` of :func:`~functional_train.adam`, :func:`~functional_train.adamw`,
      :func:`~functional_train.lamb` and :func:`~functional_train.galore_adamw` (and its
      ``scale``); ``momentum``, ``dampening`` and ``weight_decay`` of
      :func:`~functional_train.sgd`; ``clip_threshold``, ``decay_rate``, ``beta1`` and
      ``weight_decay`` of :func:`~functional_train.adafactor`; ``clip_threshold`` and
      ``weight_decay`` of :func:`~functional_train.came`; ``beta``, ``eps`` and
      ``weight_decay`` of :func:`~functional_train.muon`. The transforms read the state's
      tensor at every update (:func:`value_of`: eagerly as a float, under ``torch.compile`` as
      an input of the graph, so a ``fullgraph=True`` step does not recompile when they change).
      Their values are checked (as the factory checks them) eagerly whenever they change. A
      weight decay or momentum injected as 0 keeps its transform in the chain, which skips it
      while the value is 0 (the alias' numbers; a momentum buffer is kept, and starts as
      ``torch.optim.SGD``'s does once the momentum is set non-zero).
    * The others are read on the host (a CPU tensor: no device synchronisation) and the inner
      transform is rebuilt when a value changes (the last few builds are cached): every
      hyperparameter of a factory not declared with :func:`injectable` (another library's:
      its ``learning_rate`` too). Tuples (``betas``, ``eps`` pairs) are not injected. Under
      ``torch.compile`` a host read is a graph break: pass those as plain numbers into a
      ``fullgraph=True`` step.

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
        raise TypeError(
            f"inject_hyperparams: inner_factory must be callable, "
            f"got {type(inner_factory).__name__}"
        )
    wraps = factory_spec(inner_factory).wraps
    base = inner_factory if wraps is None else wraps
    sig = inspect.signature(inner_factory)
    ours = (getattr(base, "__module__", "") or "").startswith("functional_train")

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        injected, static = {}, {}
        for name, value in arguments.items():
            p = sig.parameters[name]
            int_default = isinstance(p.default, int) and not isinstance(p.default, bool)
            if name in static_args or name == "mask" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                static[name] = value
            elif callable(value) and not isinstance(value, torch.Tensor):
                injected[name] = value
            elif _is_number(value) and not (int_default and isinstance(value, int)):
                injected[name] = value
            else:
                static[name] = value
        schedules = {
            n: v for n, v in injected.items() if callable(v) and not isinstance(v, torch.Tensor)
        }
        numbers = schedule_numbers(schedules.values())  # (see engine.scalars.counted)
        # (what a step reads, as tuples: a compiled step guards on what it reads, and a
        # closure's dict is a guard a precompiled step's loader cannot rebuild)
        injected_names = tuple(injected)
        schedule_names, schedule_fns = tuple(schedules), tuple(schedules.values())

        def initial(name):
            v = injected[name]
            return _as_value(v(0) if name in schedules else v)

        inner_spec = factory_spec(inner_factory)
        tensors, nonzero = inner_spec.tensors, inner_spec.nonzero_tensors
        native = [  # (in the given order, not a set's: the cells below keep it)
            n
            for n in injected
            if (n in _NATIVE and ours)
            or n in tensors
            or (n in nonzero and float(initial(n)) != 0.0)
        ]
        cells = {n: _Cell(n) for n in native}

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
        # the natively injected values other than the learning rate are checked by building
        # the factory on them as numbers, when they change (eagerly: a graph cannot read them)
        checked_names = tuple(n for n in native if n not in _NATIVE)
        checked: OrderedDict = OrderedDict()

        def build_on(numbers: dict) -> None:
            """Build the factory on ``numbers`` (name -> float) for its own checks."""
            kw = dict(static)
            kw.update(cells)  # (the learning rate's: a schedule, checked as one)
            kw.update(numbers)
            inner_factory(**kw)

        def check(values: tuple) -> None:
            if values not in checked:
                build_on(dict(zip(checked_names, values)))
            checked[values] = True
            checked.move_to_end(values)
            while len(checked) > _CACHE_SIZE:
                checked.popitem(last=False)

        # a natively injected learning rate given as a number: the factory checks its initial
        # value (once, as at construction); the values set later are checked as learning rates
        # (_check_learning_rate: finite, >= 0, which a scheduler's warmup from 0 passes)
        # without building the factory, which a scheduler would make a per-step cost
        where = getattr(base, "__name__", "inject_hyperparams")
        lr_checked = "learning_rate" in native and "learning_rate" not in schedules and ours
        # validate and build once on the initial values (a traced one: on each of its values)
        for n in host_names:
            if V.is_traced(initial(n)):
                raise TypeError(_host_read_error(n, where))
        options = [_checked_values(initial(n)) for n in checked_names]
        first_checked = tuple(o[0] for o in options)
        extra = [
            (k, v) for k, o in enumerate(options) for v in o[1:]
        ]  # (the other values of a traced one)
        if lr_checked:  # (the factory's checks of the others too, in the same build)
            for lr0 in _checked_values(initial("learning_rate")):
                build_on({**dict(zip(checked_names, first_checked)), "learning_rate": lr0})
            checked[first_checked] = True
        elif checked_names:
            check(first_checked)
        for k, v in extra:
            build_on({**dict(zip(checked_names, first_checked)), checked_names[k]: v})
        first = build(tuple(float(initial(n)) for n in host_names))

        def init_fn(params):
            hp = {n: initial(n) for n in injected}
            # the count on the CPU, like the values: evaluating a schedule and storing its
            # value never waits for a device
            return InjectHyperparamsState(
                torch.zeros((), dtype=torch.int64), hp, first.init(params)
            )

        named_cells = tuple(cells.items())

        def set_cells(hp: dict) -> None:
            for n, cell in named_cells:
                cell.set(hp[n])

        def resolve(state):
            """``(inner transform, hyperparams of this update, new count)``, with the cells
            set."""
            if not isinstance(state, InjectHyperparamsState):
                raise ValueError(
                    "inject_hyperparams: expected the InjectHyperparamsState "
                    f"from init, got {type(state).__name__}"
                )
            hp = dict(state.hyperparams)
            missing = [n for n in injected_names if n not in hp]
            if missing:
                raise ValueError(
                    f"inject_hyperparams: the state has no hyperparameter(s) "
                    f"{missing}; it comes from another transform"
                )
            for n, v in hp.items():  # (optax's idiom may have put a Python number there)
                if not isinstance(v, torch.Tensor):
                    if not _is_number(v):
                        raise TypeError(
                            f"inject_hyperparams: hyperparams['{n}'] must be a real "
                            f"number or a 0-dim real tensor, got {type(v).__name__}"
                        )
                    if n == "learning_rate" and lr_checked:  # (not set by set_hyperparams)
                        _check_learning_rate(v, where)
                    hp[n] = _as_value(v)
            count, *values = counted(state.count, schedule_fns, numbers)
            hp.update(zip(schedule_names, map(_scheduled_value, values)))
            set_cells(hp)
            if (
                checked_names
                and not torch.compiler.is_compiling()
                and not any(V.is_traced(hp[n]) for n in checked_names)
            ):  # (traced values: checked at construction, cannot be read here)
                check(tuple(float(hp[n]) for n in checked_names))
            for n in host_names:  # (a differentiated value raises; a batched one must agree)
                if V.is_traced(hp[n], batched=False):
                    raise TypeError(_host_read_error(n, where))
            inner = (
                build(tuple(float(host_value(hp[n], f"{where}: {n}")) for n in host_names))
                if host_names
                else first
            )
            return inner, hp, count

        def update_fn(updates, state, params=None, *, mesh=None, **extra):
            inner, hp, count = resolve(state)
            try:
                updates, inner_state = inner.update(
                    updates, state.inner_state, params, mesh=mesh, **extra
                )
            except (ValueError, TypeError) as e:
                err = explain(inner, hp, e)
                if err is e:
                    raise
                raise err from e
            return updates, InjectHyperparamsState(count, hp, inner_state)

        def explain(inner, hp, error: Exception) -> Exception:
            """``error`` of an update of ``inner``, with the host-read values that changed
            since init named (their rebuild may need another state)."""
            if inner is first:
                return error
            was = {n: float(initial(n)) for n in host_names}
            now = {n: float(hp[n]) for n in host_names if float(hp[n]) != was[n]}
            return ValueError(
                f"inject_hyperparams: the update failed after the host-read hyperparameter(s) "
                f"{now} changed from {was} (a factory may leave a transform out of its chain "
                f"for a value of 0, so a non-zero value needs another state: inject it "
                f"non-zero, or build a new transform and state): {error}"
            )

        # what the inner transform accepts and passes on, the fused form chosen per call
        # (ft.step, chain), resolve (ft.step: the fused kernels), explain (ft.step: its errors)
        # and the names given as tensors (TorchOptimizer keeps them as tensors in its
        # param_groups)
        inner_spec = transform_spec(first)
        attach_spec(
            update_fn,
            accepts_unreduced=inner_spec.accepts_unreduced,
            accepts_view=inner_spec.accepts_view,
            passes_unreduced=inner_spec.passes_unreduced,
            elementwise=_fused_form(resolve, set_cells, traceable=not host_names, first=first),
            inject=Injected(
                resolve,
                explain,
                frozenset(n for n, v in injected.items() if isinstance(v, torch.Tensor)),
            ),
        )
        return GradientTransformation(init_fn, update_fn)

    return attach_factory_spec(wrapped, wraps=base)


def set_hyperparams(state: Any, **values) -> Any:
    """A copy of ``state`` with the named hyperparameters of its (one)
    :class:`InjectHyperparamsState` set to ``values`` (numbers or 0-dim tensors; pure: the given
    state is not modified). A scheduled hyperparameter is recomputed by the next update anyway.

    Each value is stored as a 0-dim float64 CPU tensor (a CUDA tensor is copied to the host
    here: one device synchronisation, at set time, not in the step). ``learning_rate`` is
    checked here as a learning rate (a finite number >= 0, the check ``sgd``, ``adam``,
    ``adamw``... apply at construction; eagerly: not under ``torch.compile``); the other
    values are checked by the next eager update, as the factory checks them.

    Raises:
        ValueError: no, or several, InjectHyperparamsState in ``state``; a name it does not hold;
            a NaN, infinite or negative ``learning_rate`` (naming the value).
        TypeError: a value that is not a real number or a 0-dim real tensor.
    """

    def visit(node):
        if isinstance(node, InjectHyperparamsState):
            unknown = sorted(set(values) - set(node.hyperparams))
            if unknown:
                raise ValueError(
                    f"set_hyperparams: no hyperparameter(s) {unknown}; the state "
                    f"holds {sorted(node.hyperparams)}"
                )
            hp = dict(node.hyperparams)
            for k, v in values.items():
                if not _is_number(v):
                    raise TypeError(
                        f"set_hyperparams: {k} must be a real number or a 0-dim "
                        f"real tensor, got {type(v).__name__}"
                    )
                hp[k] = _as_value(v)
                if k == "learning_rate":
                    _check_learning_rate(hp[k], "set_hyperparams")
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
        raise ValueError(
            f"set_hyperparams: expected one InjectHyperparamsState in the state, found {len(found)}"
        )
    return out


def get_hyperparams(state: Any) -> dict:
    """The ``hyperparams`` dict of the (one) :class:`InjectHyperparamsState` in ``state``.

    Raises:
        ValueError: no, or several, InjectHyperparamsState in ``state``.
    """
    return find_state(state, InjectHyperparamsState, "get_hyperparams").hyperparams


def _fused_form(resolve, set_cells, traceable: bool, first) -> E.Switch:
    """``inject_hyperparams``' :class:`~functional_train.engine.elementwise.Switch` choice: per
    call (eagerly; under ``torch.compile`` too where every value is ``traceable``, read as a
    tensor: no host read, the inner transform the one built at construction), the fused form
    of the inner transform built for this update's values, its state the inner state, the
    count and the values of this update kept around it; ``None`` where the inner transform
    has none (it then runs by its own ``update``).

    The inner's parts read the natively injected values from the transform's cells when their
    prologues run, so the fused form starts with a part that sets the cells to this update's
    values (``set_cells``; it passes the updates through): where one transform appears twice
    in a step (``TorchOptimizer``'s param groups: a ``partition`` of one injected alias), each
    appearance's parts read its own values, not those its last ``choose`` set. That part's
    state is the count and values (:class:`_Values`), so that a wrapper guarding the parts
    (``apply_if_finite`` on a non-finite step, a compiled ``multi_steps``' non-final
    micro-step) keeps them where it keeps the inner state, as the unfused wrappers do."""

    def setter_prologue(v, b):
        set_cells(v.next_hyperparams)
        new = _Values(v.next_count, v.next_hyperparams, v.next_count, v.next_hyperparams)
        return (), lambda trees: new

    # (one object per transform: the engine's caches key on the parts)
    setter = E.Elementwise("inject_hyperparams", _pass, setter_prologue, E.no_fields, 0)

    def choose(updates, state, params, mesh):
        if not isinstance(state, InjectHyperparamsState) or (
            torch.compiler.is_compiling() and not traceable
        ):
            return None
        inner, hp, count = resolve(state)
        fus = E.fusable_of(inner)
        if fus is None or fus.zero_updates:
            return None
        return E.Fusable(
            (setter, *fus.parts),
            lambda st: [_Values(st.count, st.hyperparams, count, hp), *fus.split(st.inner_state)],
            lambda states: InjectHyperparamsState(
                states[0].count, states[0].hyperparams, fus.join(states[1:])
            ),
        )

    # (under torch.compile the inner transform is the one built at construction: its parts)
    fus = E.fusable_of(first)
    fixed = traceable and fus is not None and not fus.zero_updates
    return E.Switch(choose, (setter, *fus.parts) if fixed else None, reads_trees=False)


class _Values(NamedTuple):
    """The state of ``inject_hyperparams``' fused form's first part: the count and values the
    new state holds (``count``, ``hyperparams``: the old ones until the part runs) and this
    update's (``next_count``, ``next_hyperparams``), which the part sets and makes the new
    ones (a guard selecting the old where its flag is false keeps the old)."""

    count: Any
    hyperparams: dict
    next_count: Any
    next_hyperparams: dict


def _pass(u, p, s, h, key):
    """The updates as they are (the part that sets the injected values)."""
    return u, ()
