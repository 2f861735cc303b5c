"""The typed protocol between transforms and the library (``functional_train.spec``): one frozen
:class:`TransformSpec` per update function, the default one for a foreign transform, facts that
compose (``declare`` then ``register``), and specs that travel with a transform through copies
and pickles."""

import copy
import dataclasses
import pickle

import cloudpickle
import pytest
import torch

import functional_train as ft
from functional_train.base import accepts_unreduced, accepts_view, declare, passes_unreduced
from functional_train.engine import elementwise as E
from functional_train.hyperparams import injectable
from functional_train.spec import (
    FactorySpec,
    TransformSpec,
    attach_spec,
    factory_spec,
    transform_spec,
)


def _update(updates, state, params=None, *, mesh=None, **extra):
    return updates, state


class _Slotted:
    __slots__ = ()

    def update(self, updates, state, params=None, *, mesh=None, **extra):
        return updates, state


@pytest.mark.parametrize(
    "update",
    [_update, lambda u, s, p=None, **k: (u, s), len, _Slotted().update],
    ids=["function", "lambda", "builtin", "bound_method"],
)
def test_foreign_transform_has_the_default_spec(update):
    """A transform that states nothing (an optax-style ``GradientTransformation(init, update)``
    with a plain function, a lambda, a builtin or a bound method) reads as the default spec,
    without raising."""
    tx = ft.GradientTransformation(lambda p: ft.EmptyState(), update)
    assert transform_spec(tx) == TransformSpec()
    assert not accepts_unreduced(tx) and not accepts_view(tx) and not passes_unreduced(tx)
    assert E.spec_of_transform(tx) is None
    assert E.fusable_of(tx) is None and E.switch_of(tx) is None


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        transform_spec(ft.identity()).parts = ()  # type: ignore[misc]


def test_declare_and_register_compose():
    """``declare`` then ``register`` (and the reverse) keep both facts: each merges into the
    spec already there."""

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        return updates, state

    elementwise = transform_spec(ft.scale(2.0)).elementwise
    assert elementwise is not None
    declare(update_fn, view=True)
    E.register(update_fn, elementwise)
    tx = ft.GradientTransformation(lambda p: ft.EmptyState(), update_fn)
    assert accepts_view(tx) and accepts_unreduced(tx)
    assert E.spec_of_transform(tx) is elementwise
    attach_spec(update_fn, passes_unreduced=True)
    assert passes_unreduced(tx) and accepts_view(tx)
    assert transform_spec(tx).elementwise is elementwise
    with pytest.raises(TypeError):
        attach_spec(update_fn, not_a_field=1)
    with pytest.raises(TypeError):
        E.register(update_fn, "not a spec")  # type: ignore[arg-type]


def test_library_facts():
    """The facts the library's transforms state, read through the one reader."""
    clip, adamw = ft.clip_by_global_norm(1.0), ft.adamw(1e-3)
    tx = ft.chain(clip, adamw)
    assert transform_spec(clip).clip == (1.0, 2.0)
    assert transform_spec(tx).parts == (clip, adamw)
    assert transform_spec(adamw).fused is not None
    built = transform_spec(adamw).built_with
    assert built is not None and built.arguments == {"learning_rate": 1e-3}
    assert passes_unreduced(ft.identity()) and passes_unreduced(ft.chain(ft.identity()))
    assert not passes_unreduced(tx)
    assert transform_spec(ft.scale_by_adam()).adam_leaf is not None
    part = ft.partition({"a": ft.sgd(0.1)}, {"w": "a"})
    partitioned = transform_spec(part).partition
    assert partitioned is not None and partitioned.labels_of({"w": torch.zeros(2)}) == ["a"]


def test_inject_hyperparams_passes_the_protocol_on():
    """``inject_hyperparams`` states what its inner transform accepts and passes on, and its
    own ``inject`` facts; its factory stands for the alias it wraps."""
    inner = ft.adamw(1e-3)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=torch.tensor(1e-3, dtype=torch.float64))
    spec = transform_spec(tx)
    assert spec.accepts_view == accepts_view(inner)
    assert spec.accepts_unreduced == accepts_unreduced(inner)
    assert spec.inject is not None and spec.inject.given_as_tensors == {"learning_rate"}
    assert isinstance(spec.elementwise, E.Switch)
    wrapped = ft.inject_hyperparams(ft.adamw)
    assert factory_spec(wrapped).wraps is factory_spec(ft.adamw).wraps
    assert "b1" in factory_spec(ft.adamw).tensors


def test_factory_spec():
    def make(x: float = 1.0):
        return ft.scale(x)

    assert factory_spec(make) == FactorySpec()
    assert factory_spec(len) == FactorySpec()
    built = injectable(make, tensors=("x",))
    assert factory_spec(built) == FactorySpec(make, frozenset({"x"}), frozenset())
    spec = transform_spec(built(2.0)).built_with
    assert spec is not None and spec.factory is built and spec.arguments == {"x": 2.0}


@pytest.mark.parametrize("how", ["deepcopy", "cloudpickle"])
def test_spec_travels_with_the_transform(how):
    """A copy or a pickle round trip of a transform keeps its spec."""
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-3))
    if how == "deepcopy":
        new = copy.deepcopy(tx)
    else:
        new = pickle.loads(cloudpickle.dumps(tx))
    spec = transform_spec(new)
    assert spec.parts is not None and len(spec.parts) == 2
    assert transform_spec(spec.parts[0]).clip == (1.0, 2.0)
    assert E.fusable_of(new) is not None
    params = {"w": torch.ones(3)}
    grads = {"w": torch.full((3,), 0.5)}
    a, b = (
        ft.step(tx, grads, tx.init(params), params),
        ft.step(new, grads, new.init(params), params),
    )
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
