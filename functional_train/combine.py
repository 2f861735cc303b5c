"""Combinators that give different leaves different transforms: ``partition`` and ``masked``
(optax semantics). Leaves a transform does not own hold no state in it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from . import accumulation as A
from .autograd import traced
from .base import GradientTransformation, declare, run_fused
from .engine import elementwise as E
from .engine.metadata import MemoDict, MemoList, remembered
from .engine.owners import assume_constant_result
from .engine.plan import by_layout
from .engine.scalars import sharing_schedules
from .engine.view import prepare
from .leaves import SHAPE
from .spec import Partitioned, attach_spec, transform_spec
from .tree import (
    PyTree,
    flat_dict_leaves,
    flatten_as,
    format_path,
    indexed,
    leaves_of,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)

__all__ = ["partition", "PartitionState", "masked", "MaskedState"]


class PartitionState(NamedTuple):
    """State of :func:`partition`: ``inner_states``, a dict ``label -> state`` of each
    transform, initialised on its own leaves only (the others are ``None`` in it)."""

    inner_states: dict


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner state over the masked-in leaves only."""

    inner_state: Any


def leaf_values(spec: PyTree | Callable[[PyTree], PyTree], params: PyTree, what: str) -> list:
    """The value of ``spec`` for each leaf of ``params`` (flatten order, ``None`` leaves
    included): the one resolution of every mask and labels tree (``masked``, ``partition``,
    the ``mask`` of ``add_decayed_weights`` and of the aliases that take one).

    ``spec`` is a tree, or ``params -> tree``, with the structure of ``params`` or of a prefix
    of it (optax's ``masked`` / ``partition`` semantics): a value where ``params`` holds a
    subtree applies to every leaf of that subtree, e.g. ``{"encoder": False, "decoder": {"w":
    True, "b": False}}`` for a params tree with several leaves under ``"encoder"``.

    Raises:
        ValueError: ``spec`` is neither (naming ``what`` and the first path where it differs).
    """
    tree = spec(params) if callable(spec) else spec
    try:
        return optree.broadcast_prefix(tree, params, none_is_leaf=True)
    except ValueError:
        raise ValueError(
            f"{what} does not have the structure of params nor of a prefix of it: "
            f"{_prefix_mismatch(tree, params)}"
        ) from None


def _prefix_mismatch(prefix: PyTree, full: PyTree) -> str:
    """Where ``prefix`` first stops being a prefix of ``full`` (for :func:`leaf_values`)."""

    def walk(p, f, path: tuple) -> str | None:
        if p.is_leaf():
            return None
        at = format_path(path)
        if f.is_leaf():
            return f"'{at}' is a {p.type.__name__} where params have a leaf"
        if p.type is not f.type:
            return f"'{at}' is a {p.type.__name__} where params have a {f.type.__name__}"
        pe, fe = p.entries(), f.entries()
        missing = [e for e in fe if e not in pe]
        extra = [e for e in pe if e not in fe]
        if missing:
            return f"'{format_path(path + (missing[0],))}' is missing"
        if extra:
            return f"'{format_path(path + (extra[0],))}' is not in params"
        for e, pc, fc in zip(pe, p.children(), f.children()):
            found = walk(pc, fc, path + (e,))
            if found is not None:
                return found
        return None

    found = walk(
        optree.tree_structure(prefix, none_is_leaf=True),
        optree.tree_structure(full, none_is_leaf=True),
        (),
    )
    return found or "the containers differ"


class PerLeaf:
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
        self._resolve, self._name = resolve, name
        # (the labels by shapes, read under compile: a plain dict of literal keys, which
        # dynamo guards by the keys read, kept in a memo list; a dict subclass it guards by its
        # key order, through a source a precompiled step's loader cannot rebuild)
        self._seen: MemoList = MemoList([{}])
        self._eager = MemoDict()
        self._last = MemoList((None, None, None))  # (treedef, shapes, values): the last
        # eager call's

    def __call__(self, params, flat: tuple | None = None) -> list:
        """The values for ``params``; ``flat``: ``(leaves, treedef)`` of ``params`` where the
        caller flattened them already (eagerly: not flattened again)."""
        if torch.compiler.is_compiling():
            leaves = leaves_of(params) if flat is None else flat[0]
            # (torch.Size keys, as eagerly: a tuple call per leaf cost dynamo 1.5x the bytecodes)
            sig = tuple([None if x is None else x.shape for x in leaves])
            hit = self._seen[0].get(sig)
            if hit is None or hit is self._AMBIGUOUS:
                raise RuntimeError(
                    f"{self._name}: under torch.compile the labels come from an eager call: "
                    "call init (or one eager update) on params of these shapes first"
                    + (" (two param trees of these shapes have different labels)" if hit else "")
                )
            return hit
        memo = E.statics_memo()  # (the parts of one step ask once)
        if memo is not None:
            seen = memo.get(self)
            if seen is not None and seen[0] is params:
                return seen[1]
        leaves, treedef = tree_flatten(params) if flat is None else flat
        # (a DTensor's shape read is 0.17 us, a whole-list pass 40 us at 242 leaves: the
        # shapes remembered per spec objects, one tuple object for them)
        sig = by_layout("PerLeaf shapes", (leaves,), lambda: _shapes(leaves))
        last_treedef, last_sig, values = self._last  # (one unpacking: atomic, see remembered)
        if last_treedef is not treedef or last_sig is not sig:  # (else the params of the last
            # call's structure and specs: no hashing)
            key = (treedef, sig)
            values = self._eager.get(key)
            if values is None:
                values = self._eager[key] = self._resolve(params)
                seen = self._seen[0]
                prev = seen.get(sig)
                seen[sig] = values if prev is None or prev == values else self._AMBIGUOUS
            self._last[:] = treedef, sig, values
        if memo is not None:
            memo[self] = (params, values)
        return values


