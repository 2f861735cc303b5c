"""The typed protocol between a transform and the library: what a transform is, for the
combinators, ``ft.step`` and :class:`~functional_train.TorchOptimizer`.

Each transform's ``update`` function carries ONE frozen :class:`TransformSpec`, attached with
:func:`attach_spec` (which merges the facts given into the spec already there, so that
:func:`~functional_train.base.declare`, :func:`~functional_train.engine.elementwise.register`
and a factory's own facts compose) and read with :func:`transform_spec`, which gives the
default spec (nothing declared) for a transform that has none: a user's optax-style
``GradientTransformation(init, update)`` with a plain function, a lambda, a builtin or any
other callable. The spec is kept in the function's ``__dict__``, so it travels with the
function through ``pickle`` (cloudpickle) and ``copy``.

A factory (``adamw``, ``inject_hyperparams(adamw)``) carries a :class:`FactorySpec` the same
way (:func:`attach_factory_spec`, :func:`factory_spec`).

This module imports nothing of the library at run time, so every module can use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .base import GradientTransformation
    from .engine.elementwise import Elementwise, Fusable, Switch
    from .transforms import AdamLeaf

__all__ = [
    "TransformSpec",
    "Injected",
    "Partitioned",
    "MicroSteps",
    "BuiltWith",
    "FactorySpec",
    "attach_spec",
    "transform_spec",
    "attach_factory_spec",
    "factory_spec",
]

_KEY = "__ft_spec__"
_FACTORY_KEY = "__ft_factory_spec__"


@dataclasses.dataclass(frozen=True)
class Injected:
    """What an :func:`~functional_train.inject_hyperparams` transform is (set by it; read by
    ``ft.step`` and :class:`~functional_train.TorchOptimizer`).

    Attributes:
        resolve: ``resolve(state) -> (inner transform, hyperparameters of this update, new
            count)``: the transform built for the state's hyperparameters (``ft.step`` steps
            it), and the count the new state holds.
        explain: ``explain(inner, hyperparameters, error) -> error``: an inner update's error
            with the host-read values that changed since init named (``ft.step``'s errors).
        given_as_tensors: the hyperparameters given as tensors (TorchOptimizer keeps them as
            tensors in its ``param_groups``).
    """

    resolve: Callable[[Any], tuple[GradientTransformation, dict, Any]]
    explain: Callable[[GradientTransformation, dict, Exception], Exception]
    given_as_tensors: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """What a :func:`~functional_train.partition` is (set by it; read by TorchOptimizer, which
    makes a param group of each label, and by ``galore_adamw``'s fused step).

    Attributes:
        transforms: ``label -> transform``, as given.
        param_labels: the labels as given (a tree or ``params -> tree``).
        labels_of: ``params -> [label per leaf]``, resolved and checked.
    """

    transforms: Mapping[str, GradientTransformation]
    param_labels: Any
    labels_of: Callable[[Any], list]


@dataclasses.dataclass(frozen=True)
class MicroSteps:
    """What a :func:`~functional_train.multi_steps` without ``should_skip_update_fn`` is (set
    by it; read by ``partition``, which runs a partition of such transforms with one
    ``every_k`` and ``acc_dtype`` as ``multi_steps`` of the partition of their inner ones).

    Attributes:
        inner: the inner transform, as given.
        every_k: micro-steps per inner update.
        acc_dtype: the accumulators' dtype, as given (``None``: the default).
    """

    inner: GradientTransformation
    every_k: int
    acc_dtype: Any


class BuiltWith(NamedTuple):
    """How one of this library's aliases built a transform (set by
    :func:`~functional_train.hyperparams.injectable`; read by TorchOptimizer to inject its
    hyperparameters): the factory (the ``injectable`` wrapper) and the arguments it was
    called with, by name."""

    factory: Callable[..., GradientTransformation]
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TransformSpec:
    """What a transform is, attached to its ``update`` function (see the module's docstring).
    Every field has the value of a transform that states nothing (a foreign one).

    Attributes:
        accepts_unreduced: it reduces gradients still unreduced over ``Mesh.data_axis`` (or
            ``Partial``) itself. Set by :func:`~functional_train.base.declare`; read by the
            combinators (:func:`~functional_train.base.call_reduced`), which reduce first for
            a transform that does not.
        accepts_view: it accepts the prepared view a chain hands along. Set by ``declare``;
            read by the combinators and ``ft.step``.
        passes_unreduced: it returns gradients still unreduced (``identity``; a chain or
            ``multi_steps`` of such). Set by ``identity``, ``chain``, ``named_chain``,
            ``multi_steps`` and passed on by ``inject_hyperparams``; read by the combinators,
            which otherwise hand what follows the reduced mesh descriptor.
        elementwise: its fused form for the engine: an
            :class:`~functional_train.engine.elementwise.Elementwise`, a ``Fusable`` or a
            ``Switch`` (``None``: it runs by its own ``update``). Set by
            :func:`~functional_train.engine.elementwise.register`; read by ``chain`` and
            ``ft.step`` (through ``elementwise.spec_of_transform`` / ``fusable_of`` /
            ``switch_of``).
        parts: the transforms of a ``chain``, in order. Set by ``chain``; read by ``ft.step``
            and ``apply_if_finite`` (a leading clip), the aliases (where their parts sit) and
            TorchOptimizer (to inject the one aliased part).
        partition: what a ``partition`` was given (:class:`Partitioned`). Set by
            ``partition``; read by TorchOptimizer and ``galore_adamw``.
        inject: what an ``inject_hyperparams`` transform is (:class:`Injected`). Set by it;
            read by ``ft.step`` and TorchOptimizer.
        built_with: how an alias of this library built it (:class:`BuiltWith`). Set by
            ``injectable``; read by TorchOptimizer.
        clip: ``(max_norm, norm_type)`` of a ``clip_by_global_norm``. Set by it; read by
            ``ft.step``'s legacy fused step and ``apply_if_finite``.
        fused: the description of an alias for ``ft.step``'s legacy fast step (``FusedAdam``,
            ``FusedSGD``, ``FusedAdam8bit``, ``FusedCame``, ``FusedAdafactor``,
            ``FusedGaLore``). Set by the aliases; read by ``ft.step``.
        keep_of: ``params -> [bool per leaf]``: the leaves a masked weight decay decays. Set
            by ``add_decayed_weights(mask=...)`` and Adafactor's final scale; read by the
            aliases for their ``fused`` descriptions.
        adam_leaf: ``scale_by_adam`` one leaf at a time
            (:class:`~functional_train.transforms.AdamLeaf`). Set by ``scale_by_adam`` (float
            moments, no amsgrad); read by GaLore's per-leaf step.
        per_leaf: ``scale_by_galore``'s update, finishing each leaf by a callback. Set by it;
            read by ``galore_adamw``'s fused step.
        micro_steps: what a ``multi_steps`` is (:class:`MicroSteps`). Set by it (without
            ``should_skip_update_fn``); read by ``partition``.
        zero: ``zero_redundancy``'s step, ``zero(grads, state, params, mesh, donate, extra,
            inner_step) -> (params, state)``: the inner transform stepped by ``inner_step``
            (``ft.step``'s own) on the zero view, the new parameter chunks gathered. Set by
            ``zero_redundancy``; read by ``ft.step``.
    """

    accepts_unreduced: bool = False
    accepts_view: bool = False
    passes_unreduced: bool = False
    elementwise: Elementwise | Fusable | Switch | None = None
    parts: tuple[GradientTransformation, ...] | None = None
    partition: Partitioned | None = None
    inject: Injected | None = None
    built_with: BuiltWith | None = None
    clip: tuple[float, float] | None = None
    fused: object | None = None
    keep_of: Callable[[Any], list] | None = None
    adam_leaf: AdamLeaf | None = None
    per_leaf: Callable[..., Any] | None = None
    zero: Callable[..., Any] | None = None
    micro_steps: MicroSteps | None = None


_NOTHING = TransformSpec()


def _stored(fn: Any, key: str, cls: type) -> Any:
    try:
        found = vars(fn).get(key)
    except TypeError:  # no __dict__ (a builtin, an object with __slots__)
        return None
    return found if isinstance(found, cls) else None


def attach_spec(update_fn: Callable, **facts: Any) -> Callable:
    """Record ``facts`` (fields of :class:`TransformSpec`, by name) in the spec of ``update_fn``
    (a transform's update function), merged into the spec already there; returns
    ``update_fn``.

    Raises:
        TypeError: a name that is not a field of :class:`TransformSpec`; ``update_fn`` has no
            ``__dict__`` (a builtin).
    """
    old = _stored(update_fn, _KEY, TransformSpec) or _NOTHING
    vars(update_fn)[_KEY] = dataclasses.replace(old, **facts)
    return update_fn


def transform_spec(tx: GradientTransformation) -> TransformSpec:
    """The :class:`TransformSpec` of ``tx`` (attached to ``tx.update``), or the default spec
    (nothing declared) when none is attached. Never raises for a callable ``update``."""
    return _stored(tx.update, _KEY, TransformSpec) or _NOTHING


@dataclasses.dataclass(frozen=True)
class FactorySpec:
    """What a transform factory is, attached to the factory (see the module's docstring).

    Attributes:
        wraps: the factory a wrapper stands for (``injectable``'s wrapper: the decorated
            function; ``inject_hyperparams(f)``: ``f``'s). Set by ``injectable`` and
            ``inject_hyperparams``; read by ``inject_hyperparams`` (whether the factory is
            this library's, its name in errors).
        tensors: the hyperparameters its transforms read per update as tensors. Set by
            ``injectable(tensors=...)``; read by ``inject_hyperparams``.
        nonzero_tensors: those it reads as tensors only when their initial value is not 0.
            Set by ``injectable(nonzero_tensors=...)``; read by ``inject_hyperparams``.
    """

    wraps: Callable | None = None
    tensors: frozenset[str] = frozenset()
    nonzero_tensors: frozenset[str] = frozenset()


_NO_FACTORY = FactorySpec()


def attach_factory_spec(factory: Callable, **facts: Any) -> Callable:
    """Record ``facts`` (fields of :class:`FactorySpec`) in the spec of ``factory``, merged
    into the spec already there; returns ``factory``."""
    old = _stored(factory, _FACTORY_KEY, FactorySpec) or _NO_FACTORY
    vars(factory)[_FACTORY_KEY] = dataclasses.replace(old, **facts)
    return factory


def factory_spec(factory: Callable) -> FactorySpec:
    """The :class:`FactorySpec` of ``factory``, or the default (nothing stated)."""
    return _stored(factory, _FACTORY_KEY, FactorySpec) or _NO_FACTORY
