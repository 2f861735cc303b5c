"""Learning-rate schedules: functions of the step count (optax semantics).

Each schedule maps ``count`` (the number of previous updates: 0 on the first one) to a value. It
accepts a Python int or a 0-dim integer tensor and uses tensor ops only (no host sync), so it runs
inside ``update`` and under ``torch.compile``; it returns a 0-dim float64 tensor.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import _validate as V

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
]

Schedule = Callable[[object], torch.Tensor]


def _count(count) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float64)


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    value = V.number("value", value, where="constant_schedule")

    def schedule(count):
        return torch.full_like(_count(count), value)

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps`` steps, starting at
    ``transition_begin``; constant outside. ``transition_steps=0`` gives ``init_value`` always.

    Raises:
        ValueError: negative ``transition_steps`` or ``transition_begin``.
    """
    where = "linear_schedule"
    init_value = V.number("init_value", init_value, where=where)
    end_value = V.number("end_value", end_value, where=where)
    transition_steps = V.integer("transition_steps", transition_steps, where=where, low=0)
    transition_begin = V.integer("transition_begin", transition_begin, where=where, low=0)

    def schedule(count):
        c = _count(count)
        if transition_steps == 0:
            return torch.full_like(c, init_value)
        frac = torch.clamp((c - transition_begin) / transition_steps, 0.0, 1.0)
        return init_value + frac * (end_value - init_value)

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """``init_value * ((1 - alpha) * (0.5 (1 + cos(pi t / decay_steps)))^exponent + alpha)`` for
    ``t = min(count, decay_steps)`` (optax ``cosine_decay_schedule``).

    Raises:
        ValueError: ``decay_steps < 1``.
    """
    where = "cosine_decay_schedule"
    init_value = V.number("init_value", init_value, where=where)
    decay_steps = V.integer("decay_steps", decay_steps, where=where, low=1)
    alpha = V.number("alpha", alpha, where=where)
    exponent = V.number("exponent", exponent, where=where)

    def schedule(count):
        c = torch.clamp(_count(count), 0.0, float(decay_steps))
        cosine = 0.5 * (1.0 + torch.cos(math.pi * c / decay_steps))
        return init_value * ((1.0 - alpha) * cosine.pow(exponent) + alpha)

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at ``decay_steps`` (total, warmup included), constant after (optax
    ``warmup_cosine_decay_schedule``).

    Raises:
        ValueError: ``warmup_steps < 0`` or ``decay_steps <= warmup_steps``.
    """
    where = "warmup_cosine_decay_schedule"
    init_value = V.number("init_value", init_value, where=where)
    peak_value = V.number("peak_value", peak_value, where=where)
    end_value = V.number("end_value", end_value, where=where)
    warmup_steps = V.integer("warmup_steps", warmup_steps, where=where, low=0)
    decay_steps = V.integer("decay_steps", decay_steps, where=where, low=1)
    if decay_steps <= warmup_steps:
        raise ValueError(f"{where}: decay_steps ({decay_steps}) must exceed warmup_steps "
                         f"({warmup_steps})")
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warm = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)

    def schedule(count):
        c = _count(count)
        if warmup_steps == 0:
            return decay(c)
        return torch.where(c < warmup_steps, warm(c), decay(c - warmup_steps))

    return schedule