@assume_constant_result  # (labels are static: dynamo calls it once)
def _equal_to(labels: list, n: str) -> tuple:
    """Whether each label is ``n``."""
    return tuple(map(operator.eq, labels, repeat(n)))


def _shapes(leaves: list) -> tuple:
    """The leaves' shapes (``None`` for a ``None`` leaf)."""
    try:  # (every leaf a tensor, the common case: a C loop; a torch.Size is a tuple)
        return tuple(map(SHAPE, leaves))
    except AttributeError:
        return tuple(None if x is None else tuple(x.shape) for x in leaves)


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
        param_labels: a tree of labels with the structure of the params or of a prefix of it
            (a label for a subtree labels each of its leaves; optax's semantics), or a function
            ``params -> labels tree``. Every label must name a transform.

    Unreduced gradients are reduced once for all leaves before the inner transforms run. Global
    quantities an inner transform computes (e.g. ``clip_by_global_norm``) are over its own
    leaves only. Each inner transform's state covers its own leaves (``None`` elsewhere).

    Gradient accumulation per parameter group, every transform a :func:`multi_steps` with one
    ``every_k`` and ``acc_dtype`` (and no ``should_skip_update_fn``), runs as ``multi_steps``
    of the partition of their inner transforms, the same computation leaf by leaf (each
    label's ``multi_steps`` steps on every call, so their counters agree): the micro-steps of
    every label are one choice and one pass per stage, as ``multi_steps`` alone. Eagerly, on
    gradients that need no reduction; the state is still one ``MultiStepsState`` per label,
    converted each call (each label's ``gradient_step`` its own; labels whose ``mini_step``
    differ run as their own transforms).

    Param groups that inject the same schedule (:func:`inject_hyperparams` of one schedule
    function in each label) evaluate it once per update, eagerly: each label's count is
    read on the host (a CPU tensor: no device synchronisation) and a label whose count and
    schedule match an earlier one's takes a clone of its value, the same bits.

    Raises:
        ValueError: a leaf label with no transform (naming the leaf path), a labels tree that
            is neither the params' structure nor a prefix of it (naming the path).
        TypeError: a value of ``transforms`` is not a GradientTransformation.
    """
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"partition: transforms[{label!r}] must be a GradientTransformation")
    return _partition(transforms, param_labels, None)


def _partition(
    transforms: Mapping[str, GradientTransformation],
    param_labels: PyTree | Callable[[PyTree], PyTree],
    labels_of: PerLeaf | None,
) -> GradientTransformation:
    """:func:`partition`, its labels resolved by ``labels_of`` where given (a partition's
    own, shared with the one it runs: one resolution per step, see :class:`PerLeaf`)."""
    names = list(transforms)

    def resolve_labels(params):
        labels = leaf_values(param_labels, params, "partition: param_labels")
        paths = None
        for i, lab in enumerate(labels):
            if lab not in transforms:
                paths = paths or tree_paths(params)
                raise ValueError(
                    f"partition: leaf '{paths[i]}' has label {lab!r}, which names no "
                    f"transform (labels: {names})"
                )
        return labels

    if labels_of is None:
        labels_of = PerLeaf(resolve_labels, "partition")

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
        if commuted is not None:  # (multi_steps of the partition of their inner transforms:
            # its update, fused or not, its updates in the gradients' dtypes)
            out = commuted.update(updates, state, params, mesh, extra)
            if out is not None:
                return out
        out = run_fused(spec, updates, state, params, mesh, "partition")
        if out is not None:  # (the fused form: the same parts ft.step runs)
            return out
        updates, mesh, treedef = _materialized(updates, params, mesh, "partition")
        return by_labels(updates, state, params, mesh, treedef, extra)

    @sharing_schedules  # (param groups injecting one schedule evaluate it once a step)
    def by_labels(updates, state, params, mesh, treedef, extra):
        labels = labels_of(params)
        u_leaves = leaves_of(updates)
        p_leaves = leaves_of(params)
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
            for i, k, x in indexed(keep, leaves_of(new)):
                if k:
                    out[i] = x
        return tree_unflatten(treedef, out), PartitionState(new_states)

    specs = [E.switch_of(transforms[n]) or E.fusable_of(transforms[n]) for n in names]
    spec: E.Fusable | E.Switch | None = None
    if all(isinstance(f, E.Fusable) and _restrictable(f) for f in specs):
        spec = _partition_fusable(names, specs, labels_of)
    elif all(isinstance(f, E.Switch) or (f is not None and _restrictable(f)) for f in specs):
        spec = _partition_switch(names, specs, labels_of)
    commuted = _Commuted.of(names, transforms, param_labels, labels_of)
    if commuted is not None:
        spec = commuted.switch(spec)
    if spec is not None:
        E.register(update_fn, spec)

    # (TorchOptimizer's param groups; labels_of: each leaf's label, for ft.step's per-leaf
    # GaLore path)
    attach_spec(update_fn, partition=Partitioned(dict(transforms), param_labels, labels_of))
    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


def mask_of(mask: PyTree | Callable[[PyTree], PyTree], where: str) -> PerLeaf:
    """``params -> [bool per leaf]`` (Python bools) for a mask given as a tree of bools (Python
    or NumPy) with the structure of the params or of a prefix of it, or as ``params -> mask
    tree`` (optax semantics; :func:`leaf_values`), resolved once per params structure and leaf
    shapes, and reused under ``torch.compile`` (see :class:`PerLeaf`). Calling it raises
    ValueError for a mask that is neither the params' structure nor a prefix of it and
    TypeError for a leaf that is not a bool, naming the path."""

    def resolve_mask(params):
        keep = leaf_values(mask, params, f"{where}: mask")
        for i, k in enumerate(keep):
            if not isinstance(k, (bool, np.bool_)):
                raise TypeError(
                    f"{where}: mask leaf '{tree_paths(params)[i]}' must be a bool "
                    f"(Python or NumPy), got {type(k).__name__}"
                )
        return [bool(k) for k in keep]

    return PerLeaf(resolve_mask, where)


def masked(
    inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]
) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; the others pass through unchanged
    (optax ``masked``) and hold no state in ``inner``.

    Args:
        inner: the transform for the masked-in leaves.
        mask: a tree of bools (Python or NumPy) with the structure of the params or of a prefix
            of it (a bool for a subtree applies to each of its leaves; optax's semantics), or
            ``params -> mask tree``.

    Raises:
        ValueError: a mask that is neither the params' structure nor a prefix of it (naming
            the path).
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
        u_leaves = leaves_of(updates)
        new, inner_state = inner.update(
            tree_unflatten(treedef, _select(u_leaves, keep)),
            state.inner_state,
            tree_unflatten(treedef, _select(leaves_of(params), keep)),
            mesh=mesh,
            **extra,
        )
        out = [x if k else u for x, u, k in zip(leaves_of(new), u_leaves, keep)]
        return tree_unflatten(treedef, out), MaskedState(inner_state)

    inner_fus = E.fusable_of(inner)
    if inner_fus is not None and _restrictable(inner_fus):
        E.register(update_fn, _masked_fusable(inner_fus, keep_of))
    elif (switch := E.switch_of(inner)) is not None:
        E.register(update_fn, _masked_switch(switch, keep_of))

    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


# --------------------------------------------------------------------------------------------
# the fused forms: the inner transforms' elementwise parts, each restricted to its leaves


def _restrictable(fus: E.Fusable) -> bool:
    """Whether the parts of ``fus`` can run restricted to some leaves in a pass over all: its
    updates are not zeros (``multi_steps`` inside). A reducing part (a clip, ``apply_if_finite``'s
    check) reduces over its own leaves (see ``Elementwise.restrict``)."""
    return not fus.zero_updates


def _restricted(part: E.Elementwise, on_of: Callable[[PyTree], list], where: str) -> E.Elementwise:
    """``part`` on the leaves where ``on_of(params)`` is True; elsewhere the update passes
    through and the part's state leaves (``None`` there: the inner state covers its own
    leaves) stay ``None``. ``part.static`` sees the params with ``None`` outside its leaves,
    as the inner transform does; a leaf's key packs the flag and the part's key
    (:func:`_pack_key`)."""
    inner_static = part.static
    inner_restrict = part.restrict

    def restrict(params):
        on = on_of(params)
        if inner_restrict is None:
            return on
        leaves, treedef = tree_flatten(params)
        inner = inner_restrict(tree_unflatten(treedef, _select(leaves, on)))
        return [bool(a) and bool(b) for a, b in zip(on, inner)]

    last = MemoList((None, None))  # (the flags list seen last, its keys: one list per layout)

    def static(params):
        on = on_of(params)
        if inner_static is None:
            if torch.compiler.is_compiling():
                return [bool(k) for k in on]
            return remembered(last, on, lambda: list(map(bool, on)))
        leaves, treedef = tree_flatten(params)
        inner = inner_static(tree_unflatten(treedef, _select(leaves, on)))
        return [_pack_key(bool(k), ik) for k, ik in zip(on, inner)]

    def leaf(u, p, s, h, key):
        on, inner_key = _unpack_key(key, inner_static is not None)
        if not on:
            return u, s
        return part.leaf(u, p, s, h, inner_key)

    return E.Elementwise(
        f"{where}({part.name})",
        leaf,
        part.prologue,
        part.fields,
        part.n_fields,
        needs_params=part.needs_params,
        static=static,
        reduces=part.reduces,
        # (its guard holds on its own leaves only: outside them it passes the updates
        # through whatever its flag; see elementwise._guards_of)
        guard=part.guard,
        context=part.context,
        leaf_scalars=part.leaf_scalars,
        reads_sum_squares=part.reads_sum_squares,
        reads_params_sum_squares=part.reads_params_sum_squares,
        restrict=restrict,
        flags=part.flags,
        sums_through=part.sums_through,
        starts=part.starts,
    )


def _pack_key(on: bool, inner: Any) -> Any:
    """A leaf's key for a restricted part whose own part has static keys (None, a bool or an
    int: a compiled stage takes these): ``False`` off; on, the part's key as an int: False 0,
    True 1, None 2, an int n >= 0 as n + 3, a negative one as it is."""
    if not on:
        return False
    if inner is None:
        return 2
    if isinstance(inner, bool):
        return int(inner)
    return inner + 3 if inner >= 0 else inner


def _unpack_key(key: Any, packed: bool) -> tuple:
    if key is False or key is None:
        return False, None
    if not packed:
        return True, None
    k = int(key)
    inner = {0: False, 1: True, 2: None}.get(k, k - 3 if k >= 3 else k)
    return True, inner


class _Restricter:
    """``restrict(fus)``: ``fus`` with every part restricted to the leaves where
    ``on_of(params)`` is True, its split and join its own; the restricted parts
    (``restrict.parts(parts)``) made once per parts tuple
    (:func:`~.engine.elementwise.derived_parts`). ``restrict.over(parts, fus)``: ``fus``'s
    split and join over restricted parts made before (a traced step cannot make parts: see
    ``Switch.traced_parts``)."""

    def __init__(self, on_of: Callable[[PyTree], list], where: str):
        self.parts = E.derived_parts(
            lambda parts: tuple(_restricted(p, on_of, where) for p in parts)
        )

    def __call__(self, fus: E.Fusable) -> E.Fusable:
        return E.Fusable(self.parts(fus.parts), fus.split, fus.join)

    @staticmethod
    def over(parts: tuple, fus: E.Fusable) -> E.Fusable:
        return E.Fusable(parts, fus.split, fus.join)


def _masked_inner(state):
    """The inner state of ``masked``'s state (raising for another)."""
    if not isinstance(state, MaskedState):
        raise ValueError(f"masked: expected a MaskedState, got {type(state).__name__}")
    return state.inner_state


