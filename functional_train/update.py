"""apply_updates: params + updates, leaf by leaf, on local shards."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import optree
import torch

from . import aliasing, foreach
from .autograd import is_differentiable, requires_grads_like
from .engine import elementwise as E
from .engine.dtensor import spec_of, to_local, wraps_like
from .engine.metadata import Memo
from .engine.plan import describe, plan_for
from .leaves import DTYPE, SHAPE
from .tree import flatten_as, format_path, indexed, tree_flatten, tree_unflatten

__all__ = ["apply_updates", "params_like"]


def paired_locals(params: Any, updates: Any):
    """The checked pairs of ``params`` and ``updates``: ``(treedef, param leaves, indices of the
    leaves where both are present, param local shards, update local shards in the params'
    placements)``.

    Raises:
        ValueError / TypeError: as :func:`apply_updates`.
    """
    p, treedef = tree_flatten(params)
    u = flatten_as(updates, treedef, "updates", "params")
    if _plain_pairs(p, u):
        return treedef, p, list(range(len(p))), p, u
    idx = [i for i, x, d in indexed(p, u) if x is not None and d is not None]
    ul = []

    def path(i):
        return format_path(optree.tree_flatten_with_path(params, none_is_leaf=True)[0][i])

    for i in idx:
        d, x = u[i], p[i]
        if tuple(d.shape) != tuple(x.shape):
            raise ValueError(
                f"apply_updates: update for '{path(i)}' has shape "
                f"{tuple(d.shape)}, expected {tuple(x.shape)}"
            )
        # dtype attributes, not is_floating_point(): a DTensor method call dispatches
        if not (x.dtype.is_floating_point or x.dtype.is_complex) and (
            d.dtype.is_floating_point or d.dtype.is_complex
        ):
            raise TypeError(
                f"apply_updates: params leaf '{path(i)}' has dtype {x.dtype} but its "
                f"update is {d.dtype}; integer and bool parameters cannot take "
                f"floating updates (give them a None gradient to freeze them)"
            )
        sd, sp = spec_of(d), spec_of(x)
        if (sd is None) != (sp is None) or (
            sd is not None and sp is not None and sd.mesh is not sp.mesh and sd.mesh != sp.mesh
        ):
            raise ValueError(
                f"apply_updates: update for '{path(i)}' is {describe(d)}, but the "
                f"parameter is {describe(x)}; an update must have its parameter's "
                f"layout (the updates of a transform fed these params have it)"
            )
        if sd is not None and tuple(d.placements) != tuple(x.placements):
            d = d.redistribute(x.device_mesh, x.placements)
        ul.append(to_local(d))
    return treedef, p, idx, [to_local(p[i]) for i in idx], ul


_INEXACT = operator.attrgetter("is_floating_point", "is_complex")


def _plain_pairs(p: list, u: list) -> bool:
    """Whether :func:`paired_locals`' checks pass for every pair at once, by whole-list C
    loops: plain tensors on both sides (parameters may be ``nn.Parameter``; no ``None``, no
    DTensor), of equal shapes, and no integer parameter (for which the checks read each
    update's dtype). ``False`` leaves the leaf-by-leaf checks (and their errors) to the
    caller, and under ``torch.compile`` (dynamo does not trace ``attrgetter``)."""
    if torch.compiler.is_compiling():
        return False
    # (multi_steps' known zero updates: one tensor per shape, so a list of them holds a tensor
    # twice wherever two leaves share a shape, which the guards refuse. Neither looked up nor
    # offered, whatever the shapes: the failed lookup and refused offer were ~6% of an update
    # + apply_updates non-final micro-step's host time on 244 leaves of one shape)
    zeros = bool(u) and aliasing.is_known_zero(u[0])
    if not zeros and _PAIRS_BY_METADATA.get(None, (p, u)):
        return True
    # (the parameters' side: their shapes where they pass, remembered on their own, as
    # multi_steps' zero updates, one tensor per shape, cannot be: see .engine.metadata)
    shapes = _PARAMS_BY_METADATA.get(None, (p,))
    if shapes is None:
        if not set(map(type, p)) <= _PARAMETER_TYPES or not all(
            map(any, map(_INEXACT, set(map(DTYPE, p))))
        ):
            return False
        shapes = list(map(SHAPE, p))
        _PARAMS_BY_METADATA.put(None, (p,), shapes)
    ok = set(map(type, u)) == _TENSOR and list(map(SHAPE, u)) == shapes
    if ok and not zeros:
        _PAIRS_BY_METADATA.put(None, (p, u), True)
    return ok


# (pairs that passed, and parameters that passed with their shapes, by their exact
# metadata: one C++ check per list where the checks read three attributes of every tensor;
# see .engine.metadata)
_PAIRS_BY_METADATA = Memo()
_PARAMS_BY_METADATA = Memo()
_TENSOR = {torch.Tensor}
_PARAMETER_TYPES = {torch.Tensor, torch.nn.Parameter}


def apply_updates(params: Any, updates: Any) -> Any:
    """Return ``params + updates`` (new tensors; neither argument is modified).

    A parameter whose update is ``None``, or a known zero (the updates of a ``multi_steps``
    micro-step that is not its cycle's last), is returned as it is, recorded as shared so that
    a later donated ``ft.step`` copies it before writing (see :mod:`functional_train.aliasing`).

    Autograd: computed under ``torch.no_grad()``; a parameter that requires grad (an
    ``nn.Parameter``) gives a new leaf tensor that requires grad, so nothing links the steps.
    Inside :func:`functional_train.differentiable` the sum is recorded instead (meta-learning).

    Updates are cast to each parameter's dtype; ``None`` updates leave the parameter unchanged.
    DTensor parameters are updated on their local shards and keep their placements (an update
    must be a DTensor on the parameter's mesh; other placements are redistributed first).

    Raises:
        ValueError: ``updates`` does not have the structure of ``params``, a shape differs, or
            an update is plain where its parameter is a DTensor (or the converse, or on another
            mesh), naming the leaf and both layouts.
        TypeError: a floating update for an integer or bool parameter, naming the leaf.
    """
    treedef, p, idx, pl, ul = paired_locals(params, updates)
    if aliasing.recording():
        # a None update's parameter, or a known zero update's (multi_steps' non-final
        # micro-step), is returned as it is and recorded as shared (see .aliasing)
        # (whole-list C loops: a multi_steps cycle keeps every parameter three times in four)
        zero = aliasing.known_zero_flags(ul)
        if any(zero) or len(idx) < len(p):
            kept = list(itertools.compress(pl, zero))
            if len(idx) < len(p):
                on = set(idx)
                kept += [
                    to_local(x)
                    for i, x in enumerate(p)
                    if x is not None and i not in on and isinstance(x, torch.Tensor)
                ]
            aliasing.mark_shared_locals(kept)
            if any(zero):
                live = list(map(operator.not_, zero))
                idx, pl, ul = (list(itertools.compress(lst, live)) for lst in (idx, pl, ul))
    if torch.compiler.is_compiling() or list(map(DTYPE, ul)) != list(map(DTYPE, pl)):
        ul = [x if x.dtype == y.dtype else x.to(y.dtype) for x, y in zip(ul, pl)]
    record = is_differentiable()
    # (every leaf updated: the results from the pool of the leaves' plan, see apply_locals)
    plan = (lambda: plan_for(treedef, ul, pl, None)) if len(idx) == len(p) else None
    new = None if record or not idx else E.apply_locals(pl, ul, plan)
    if new is None:
        with contextlib.nullcontext() if record else torch.no_grad():
            new = foreach.add(pl, ul) if idx else []
    return tree_unflatten(treedef, params_like(p, idx, new))


def params_like(p: list, idx: Sequence[int], new: Sequence[Any]) -> list:
    """The new parameter leaves: ``p`` (the parameters' leaves) with the leaf at each
    position of ``idx`` replaced by the local result of ``new`` there, in that leaf's layout
    (:func:`~functional_train.engine.dtensor.wraps_like`) and requiring grad where it did
    (a no-op inside :func:`~functional_train.differentiable`). Whole-list C loops for plain
    tensors that do not require grad."""
    whole = len(idx) == len(p)
    olds = p if whole else [p[i] for i in idx]
    new = requires_grads_like(wraps_like(new, olds), olds)
    if whole:
        return new
    out = list(p)
    for i, n in zip(idx, new):
        out[i] = n
    return out
