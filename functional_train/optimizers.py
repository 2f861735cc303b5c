"""User-facing optimizers: chains of primitives equal to their torch.optim namesakes."""

from __future__ import annotations

import torch

from . import _validate as V
from .base import GradientTransformation, chain
from .hyperparams import injectable, is_injected
from .quantization import FusedAdam8bit
from .spec import attach_spec, transform_spec
from .step import FusedAdam, FusedSGD
from .transforms import (
    ScalarOrSchedule,
    add_decayed_weights,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_trust_ratio,
    trace,
)

__all__ = ["sgd", "adam", "adamw", "lamb"]


def _number(v) -> bool:
    """Whether a checked hyper-parameter is a number (not a tensor or an injected value):
    then its value may be branched on at build time."""
    return not (isinstance(v, torch.Tensor) or is_injected(v))


def _maybe_maximize(maximize: bool, txs):
    return [scale(-1.0), *txs] if maximize else list(txs)


@injectable(tensors=("momentum", "dampening", "weight_decay"))
def sgd(
    learning_rate: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """``torch.optim.SGD`` as a chain, same arguments and defaults.

    ``g <- -g`` if maximize; ``g <- g + weight_decay * param``; momentum as :func:`trace`
    (dampening, nesterov); ``param <- param - lr * g``.

    Raises:
        ValueError: negative ``learning_rate``, ``momentum`` or ``weight_decay``; nesterov without
            momentum or with dampening.
    """
    V.learning_rate(learning_rate, where="sgd")
    momentum = V.number("momentum", momentum, where="sgd", low=0.0)
    weight_decay = V.number("weight_decay", weight_decay, where="sgd", low=0.0)
    dampening = V.number("dampening", dampening, where="sgd")  # (trace checks its range)
    if nesterov and (
        (_number(momentum) and momentum <= 0) or (_number(dampening) and dampening != 0)
    ):
        raise ValueError("sgd: nesterov momentum requires momentum > 0 and dampening == 0")
    txs = [add_decayed_weights(weight_decay)] if V.nonzero(weight_decay) else []
    if V.nonzero(momentum):
        txs.append(
            trace(
                momentum,
                nesterov=nesterov,
                dampening=dampening,
                accumulator_dtype=accumulator_dtype,
            )
        )
    txs.append(scale_by_learning_rate(learning_rate))
    tx = chain(*_maybe_maximize(maximize, txs))
    # torch's fused kernel starts a damped buffer undamped: fused only without dampening (an
    # injected one is read when the step runs, which falls back to the chain where it is not 0)
    if not (V.nonzero(momentum) and V.nonzero(dampening)) or is_injected(dampening):
        shift = 1 if maximize else 0
        fused = FusedSGD(
            learning_rate,
            momentum,
            weight_decay,
            nesterov,
            maximize,
            shift + len(txs) - 2 if V.nonzero(momentum) else None,
            shift + len(txs) - 1,
            dampening if V.nonzero(momentum) else 0.0,
        )
        attach_spec(tx.update, fused=fused)
    return tx


def _fused_adam(
    tx,
    decoupled,
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    amsgrad,
    maximize,
    optim_bits,
    n_parts,
    mask=None,
    block_size=256,
    min_8bit_size=4096,
):
    """Attach what ``ft.step``'s fused kernels need to an Adam chain (32-bit moments: torch's
    fused kernels; 8-bit without amsgrad: the compiled 8-bit kernel)."""
    shift = 1 if maximize else 0
    adam_index = shift + (1 if (V.nonzero(weight_decay) and not decoupled) else 0)
    parts = transform_spec(tx).parts
    assert parts is not None
    decay = parts[adam_index + 1] if (mask is not None and V.nonzero(weight_decay)) else None
    keep_of = None if decay is None else transform_spec(decay).keep_of
    if optim_bits == 8 and not amsgrad:
        fused8 = FusedAdam8bit(
            decoupled,
            learning_rate,
            b1,
            b2,
            eps,
            weight_decay,
            maximize,
            adam_index,
            n_parts - 1,
            keep_of,
            block_size,
            min_8bit_size,
        )
        attach_spec(tx.update, fused=fused8)
    if optim_bits == 32:
        fused = FusedAdam(
            decoupled,
            learning_rate,
            b1,
            b2,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            adam_index,
            n_parts - 1,
            keep_of,
        )
        attach_spec(tx.update, fused=fused)
    return tx


@injectable(tensors=("b1", "b2", "eps", "weight_decay"))
def adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    optim_bits: int = 32,
    min_8bit_size: int = 4096,
    block_size: int = 256,
) -> GradientTransformation:
    """``torch.optim.Adam`` as a chain, same arguments and defaults (``betas=(b1, b2)``).

    ``weight_decay`` is L2 added to the gradient before the moments, or AdamW's decoupled decay
    with ``decoupled_weight_decay=True`` (as in torch).

    ``optim_bits=8`` keeps the moments of leaves of at least ``min_8bit_size`` elements
    block-wise quantised to 8 bits, blocks of ``block_size`` along the last dim (bitsandbytes'
    ``Adam8bit``; see :func:`~functional_train.scale_by_adam`).

    Raises:
        ValueError: out-of-range hyper-parameters.
    """
    V.learning_rate(learning_rate, where="adam")
    weight_decay = V.number("weight_decay", weight_decay, where="adam", low=0.0)
    q = dict(optim_bits=optim_bits, min_8bit_size=min_8bit_size, block_size=block_size)
    if decoupled_weight_decay:
        return adamw(
            learning_rate,
            b1,
            b2,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            mu_dtype=mu_dtype,
            nu_dtype=nu_dtype,
            **q,
        )
    txs = [add_decayed_weights(weight_decay)] if V.nonzero(weight_decay) else []
    txs += [
        scale_by_adam(b1, b2, eps, amsgrad=amsgrad, mu_dtype=mu_dtype, nu_dtype=nu_dtype, **q),
        scale_by_learning_rate(learning_rate),
    ]
    txs = _maybe_maximize(maximize, txs)
    return _fused_adam(
        chain(*txs),
        False,
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        optim_bits,
        len(txs),
        None,
        block_size,
        min_8bit_size,
    )