def _masked_former(keep_of: Callable[[PyTree], list]) -> Callable[[E.Fusable], E.Fusable]:
    """``masked(inner, mask)``'s parts for an inner Fusable: its parts, restricted to the
    masked-in leaves (see :class:`_Restricter`)."""
    restrict = _Restricter(keep_of, "masked")
    return lambda inner: E.restated(restrict(inner), _masked_inner, MaskedState)


def _masked_fusable(inner: E.Fusable, keep_of: Callable[[PyTree], list]) -> E.Fusable:
    """``masked(inner, mask)``'s parts: ``inner``'s, restricted to the masked-in leaves."""
    return _masked_former(keep_of)(inner)


class _PartitionFormer:
    """``partition(transforms, labels)``'s parts for its transforms' Fusables (in the order of
    ``transforms``): each transform's, restricted to the leaves of its label (see
    :class:`_Restricter`), chained: ``former(inners)``. ``former.parts(parts_per_label)``: the
    restricted parts, made once per parts tuple; ``former.over(restricted, inners)``: the
    Fusables' splits and joins over restricted parts made before (under ``torch.compile``,
    where parts cannot be made)."""

    def __init__(self, names: list, labels_of: Callable[[PyTree], list]):
        self.names = names

        def on(n):
            last = MemoList((None, None))  # (the labels seen last and their flags: one list
            # object per layout, which the engine's memos key on)

            def of(params):
                labels = labels_of(params)
                if torch.compiler.is_compiling():  # (dynamo: a list, not a map of an operator)
                    return list(_equal_to(labels, n))
                return remembered(last, labels, lambda: list(map(operator.eq, labels, repeat(n))))

            return of

        self.restricters = [_Restricter(on(n), "partition") for n in names]

    def get(self, state):
        names = self.names
        if not isinstance(state, PartitionState) or list(state.inner_states) != names:
            raise ValueError(f"partition: expected a PartitionState with labels {names}")
        return tuple(state.inner_states[n] for n in names)

    def put(self, states):
        return PartitionState(dict(zip(self.names, states)))

    def __call__(self, inners: list) -> E.Fusable:
        combined = _combined([f.parts for f in inners])
        chained = combined([r(f) for r, f in zip(self.restricters, inners)])
        return E.restated(chained, self.get, self.put)

    def parts(self, parts_per_label: list) -> list:
        return [r.parts(ps) for r, ps in zip(self.restricters, parts_per_label)]

    @staticmethod
    def declared(parts_per_label: list, restricted: list) -> tuple:
        """The parts of what :meth:`over` makes of ``restricted`` (:meth:`parts` of
        ``parts_per_label``), in its order."""
        if _combined(parts_per_label) is E.chained:
            return tuple(q for ps in restricted for q in ps)
        return tuple(restricted[i][k] for i, k in E.stage_major(restricted))

    def over(self, restricted: list, inners: list) -> E.Fusable:
        combined = _combined([f.parts for f in inners])
        chained = combined(
            [r.over(ps, f) for r, ps, f in zip(self.restricters, restricted, inners)]
        )
        return E.restated(chained, self.get, self.put)


