"""apply_updates: params + updates, leaf by leaf, on local shards."""

from __future__ import annotations

from typing import Any

import optree
import torch

from .engine.dtensor import spec_of, to_local, wrap_like
from .tree import flatten_as, tree_flatten, tree_unflatten

__all__ = ["apply_updates"]


def paired_locals(params: Any, updates: Any):
    """The checked pairs of ``params`` and ``updates``: ``(treedef, param leaves, indices of the
    leaves where both are present, param local shards, update local shards in the params'
    placements)``.

    Raises:
        ValueError: ``updates`` does not have the structure of ``params``, or a shape differs.
    """
    p, treedef = tree_flatten(params)
    u = flatten_as(updates, treedef, "updates", "params")
    idx = [i for i, (x, d) in enumerate(zip(p, u)) if x is not None and d is not None]
    ul = []
    for i in idx:
        d = u[i]
        if tuple(d.shape) != tuple(p[i].shape):
            path = optree.tree_flatten_with_path(params, none_is_leaf=True)[0][i]
            raise ValueError(f"apply_updates: update for '{'.'.join(map(str, path))}' has shape "
                             f"{tuple(d.shape)}, expected {tuple(p[i].shape)}")
        if spec_of(d) is not None and spec_of(p[i]) is not None and (
                tuple(d.placements) != tuple(p[i].placements)):
            d = d.redistribute(p[i].device_mesh, p[i].placements)
        ul.append(to_local(d))
    return treedef, p, idx, [to_local(p[i]) for i in idx], ul


def apply_updates(params: Any, updates: Any) -> Any:
    """Return ``params + updates`` (new tensors; neither argument is modified).

    Updates are cast to each parameter's dtype; ``None`` updates leave the parameter unchanged.
    DTensor parameters are updated on their local shards and keep their placements (the update
    must have the parameter's placements, as every transform here returns them).

    Raises:
        ValueError: ``updates`` does not have the structure of ``params``, or a shape differs.
    """
    treedef, p, idx, pl, ul = paired_locals(params, updates)
    ul = [x if x.dtype == y.dtype else x.to(y.dtype) for x, y in zip(ul, pl)]
    new = torch._foreach_add(pl, ul) if idx else []
    out = list(p)
    for i, n in zip(idx, new):
        out[i] = wrap_like(n, p[i])
    return tree_unflatten(treedef, out)
