"""Parameter averaging: an exponential moving average of the parameters, kept in the state."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from . import _validate as V
from .base import GradientTransformation, elementwise_transform
from .engine import elementwise as E
from .engine.dtensor import to_locals, wraps_like
from .engine.scalars import scalar_program
from .transforms import zero_count
from .tree import find_state, flatten_as, state_dtype, tree_unflatten

__all__ = ["ema_params", "EmaParamsState", "averaged_params"]


class EmaParamsState(NamedTuple):
    """State of :func:`ema_params`.

    Attributes:
        count: averages taken so far (0-dim int64; torch ``AveragedModel``'s ``n_averaged``).
        ema: the averaged parameters, params-shaped, in the parameters' placements (float32 for
            lower-precision parameters, see ``ema_dtype``); ``None`` for ``None`` params.
    """

    count: torch.Tensor
    ema: Any


def ema_params(
    decay: float, *, warmup: bool = False, ema_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Keep an exponential moving average of the parameters *after* each update, in the state
    (torch ``AveragedModel`` with ``get_ema_multi_avg_fn(decay)``): put it LAST in a chain,
    ``chain(clip_by_global_norm(1.0), adamw(1e-3), ema_params(0.999))``; it returns the updates
    unchanged and reads the averaged parameters with :func:`averaged_params`.

    With ``p' = params + updates`` (what ``apply_updates`` returns; a ``None`` update leaves
    ``p' = params``): the first update copies ``p'``; later ones ``ema <- ema + (1 - d) (p' -
    ema)`` (``torch.lerp``, torch's formula), with ``d = decay``, or with ``warmup=True``
    ``d = min(decay, (1 + n) / (10 + n))`` after ``n`` averages (the warmup of TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)`` and timm's ``ModelEmaV2``).

    Elementwise on local shards: exact under any sharding, no collective (beyond reducing
    unreduced gradients if it is used alone). Needs ``params``. An elementwise spec (see
    :mod:`functional_train.engine.elementwise`): after an elementwise chain, ``ft.step`` runs
    the chain, the parameters' update and the average in one pass.

    Args:
        decay: in [0, 1].
        warmup: the ramp above.
        ema_dtype: the average's dtype (default: float32, or the parameters' dtype when wider).

    State: :class:`EmaParamsState`.

    Raises:
        ValueError: ``decay`` outside [0, 1]; at update, no params, or a state from another
            transform.
    """
    decay = V.number("decay", decay, where="ema_params", low=0.0, high=1.0)

    def init_fn(params):
        # a copy of the parameters, as AveragedModel's deepcopy of the module
        ema = optree.tree_map(
            lambda x: (
                None
                if x is None
                else x.detach().to(dtype=state_dtype(x.dtype, ema_dtype), copy=True)
            ),
            params,
            none_is_leaf=True,
        )
        return EmaParamsState(zero_count(params), ema)

    def prologue(state, b):
        if not isinstance(state, EmaParamsState):
            raise ValueError(
                "ema_params: expected the EmaParamsState from ema_params.init, "
                f"got {type(state).__name__}"
            )
        w, count = _ema_weight(state.count, decay, warmup)

        def finish(trees):
            ema = trees[0]
            if len(b.active) < len(b.locals):
                ema = _without_updates(b, state.ema, ema, w)
            return EmaParamsState(count, ema)

        return (w,), finish

    def fields(state):
        return ((state.ema, "EmaParamsState.ema"),)

    def leaf(u, p, s, h, key):
        """``p' = p + u`` (in ``p``'s dtype), ``ema = lerp(ema, p', w)``, ``w = 1 - d`` (1 on
        the first update: a copy); the update passes unchanged."""
        e = s[0]
        x = p + u.to(p.dtype)
        return u, (torch.lerp(e, x.to(e.dtype), h[0].to(e.dtype)),)

    spec = E.Elementwise("ema_params", leaf, prologue, fields, 1, needs_params=True)
    return elementwise_transform(spec, init_fn)


def _without_updates(b, old_tree, new_tree, w):
    """The average of the leaves with a parameter but no update (``p' = p``), which the fused
    pass (over the leaves with an update) does not visit: ``lerp(ema, p, w)`` leaf by leaf."""
    old = flatten_as(old_tree, b.treedef, "EmaParamsState.ema", "the updates")
    leaves = flatten_as(new_tree, b.treedef, "EmaParamsState.ema", "the updates")
    active = set(b.active)
    idx = [
        i
        for i, (p, e) in enumerate(zip(b.params, old))
        if i not in active and p is not None and e is not None
    ]
    if not idx:
        return new_tree
    e = to_locals([old[i] for i in idx])
    new = []
    for i, ei in zip(idx, e):
        p = b.params[i]
        new.append(torch.lerp(ei, p.to(ei.dtype), w.to(device=ei.device, dtype=ei.dtype)))
    for i, v in zip(idx, wraps_like(new, [old[i] for i in idx])):
        leaves[i] = v
    return tree_unflatten(b.treedef, leaves)


def averaged_params(state: Any) -> Any:
    """The averaged parameters held by the (one) :class:`EmaParamsState` in ``state``, for
    evaluation (``torch.func.functional_call(model, ft.averaged_params(state), x)``): the
    params tree in the parameters' placements (in the average's dtype; the current parameters
    until the first update).

    Raises:
        ValueError: no, or several, EmaParamsState in ``state``.
    """
    return find_state(state, EmaParamsState, "averaged_params").ema


@scalar_program
def _ema_weight(count: torch.Tensor, decay: float, warmup: bool) -> tuple:
    """:func:`ema_params`' weight of the new values at the update after ``count`` updates
    (1 at the first, which copies them; else ``1 - decay``, the decay
    ``min(decay, (1 + n) / (10 + n))`` with ``warmup``), and the new count (0-dim tensors)."""
    if warmup:
        n = count.to(torch.float64)
        d = torch.clamp((1.0 + n) / (10.0 + n), max=decay)
    else:
        d = torch.as_tensor(decay, dtype=torch.float64, device=count.device)
    return torch.where(count == 0, torch.ones_like(d), 1.0 - d), count + 1