def _combined(parts_per_label: list) -> Callable[[list], E.Fusable]:
    """How ``partition`` chains its transforms' restricted Fusables: stage by stage
    (:func:`~.engine.elementwise.by_stages`: as many passes as the longest, not their sum),
    but in label order where one part object is in two labels' (one transform object given
    for two labels, as ``TorchOptimizer``'s param groups give one injected alias: its parts
    pass values to each other when their prologues run, through the run context or the
    transform's own cells, and interleaved, one label's parts would read the other's)."""
    seen: set = set()
    for ps in parts_per_label:
        own = {id(q) for q in ps}
        if own & seen:
            return E.chained
        seen |= own
    return E.by_stages


def _partition_fusable(names: list, inners: list, labels_of: Callable[[PyTree], list]):
    """``partition(transforms, labels)``'s parts: each transform's, restricted to the leaves
    of its label, chained stage by stage (:func:`_combined`)."""
    return _PartitionFormer(names, labels_of)(inners)


def _getter(positions: list) -> Callable[[list], list]:
    """``lst -> [lst[i] for i in positions]`` by one ``operator.itemgetter`` (a C loop)."""
    if len(positions) == 1:
        (i,) = positions
        return lambda lst: [lst[i]]
    get = operator.itemgetter(*positions)
    return lambda lst: list(get(lst))


