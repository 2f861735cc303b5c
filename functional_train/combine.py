"""Combinators that give different leaves different transforms: ``partition`` and ``masked``
(optax semantics). Leaves a transform does not own hold no state in it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from .base import GradientTransformation, declare
from .engine.view import prepare
from .tree import PyTree, flatten_as, tree_flatten, tree_paths, tree_unflatten

__all__ = ["partition", "PartitionState", "masked", "MaskedState"]


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``inner_states``, a dict ``label -> state`` of each
    transform, initialised on its own leaves only (the others are ``None`` in it)."""

    inner_states: dict


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner state over the masked-in leaves only."""

    inner_state: Any


def _resolve(spec, params: PyTree, what: str) -> list:
    """Per-leaf values of a labels/mask tree (or of ``spec(params)`` for a callable)."""
    tree = spec(params) if callable(spec) else spec
    _, treedef = tree_flatten(params)
    return flatten_as(tree, treedef, what, "params", params)


class _PerLeaf:
    """Per-leaf labels (or mask values) of a params tree, resolved once per params structure
    and leaf shapes: a callable is called on the first params of each layout, as under
    ``jax.jit`` (where optax calls it once per trace), not on every update, so the per-leaf
    host work of a mask such as ``decay_mask`` is not paid each step. Under ``torch.compile``
    the values resolved eagerly (by ``init`` or an eager update) are looked up by the params'
    leaf shapes alone (dynamo cannot flatten trees of strings or bools built in traced code):
    two param trees of the same shapes with different labels make that lookup ambiguous (an
    error under compile; eager calls are unaffected)."""

    _AMBIGUOUS = object()

    def __init__(self, resolve: Callable[[PyTree], list], name: str):
        self._resolve, self._name, self._seen, self._eager = resolve, name, {}, {}

    def __call__(self, params) -> list:
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
        sig = tuple(None if x is None else tuple(x.shape) for x in leaves)
        if torch.compiler.is_compiling():
            hit = self._seen.get(sig)
            if hit is None or hit is self._AMBIGUOUS:
                raise RuntimeError(
                    f"{self._name}: under torch.compile the labels come from an eager call: "
                    "call init (or one eager update) on params of these shapes first"
                    + (" (two param trees of these shapes have different labels)" if hit else "")
                )
            return hit
        key = (treedef, sig)
        values = self._eager.get(key)
        if values is None:
            values = self._eager[key] = self._resolve(params)
            prev = self._seen.get(sig)
            self._seen[sig] = values if prev is None or prev == values else self._AMBIGUOUS
        return values


def _select(leaves: list, keep: list) -> list:
    return [x if k else None for x, k in zip(leaves, keep)]


def _materialized(updates, params, mesh, name):
    """Reduce unreduced gradients once for every leaf, so each inner transform sees reduced ones."""
    b = prepare(updates, params, mesh, name=name)
    return b.rebuild(b.locals), b.mesh, b.treedef


def partition(
    transforms: Mapping[str, GradientTransformation],
    param_labels: PyTree | Callable[[PyTree], PyTree],
) -> GradientTransformation:
    """Apply ``transforms[label]`` to the leaves labelled ``label`` (optax ``partition``).

    Args:
        transforms: ``label -> transform``.
        param_labels: a tree of labels with the structure of the params, or a function
            ``params -> labels tree``. Every label must name a transform.

    Unreduced gradients are reduced once for all leaves before the inner transforms run. Global
    quantities an inner transform computes (e.g. ``clip_by_global_norm``) are over its own
    leaves only. Each inner transform's state covers its own leaves (``None`` elsewhere).

    Raises:
        ValueError: a leaf label with no transform (naming the leaf path), a labels tree whose
            structure differs from the params.
        TypeError: a value of ``transforms`` is not a GradientTransformation.
    """
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"partition: transforms[{label!r}] must be a GradientTransformation")
    names = list(transforms)

    def resolve_labels(params):
        labels = _resolve(param_labels, params, "param_labels")
        paths = None
        for i, lab in enumerate(labels):
            if lab not in transforms:
                paths = paths or tree_paths(params)
                raise ValueError(
                    f"partition: leaf '{paths[i]}' has label {lab!r}, which names no "
                    f"transform (labels: {names})"
                )
        return labels

    labels_of = _PerLeaf(resolve_labels, "partition")

    def init_fn(params):
        leaves, treedef = tree_flatten(params)
        labels = labels_of(params)
        return PartitionState(
            {
                n: transforms[n].init(
                    tree_unflatten(treedef, _select(leaves, [lab == n for lab in labels]))
                )
                for n in names
            }
        )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, PartitionState) or list(state.inner_states) != names:
            raise ValueError(f"partition: expected a PartitionState with labels {names}")
        if params is None:
            raise ValueError("partition needs params: call update(updates, state, params)")
        updates, mesh, treedef = _materialized(updates, params, mesh, "partition")
        labels = labels_of(params)
        u_leaves = tree_flatten(updates)[0]
        p_leaves = tree_flatten(params)[0]
        out = list(u_leaves)
        new_states = {}
        for n in names:
            keep = [lab == n for lab in labels]
            new, new_states[n] = transforms[n].update(
                tree_unflatten(treedef, _select(u_leaves, keep)),
                state.inner_states[n],
                tree_unflatten(treedef, _select(p_leaves, keep)),
                mesh=mesh,
                **extra,
            )
            for i, (k, x) in enumerate(zip(keep, tree_flatten(new)[0])):
                if k:
                    out[i] = x
        return tree_unflatten(treedef, out), PartitionState(new_states)

    update_fn.labels_of = labels_of  # each leaf's label (for ft.step's per-leaf GaLore path)
    update_fn.partition = (dict(transforms), param_labels)  # (TorchOptimizer's param groups)
    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


def mask_of(mask: PyTree | Callable[[PyTree], PyTree], where: str) -> _PerLeaf:
    """``params -> [bool per leaf]`` for a mask given as a tree of bools with the structure of
    the params or as ``params -> mask tree`` (optax semantics), resolved once per params
    structure and leaf shapes, and reused under ``torch.compile`` (see :class:`_PerLeaf`).
    Calling it raises ValueError for a mask whose structure differs from the params and
    TypeError for a leaf that is not a bool, naming the leaf path."""

    def resolve_mask(params):
        keep = _resolve(mask, params, "mask")
        for i, k in enumerate(keep):
            if not isinstance(k, bool):
                raise TypeError(
                    f"{where}: mask leaf '{tree_paths(params)[i]}' must be a bool, "
                    f"got {type(k).__name__}"
                )
        return keep

    return _PerLeaf(resolve_mask, where)


def masked(
    inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]
) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; the others pass through unchanged
    (optax ``masked``) and hold no state in ``inner``.

    Args:
        inner: the transform for the masked-in leaves.
        mask: a tree of bools with the structure of the params, or ``params -> mask tree``.

    Raises:
        ValueError: a mask whose structure differs from the params (naming the leaf path).
        TypeError: ``inner`` is not a GradientTransformation, or a mask leaf is not a bool.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError("masked: inner must be a GradientTransformation")
    keep_of = mask_of(mask, "masked")

    def init_fn(params):
        leaves, treedef = tree_flatten(params)
        return MaskedState(inner.init(tree_unflatten(treedef, _select(leaves, keep_of(params)))))

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, MaskedState):
            raise ValueError(f"masked: expected a MaskedState, got {type(state).__name__}")
        if params is None:
            raise ValueError("masked needs params: call update(updates, state, params)")
        updates, mesh, treedef = _materialized(updates, params, mesh, "masked")
        keep = keep_of(params)
        u_leaves = tree_flatten(updates)[0]
        new, inner_state = inner.update(
            tree_unflatten(treedef, _select(u_leaves, keep)),
            state.inner_state,
            tree_unflatten(treedef, _select(tree_flatten(params)[0], keep)),
            mesh=mesh,
            **extra,
        )
        out = [x if k else u for x, u, k in zip(tree_flatten(new)[0], u_leaves, keep)]
        return tree_unflatten(treedef, out), MaskedState(inner_state)

    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))
