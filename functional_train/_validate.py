"""Hyper-parameter checks shared by every transform (clear ValueError/TypeError messages)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.autograd import forward_ad


def number(
    name: str,
    value: Any,
    *,
    where: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = False,
) -> Any:
    """Check ``value`` is a real number within the given bounds; return it as a float (a
    traced tensor as a 0-dim tensor, an injected value as it is: see below).

    Accepted: ``int``, ``float``, any ``numbers.Real`` (NumPy scalars) and real
    ``torch.Tensor`` of one element, 0-dim or not, as torch.optim takes them (read once,
    here); a tensor of more elements is a ValueError. ``finite``: reject infinities too. A
    hyperparameter injected natively by ``inject_hyperparams`` is returned as is (it checks
    the values).

    A tensor that is differentiated or batched -- one that requires grad, or a ``torch.func``
    wrapper (``grad``, ``jvp``, ``vmap`` over a vector of values) -- is returned as a 0-dim
    tensor, never read as a Python number (which would cut its derivative silently, or fail
    under ``vmap``): its value, every batch element of it, is checked all the same.
    """
    if getattr(value, "injected", False):
        return value
    if isinstance(value, torch.Tensor) and not value.is_complex() and value.dtype != torch.bool:
        if value.numel() != 1:
            raise ValueError(
                f"{where}: {name} as a tensor must have one element, got shape {tuple(value.shape)}"
            )
        if is_traced(value):
            for v in base_values(value):
                number(
                    name, v, where=where, low=low, high=high, low_open=low_open,
                    high_open=high_open, finite=finite,
                )  # fmt: skip
            return value.reshape(())
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: {name} must be a real number (int, float, a NumPy scalar or "
            f"a one-element real tensor), got {type(value).__name__}"
        )
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{where}: {name} must not be NaN, got {v}")
    if finite and math.isinf(v):
        raise ValueError(f"{where}: {name} must be finite, got {v}")
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"{where}: {name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (v > high or (high_open and v == high)):
        raise ValueError(
            f"{where}: {name} must be {'<' if high_open else '<='} {high}, got {value}"
        )
    return v


def is_traced(x: Any, *, batched: bool = True) -> bool:
    """Whether ``x`` is a tensor whose derivative or batch matters: it requires grad, or a
    ``torch.func`` transform differentiates it (``grad``, ``vjp``, ``jvp``) or batches it
    (``vmap``), at any level. A constant made inside a transform is not. Such a hyper-parameter
    is kept a tensor (:func:`number`), and never read as a Python number. ``batched=False``:
    only whether it is differentiated."""
    if torch.compiler.is_compiling():  # (dynamo cannot trace the functorch queries)
        return isinstance(x, torch.Tensor) and x.requires_grad
    F = torch._C._functorch
    while isinstance(x, torch.Tensor):
        if x.requires_grad or (batched and F.is_batchedtensor(x)):
            return True
        if not F.is_functorch_wrapped_tensor(x):
            return False
        if forward_ad.unpack_dual(x).tangent is not None:  # (jvp)
            return True
        x = F.get_unwrapped(x)  # (a constant at this level: traced at an outer one?)
    return False


def plain_cpu(x: Any, dtype: torch.dtype) -> bool:
    """Eagerly, whether ``x`` is a plain 0-dim CPU tensor of ``dtype`` that neither autograd
    records nor a ``torch.func`` transform wraps: one that can be read on the host without a
    device synchronisation, or kept as it is. ``False`` under ``torch.compile`` (dynamo does
    not trace the functorch query)."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and x.dtype == dtype
        and x.device.type == "cpu"
        and x.dim() == 0
        and not x.requires_grad
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
    )


def base_values(x: torch.Tensor) -> list:
    """The numbers behind a traced tensor (every batch element of a ``vmap`` one), read from
    the plain tensor under its ``torch.func`` wrappers, without recording anything."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.detach().reshape(-1).tolist()


def nonzero(value: Any) -> bool:
    """Whether a (checked) hyper-parameter may be non-zero: a number that is not 0; a tensor
    (a traced one, kept by :func:`number`, or one under ``torch.compile``: its value must not be
    branched on); one injected natively by ``inject_hyperparams`` (its value may change). A
    transform or alias leaves out its work only where this is False."""
    return isinstance(value, torch.Tensor) or getattr(value, "injected", False) or value != 0.0


def learning_rate(value: Any, *, where: str):
    """A non-negative finite number, or a schedule (callable of the step count)."""
    if callable(value):
        return value
    return number("learning_rate", value, where=where, low=0.0, finite=True)


def beta(name: str, value: Any, *, where: str) -> float:
    return number(name, value, where=where, low=0.0, high=1.0, high_open=True)


def integer(name: str, value: Any, *, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{where}: {name} must be >= {low}, got {value}")
    return value