class _Layout:
    """Where each label's leaves are, for :class:`_Commuted`'s conversions (C loops): the
    merged list of every label's list (each label's entries on its own leaves), a label's
    list of the merged one (``None`` / 0 elsewhere), and whether a label's list holds
    something outside its leaves."""

    def __init__(self, names: list, labels: list):
        n = len(labels)
        keeps = [[lab == name for lab in labels] for name in names]
        at = {name: k for k, name in enumerate(names)}
        self.merge = _getter([at[lab] * n + i for i, lab in enumerate(labels)]) if n else list
        # (the lists' elements at the label's leaves; the appended one (None / 0) elsewhere)
        self.split = [
            _getter([i if on else n for i, on in enumerate(keep)]) if n else list for keep in keeps
        ]
        self.outside = [[not on for on in keep] for keep in keeps]
        # (of a list of n elements and another: the first's at the label's leaves)
        self.pick = [
            _getter([i if on else n + i for i, on in enumerate(keep)]) if n else list
            for keep in keeps
        ]

    def merged(self, lists: list) -> list:
        """One list of the labels' ``lists``: each leaf's entry from its label's."""
        return self.merge(list(itertools.chain.from_iterable(lists)))

    def holds_outside(self, k: int, acc: list, flags: list) -> bool:
        """Whether label ``k``'s accumulators or flags are set outside its leaves."""
        present = map(operator.is_not, acc, repeat(None))
        return any(itertools.compress(present, self.outside[k])) or any(
            itertools.compress(flags, self.outside[k])
        )


