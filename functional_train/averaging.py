"""Parameter averaging: an exponential moving average of the parameters, kept in the state."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from . import _validate as V
from .base import GradientTransformation, declare
from .engine.dtensor import to_locals, wraps_like
from .engine.view import prepare
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
    unreduced gradients if it is used alone). Needs ``params``.

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

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, EmaParamsState):
            raise ValueError(
                "ema_params: expected the EmaParamsState from ema_params.init, "
                f"got {type(state).__name__}"
            )
        b = prepare(updates, params, mesh, need_params=True, name="ema_params")
        old_ema = flatten_as(state.ema, b.treedef, "EmaParamsState.ema", "the updates")
        idx = [i for i, p in enumerate(b.params) if p is not None and old_ema[i] is not None]
        e = to_locals([old_ema[i] for i in idx])
        cur = []
        for i, ei in zip(idx, e):
            p, u = b.params[i], b.locals[i]
            x = p if u is None else p + (u if u.dtype == p.dtype else u.to(p.dtype))
            cur.append(x if x.dtype == ei.dtype else x.to(ei.dtype))
        if warmup:
            n = state.count.to(torch.float64)
            d = torch.clamp((1.0 + n) / (10.0 + n), max=decay)
        else:
            d = torch.tensor(decay, dtype=torch.float64, device=state.count.device)
        w = torch.where(state.count == 0, torch.ones_like(d), 1.0 - d)
        new = (
            [torch.lerp(ei, ci, w.to(device=ei.device, dtype=ei.dtype)) for ei, ci in zip(e, cur)]
            if e
            else []
        )
        leaves = list(old_ema)
        for i, v in zip(idx, wraps_like(new, [old_ema[i] for i in idx])):
            leaves[i] = v
        return b.rebuild(b.locals), EmaParamsState(
            state.count + 1, tree_unflatten(b.treedef, leaves)
        )

    return GradientTransformation(init_fn, declare(update_fn, view=True))


def averaged_params(state: Any) -> Any:
    """The averaged parameters held by the (one) :class:`EmaParamsState` in ``state``, for
    evaluation (``torch.func.functional_call(model, ft.averaged_params(state), x)``): the
    params tree in the parameters' placements (in the average's dtype; the current parameters
    until the first update).

    Raises:
        ValueError: no, or several, EmaParamsState in ``state``.
    """
    return find_state(state, EmaParamsState, "averaged_params").ema
