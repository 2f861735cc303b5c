"""Hyper-parameter checks shared by every transform (clear ValueError/TypeError messages)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


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
) -> float:
    """Check ``value`` is a real number within the given bounds; return it as a float.

    Accepted: ``int``, ``float``, any ``numbers.Real`` (NumPy scalars) and real
    ``torch.Tensor`` of one element, 0-dim or not, as torch.optim takes them (read once,
    here); a tensor of more elements is a ValueError. ``finite``: reject infinities too. A
    hyperparameter injected natively by ``inject_hyperparams`` is returned as is (it checks
    the values).
    """
    if getattr(value, "injected", False):
        return value
    if isinstance(value, torch.Tensor) and not value.is_complex() and value.dtype != torch.bool:
        if value.numel() != 1:
            raise ValueError(
                f"{where}: {name} as a tensor must have one element, got shape {tuple(value.shape)}"
            )
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