class _Commuted:
    """``partition({label: multi_steps(inner_label, every_k)}, labels)`` run as
    ``multi_steps(partition({label: inner_label}, labels), every_k)``, its state converted
    per call (:meth:`state_in`, :meth:`state_out`): the two are one computation, leaf by leaf,
    where every label's counters agree (each label's ``multi_steps`` steps on every call, so
    they do), so the micro-steps of every label are one transform's (one choice, one pass a
    stage, one set of counters) where each label's took its own. The partition's state keeps
    its structure (a ``MultiStepsState`` per label, over its own leaves). Taken eagerly, for
    gradients that need no reduction (as ``multi_steps``' fused form; unreduced ones are
    reduced by the partition each micro-step), with states as ``partition.init`` makes them;
    anything else runs the labels' own transforms."""

    def __init__(self, names: list, merged: GradientTransformation, labels_of: PerLeaf):
        self.names = names
        self.merged = merged
        self.labels_of = labels_of
        self._layout = MemoList((None, None))  # (the labels seen last, their _Layout)
        self._flags = MemoList((None, None))  # (the merged flags made last, their values)
        self._last: _Last | None = None  # (the state returned last: see _Last)

    def __getstate__(self) -> dict:
        """Pickled and copied without the record of the state returned last (a state's, not
        the transform's; it holds weak references, which do not pickle)."""
        out = dict(self.__dict__)
        out["_last"] = None
        return out

    @classmethod
    def of(cls, names, transforms, param_labels, labels_of) -> _Commuted | None:
        """The commuted form where every transform is a ``multi_steps`` without
        ``should_skip_update_fn``, all with one ``every_k`` and ``acc_dtype``; else ``None``."""
        given = [transform_spec(transforms[n]).micro_steps for n in names]
        micro = [m for m in given if m is not None]
        if not micro or len(micro) != len(names):
            return None
        if len({(m.every_k, m.acc_dtype) for m in micro}) != 1:
            return None
        inner = _partition({n: m.inner for n, m in zip(names, micro)}, param_labels, labels_of)
        merged = A.multi_steps(inner, micro[0].every_k, acc_dtype=micro[0].acc_dtype)
        return cls(names, merged, labels_of)

    def layout(self, params, flat: tuple | None = None) -> _Layout:
        """The labels' :class:`_Layout` (remembered per labels list; ``flat``: the params'
        ``(leaves, treedef)``, see :class:`PerLeaf`)."""
        labels = self.labels_of(params, flat)
        return remembered(self._layout, labels, lambda: _Layout(self.names, labels))

    def state_in(self, updates, state, params, mesh, check_reduced: bool = True) -> tuple | None:
        """``(the merged multi_steps' state, the labels' layout, _flat_pair(updates,
        params), the labels' flag values)`` for the partition's ``state`` (the values a list
        per label where the flags are blocks, :func:`~.accumulation.plain_mode`, else
        ``None``), or ``None`` where the commuted form is not taken (see the class
        docstring; ``check_reduced``: whether the gradients need no reduction is asked here,
        else by the merged choice)."""
        if (
            torch.compiler.is_compiling()
            or traced()
            or params is None
            or not isinstance(state, PartitionState)
            or list(state.inner_states) != self.names
        ):
            return None
        states = [state.inner_states[n] for n in self.names]
        if not all(type(s) is A.MultiStepsState and not s.skip_state for s in states):
            return None
        first = states[0]
        k = int(first.mini_step)  # (the documented host read; gradient_step is not read)
        if any(int(s.mini_step) != k for s in states[1:]):
            return None
        flat = _flat_pair(updates, params)
        if flat is None or flat[3] is None:
            return None
        g, pl, _, treedef = flat
        if check_reduced and mesh is not None and not A.gradients_reduced(treedef, g, pl, mesh):
            return None
        try:
            accs = [flatten_as(s.acc_grads, treedef, "", "") for s in states]
        except ValueError:
            return None
        seens = [A.seen_values(s.seen) for s in states]
        if any(len(v) != len(g) for v in seens):
            return None
        plain = A.plain_mode()
        last = self._last
        if plain and last is not None:  # (the state returned last: its merged state, see _Last)
            got = last.recall(states, flat, accs, seens)
            if got is not None:
                return got
        layout = self.layout(params, (pl, treedef))
        # (a label's accumulators and flags outside its leaves: None and 0, as its init made
        # them)
        if any(map(layout.holds_outside, range(len(states)), accs, seens)):
            return None
        merged = A.MultiStepsState(
            first.mini_step,
            first.gradient_step,
            PartitionState({n: s.inner_state for n, s in zip(self.names, states)}),
            tree_unflatten(treedef, layout.merged(accs)),
            # (a block, read with one tolist; under a TorchDispatchMode, where flags are
            # read one by one, the labels' own flags, their documented counters)
            self.flags(layout.merged(seens))
            if plain
            else tuple(layout.merged([list(s.seen) for s in states])),
            {},
        )
        return merged, layout, flat, seens if plain else None

    def flags(self, values: list) -> tuple:
        """Merged flags holding ``values``: those made last where they still hold them (no
        transform writes flags in place: ``multi_steps`` makes new ones), else new ones."""
        last, held = self._flags  # (one unpacking: atomic, see remembered)
        if held != values or A.seen_values(last) != values:
            last = A.new_flags(values)
            self._flags[:] = last, values
        return last

    def state_out(self, new: A.MultiStepsState, merged: A.MultiStepsState, layout, olds, state):
        """The partition's state for the merged ``multi_steps``' new state ``new`` (from
        ``merged``, :meth:`state_in` of ``state``, which read the labels' flag values
        ``olds``): each label's accumulators and flags on its leaves (``None`` and 0
        elsewhere), its inner state, its counters moved as the merged ones moved
        (:func:`_moved`)."""
        rec = self._last
        # (the accumulators written in place, the merged tree given back: each label's own
        # tree too, where the last call's are known)
        if rec is not None and rec.merged is merged and new.acc_grads is merged.acc_grads:
            prev: list | None = rec.accs
            acc, treedef = [], rec.treedef
        else:
            prev = None
            acc, treedef = tree_flatten(new.acc_grads)
        acc.append(None)
        seen = None
        if new.seen is not merged.seen and olds is not None:
            values = A.seen_values(new.seen)
            self._flags[:] = new.seen, values  # (the merged flags of the next call, as a rule)
            seen = values + [0]
        out = {}
        accs: list = []  # (per label, its accumulators' leaves; its flags' values)
        vals: list | None = None if olds is None else []
        for k, (n, split, pick) in enumerate(zip(self.names, layout.split, layout.pick)):
            old = state.inner_states[n]
            flags = old.seen
            values = None if olds is None else olds[k]
            if seen is not None:
                values = split(seen)
                if values != olds[k]:
                    flags = A.new_flags(values)
            elif new.seen is not merged.seen:  # (the new flags at its leaves, read nowhere)
                flags = tuple(pick([*new.seen, *old.seen]))
            mine = split(acc) if prev is None else prev[k]
            accs.append(mine)
            if vals is not None:
                vals.append(values)
            out[n] = A.MultiStepsState(
                _moved(old.mini_step, merged.mini_step, new.mini_step),
                _moved(old.gradient_step, merged.gradient_step, new.gradient_step),
                new.inner_state.inner_states[n],
                tree_unflatten(treedef, mine) if prev is None else old.acc_grads,
                flags,
                {},
            )
        self._last = _Last.of(self, out, new, layout, treedef, accs, vals, state, merged)
        return PartitionState(out)

    def update(self, updates, state, params, mesh, extra) -> tuple | None:
        """The partition's ``update`` by the merged transform's, or ``None`` where
        :meth:`state_in` does not take it."""
        got = self.state_in(updates, state, params, mesh)
        if got is None:
            return None
        merged, layout, _, olds = got
        new_updates, new = self.merged.update(updates, merged, params, mesh=mesh, **extra)
        return new_updates, self.state_out(new, merged, layout, olds, state)

    def switch(self, labelled: E.Fusable | E.Switch | None) -> E.Fusable | E.Switch | None:
        """The partition's Switch: the merged ``multi_steps``' choice where :meth:`state_in`
        takes it, else ``labelled``'s (the labels' own transforms' form; under
        ``torch.compile``, its parts); ``labelled`` where the merged transform has no fused
        form."""
        merged_switch = E.switch_of(self.merged)
        if merged_switch is None:
            return labelled
        other = labelled if isinstance(labelled, E.Switch) else None

        def choose(updates, state, params, mesh):
            got = self.state_in(updates, state, params, mesh, check_reduced=False)
            if got is None:
                return None if other is None else other.choose(updates, state, params, mesh)
            merged, layout, (g, pl, _, treedef), olds = got
            if merged_switch.choose_leaves is not None:  # (the leaves flattened once)
                f = merged_switch.choose_leaves(treedef, g, merged, pl, mesh)
            else:
                f = merged_switch.choose(updates, merged, params, mesh)
            if f is None:
                return None

            def get(s):
                if s is not state:
                    raise ValueError("partition: the state chosen for is not the one stepped")
                return merged

            return E.restated(f, get, lambda new: self.state_out(new, merged, layout, olds, state))

        return E.Switch(choose, None if other is None else other.traced_parts)