@injectable(tensors=("b1", "b2", "eps", "weight_decay"))
def adamw(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    optim_bits: int = 32,
    min_8bit_size: int = 4096,
    block_size: int = 256,
    mask=None,
) -> GradientTransformation:
    """``torch.optim.AdamW`` as a chain, same arguments and defaults (``betas=(b1, b2)``).

    ``param <- param - lr * (adam_update + weight_decay * param)``: torch's decoupled decay
    ``param * (1 - lr * weight_decay)`` (Loshchilov & Hutter 2019).

    ``mask`` (optax's): ``None`` decays every leaf; a tree of bools with the structure of the
    params, or ``params -> such a tree`` (e.g. :func:`~functional_train.decay_mask`), decays only
    the leaves where it is True (torch: a parameter group with ``weight_decay=0`` for the rest).

    ``optim_bits=8`` keeps the moments of leaves of at least ``min_8bit_size`` elements
    block-wise quantised to 8 bits, blocks of ``block_size`` along the last dim (bitsandbytes'
    ``AdamW8bit``; see :func:`~functional_train.scale_by_adam`).

    Raises:
        ValueError: out-of-range hyper-parameters.
    """
    V.learning_rate(learning_rate, where="adamw")
    weight_decay = V.number("weight_decay", weight_decay, where="adamw", low=0.0)
    txs = [
        scale_by_adam(
            b1,
            b2,
            eps,
            amsgrad=amsgrad,
            mu_dtype=mu_dtype,
            nu_dtype=nu_dtype,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
        )
    ]
    if V.nonzero(weight_decay):
        txs.append(add_decayed_weights(weight_decay, mask=mask))
    txs.append(scale_by_learning_rate(learning_rate))
    txs = _maybe_maximize(maximize, txs)
    return _fused_adam(
        chain(*txs),
        True,
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        optim_bits,
        len(txs),
        mask,
        block_size,
        min_8bit_size,
    )


@injectable(tensors=("b1", "b2", "eps", "weight_decay"))
def lamb(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    mask=None,
) -> GradientTransformation:
    """LAMB (You et al. 2019), as the paper states it and optax ``lamb`` computes it.

    ``m, v`` Adam moments (bias-corrected when ``bias_correction``);
    ``r = m / (sqrt(v) + eps) + weight_decay * param``; ``trust = ||param|| / ||r||`` per leaf over
    the global tensor (1 if either is 0); ``param <- param - lr * trust * r``. Defaults are
    Colossal-AI's / the reference's: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0``.
    Under sharding the norms of every leaf take ONE all-reduce per update. ``mask`` (optax's):
    decay only the leaves where it is True (a tree of bools or ``params -> tree``, e.g.
    :func:`~functional_train.decay_mask`).

    Raises:
        ValueError: out-of-range hyper-parameters.
    """
    V.learning_rate(learning_rate, where="lamb")
    weight_decay = V.number("weight_decay", weight_decay, where="lamb", low=0.0)
    txs = [
        scale_by_adam(
            b1, b2, eps, bias_correction=bias_correction, mu_dtype=mu_dtype, nu_dtype=nu_dtype
        )
    ]
    if V.nonzero(weight_decay):
        txs.append(add_decayed_weights(weight_decay, mask=mask))
    txs += [scale_by_trust_ratio(), scale_by_learning_rate(learning_rate)]
    return chain(*txs)