class _Last:
    """What :meth:`_Commuted.state_out` returned last, so that the next call's
    :meth:`_Commuted.state_in` of it gives the merged state the merged transform returned
    (``merged``) rather than build an equal one (0.05 to 0.1 ms a call on 242 leaves).
    :meth:`recall` gives it only for labels' states whose fields are the very objects
    returned, whose accumulators' leaves are the ones returned (a dict entry replaced
    breaks it) and whose flags and counters hold the values returned (a checkpoint loaded in
    place breaks it); anything else is converted as usual.

    It does not keep the state alive once its user drops it: it holds the merged state (the
    labels' tensors, Adam's moments too) but not the counter one label's state alone holds
    (``anchor``: a label's ``mini_step``, made by :func:`_moved` for it), and forgets all
    when that counter goes (a weak reference's callback)."""

    __slots__ = ("anchor", "at", "fields", "merged", "layout", "treedef", "accs", "vals")

    def __init__(self, owner, at: int, out: dict, merged, layout, treedef, accs, vals):
        self.at = at
        mine = list(out.values())
        # (its callback holds nothing of the record: a replaced record goes at once, not at
        # the next cycle collection, which a pure step's old state would wait for)
        self.anchor = weakref.ref(
            mine[at].mini_step, functools.partial(_forget, weakref.ref(owner))
        )
        self.fields = [
            (None if k == at else s.mini_step, s.gradient_step, s.inner_state, s.acc_grads, s.seen)
            for k, s in enumerate(mine)
        ]
        self.merged, self.layout, self.treedef = merged, layout, treedef
        self.accs, self.vals = accs, vals

    @classmethod
    def of(cls, owner, out: dict, merged, layout, treedef, accs: list, vals, state, was):
        """The record of ``out`` (the labels' new states, from ``state`` by the merged
        transform's step from ``was`` to ``merged``), or ``None`` where no label's counter is
        a new tensor of its own (then nothing would tell when the state goes) or the flags
        are not read as blocks (``vals`` ``None``)."""
        if vals is None:
            return None
        held = {id(merged.mini_step), id(was.mini_step)}
        held.update(id(s.mini_step) for s in state.inner_states.values())
        at = next((k for k, s in enumerate(out.values()) if id(s.mini_step) not in held), None)
        if at is None:
            return None
        return cls(owner, at, out, merged, layout, treedef, accs, vals)

    def recall(self, states: list, flat: tuple, accs: list, seens: list) -> tuple | None:
        """:meth:`_Commuted.state_in`'s result for ``states`` (the labels' states, checked
        there as for a conversion; ``flat``: :func:`_flat_pair`; ``accs``, ``seens``: each
        label's accumulators' leaves and flag values) where they are the ones recorded, else
        ``None``."""
        anchor = self.anchor()
        if anchor is None or flat[3] is not self.treedef or len(states) != len(self.fields):
            return None
        for k, (s, f) in enumerate(zip(states, self.fields)):
            if (
                s.mini_step is not (anchor if k == self.at else f[0])
                or s.gradient_step is not f[1]
                or s.inner_state is not f[2]
                or s.acc_grads is not f[3]
                or s.seen is not f[4]
            ):
                return None
        if seens != self.vals or not all(
            all(map(operator.is_, leaves, mine)) for leaves, mine in zip(accs, self.accs)
        ):
            return None
        return self.merged, self.layout, flat, self.vals


def _forget(owner_ref, anchor) -> None:
    """The callback of a :class:`_Last`'s ``anchor``: its owner forgets it (where it is still
    the owner's record)."""
    owner = owner_ref()
    if owner is not None and owner._last is not None and owner._last.anchor is anchor:
        owner._last = None


def _moved(mine: torch.Tensor, was: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """A label's counter (``mine``) after the merged one went from ``was`` (the first
    label's) to ``now``: as it was where that did not change, else moved by as much (a
    tensor operation: ``gradient_step`` is not read on the host, and each label keeps its
    own)."""
    if now is was:
        return mine
    if mine is was:
        return now
    return mine + (now - was)


# a Switch inside (``multi_steps``, whose fused form is chosen per call): the combinator's
# fused form is chosen per call too, from its transforms' choices on their own leaves


def _flat_pair(updates, params) -> tuple | None:
    """``(update leaves, param leaves, rebuild, treedef)`` of a step, ``rebuild(leaves)``
    making a tree of the updates' structure (``treedef``, ``None`` where the leaves are not
    flattened by one), or ``None`` where the trees differ (the general path raises).
    Under ``torch.compile``, flat dicts of tensors (``dict(model.named_parameters())``) are
    read by :func:`~.tree.flat_dict_leaves` (dynamo traces optree's flattening as Python, at
    about half a second per 122-leaf tree) and rebuilt as dicts in optree's (sorted) key
    order."""
    if torch.compiler.is_compiling():
        u_leaves, p_leaves = flat_dict_leaves(updates), flat_dict_leaves(params)
        if u_leaves is not None and p_leaves is not None:
            keys = sorted(updates)
            if keys != sorted(params):
                return None
            return u_leaves, p_leaves, lambda leaves: dict(zip(keys, leaves)), None
    u_leaves, treedef = tree_flatten(updates)
    p_leaves, p_def = tree_flatten(params)
    if len(p_leaves) != len(u_leaves):
        return None
    # (eagerly the structures too: the params' leaves are then flattened by treedef, which
    # partition's labels are remembered by, PerLeaf; a flat dict's treedef is one object)
    if not torch.compiler.is_compiling() and p_def is not treedef and p_def != treedef:
        return None
    return u_leaves, p_leaves, lambda leaves: tree_unflatten(treedef, leaves), treedef


def _chosen_on(
    switch: E.Switch, keep: list, flat: tuple, state, mesh, written: bool = True
) -> E.Fusable | None:
    """What ``switch`` chooses for the leaves where ``keep`` is True (the trees its transform
    sees inside the combinator: ``None`` elsewhere; ``flat``: :func:`_flat_pair`), its zero
    updates written out (:func:`~.engine.elementwise.zeros_written`; as chosen where not
    ``written``), or ``None``. Eagerly by ``switch.choose_leaves`` where it has one (the
    trees not built)."""
    if not switch.reads_trees:
        f = switch.choose(None, state, None, mesh)
        return f if f is None or not written else E.zeros_written(f)
    u_leaves, p_leaves, rebuild, treedef = flat
    u, p = _select(u_leaves, keep), _select(p_leaves, keep)
    if switch.choose_leaves is not None and treedef is not None:
        f = switch.choose_leaves(treedef, u, state, p, mesh)
    else:
        f = switch.choose(rebuild(u), state, rebuild(p), mesh)
    return f if f is None or not written else E.zeros_written(f)


def _partition_switch(names: list, specs: list, labels_of: PerLeaf) -> E.Switch:
    """``partition``'s :class:`~.engine.elementwise.Switch` when some of its transforms have
    one: per call, each of those chooses on its own leaves, and the chosen Fusables are
    combined as :func:`_partition_fusable` combines fixed ones. Under ``torch.compile`` only
    where each Switch declares its parts there (``Switch.traced_parts``: the restricted parts
    made here, as a traced step cannot make parts); else ``None`` there (the general path)."""
    build = _PartitionFormer(names, labels_of)
    declared = [
        s.traced_parts if isinstance(s, E.Switch) else E.zeros_written(s).parts for s in specs
    ]
    traced = None if any(d is None for d in declared) else build.parts(declared)
    traced_parts = None if traced is None else build.declared(declared, traced)

    def choose(updates, state, params, mesh):
        compiling = torch.compiler.is_compiling()
        if (
            (compiling and traced is None)
            or params is None
            or not isinstance(state, PartitionState)
            or list(state.inner_states) != names
        ):
            return None
        flat = _flat_pair(updates, params)
        if flat is None:
            return None
        # (eagerly the params' leaves and treedef of _flat_pair: not flattened again)
        labels = labels_of(params, None if flat[3] is None else (flat[1], flat[3]))
        picked = []
        for i, (n, spec) in enumerate(zip(names, specs)):
            if isinstance(spec, E.Switch):
                keep = [lab == n for lab in labels] if spec.reads_trees else []
                spec = _chosen_on(spec, keep, flat, state.inner_states[n], mesh, False)
                if spec is None or (compiling and len(spec.parts) != len(traced[i])):
                    return None
            picked.append(spec)
        if compiling:
            return build.over(traced, [E.zeros_written(f) for f in picked])
        if all(f.zero_updates for f in picked):
            # (every label's updates zeros, so the partition's: not written, and p + 0 not
            # made; multi_steps' non-final micro-steps. Each part passes its updates through)
            fus = build([dataclasses.replace(f, zero_updates=False) for f in picked])
            return dataclasses.replace(fus, zero_updates=True)
        return build([E.zeros_written(f) for f in picked])

    return E.Switch(sharing_schedules(choose), traced_parts)


def _masked_switch(switch: E.Switch, keep_of: Callable[[PyTree], list]) -> E.Switch:
    """``masked``'s :class:`~.engine.elementwise.Switch` around an inner one: per call, the
    inner's choice on the masked-in leaves, restricted to them (:func:`_masked_fusable`).
    Under ``torch.compile`` only where the inner Switch declares its parts there
    (``Switch.traced_parts``: the restricted parts made here, as a traced step cannot make
    parts); else ``None`` there (the general path)."""
    restrict = _Restricter(keep_of, "masked")
    traced = None if switch.traced_parts is None else restrict.parts(switch.traced_parts)

    def choose(updates, state, params, mesh):
        compiling = torch.compiler.is_compiling()
        if (compiling and traced is None) or params is None or not isinstance(state, MaskedState):
            return None
        flat = _flat_pair(updates, params)
        if flat is None:
            return None
        f = _chosen_on(switch, keep_of(params), flat, state.inner_state, mesh)
        if f is None:
            return None
        if compiling:  # (the parts the inner declared: see Switch.traced_parts)
            if len(f.parts) != len(traced):
                return None
            return E.restated(restrict.over(traced, f), _masked_inner, MaskedState)
        return E.restated(restrict(f), _masked_inner, MaskedState)

    return E.Switch(choose, traced)
