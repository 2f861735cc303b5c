"""Learning-rate schedules: functions of the step count (optax semantics).

Each schedule maps ``count`` (the number of previous updates: 0 on the first one) to a value. It
accepts a Python int or a 0-dim integer tensor and uses tensor ops only (no host sync), so it runs
inside ``update`` and under ``torch.compile``; it returns a 0-dim float64 tensor (a tensor of
counts gives a tensor of values of its shape).

Names, arguments, defaults and values follow optax 0.2 (``optax.schedules``), computed in float64
(optax computes in float32 unless ``jax_enable_x64``). Where optax logs and falls back (a
negative ``transition_steps`` or ``transition_begin``), these raise ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from . import _validate as V

__all__ = [
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "exponential_decay",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "linear_onecycle_schedule",
    "cosine_onecycle_schedule",
    "sgdr_schedule",
]

Schedule = Callable[[object], torch.Tensor]


def _count(count) -> torch.Tensor:
    if isinstance(count, torch.Tensor) and count.dtype == torch.float64:
        return count  # (a schedule calling another: converted once)
    return torch.as_tensor(count).to(torch.float64)


def _value(x, like: torch.Tensor) -> torch.Tensor:
    """A schedule's output as a float64 tensor on ``like``'s device (a user's schedule may return
    a Python number)."""
    return torch.as_tensor(x, dtype=torch.float64, device=like.device)


def _scales(boundaries_and_scales, where: str) -> tuple:
    """``(boundaries, scales)`` sorted by boundary: int boundaries >= 0, real scales >= 0."""
    if boundaries_and_scales is None:
        return (), ()
    if not isinstance(boundaries_and_scales, dict):
        raise TypeError(
            f"{where}: boundaries_and_scales must be a dict {{step: scale}}, got "
            f"{type(boundaries_and_scales).__name__}"
        )
    items = sorted(
        (
            V.integer("boundary", b, where=where, low=0),
            V.number(f"the scale at step {b}", v, where=where, low=0.0),
        )
        for b, v in boundaries_and_scales.items()
    )
    return tuple(b for b, _ in items), tuple(v for _, v in items)


def _transition_args(
    where: str, init_value, end_value, transition_steps, transition_begin
) -> tuple:
    """The linear and polynomial schedules' shared arguments, checked."""
    return (
        V.number("init_value", init_value, where=where),
        V.number("end_value", end_value, where=where),
        V.integer("transition_steps", transition_steps, where=where, low=0),
        V.integer("transition_begin", transition_begin, where=where, low=0),
    )


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    value = V.number("value", value, where="constant_schedule")

    def schedule(count):
        return torch.full_like(_count(count), value)

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Linear from ``init_value`` to ``end_value`` over ``transition_steps`` steps, starting at
    ``transition_begin``; constant outside. ``transition_steps=0`` gives ``init_value`` always.

    Raises:
        ValueError: negative ``transition_steps`` or ``transition_begin``.
    """
    init_value, end_value, transition_steps, transition_begin = _transition_args(
        "linear_schedule", init_value, end_value, transition_steps, transition_begin
    )

    def schedule(count):
        c = _count(count)
        if transition_steps == 0:
            return torch.full_like(c, init_value)
        frac = torch.clamp((c - transition_begin) / transition_steps, 0.0, 1.0)
        return init_value + frac * (end_value - init_value)

    return schedule


def polynomial_schedule(
    init_value: float,
    end_value: float,
    power: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """``(init_value - end_value) * (1 - t / transition_steps)^power + end_value`` with
    ``t = clip(count - transition_begin, 0, transition_steps)`` (optax ``polynomial_schedule``):
    ``init_value`` before ``transition_begin``, ``end_value`` from ``transition_begin +
    transition_steps`` on. ``transition_steps=0`` gives ``init_value`` always.

    Raises:
        ValueError: negative ``transition_steps`` or ``transition_begin``.
    """
    where = "polynomial_schedule"
    init_value, end_value, transition_steps, transition_begin = _transition_args(
        where, init_value, end_value, transition_steps, transition_begin
    )
    power = V.number("power", power, where=where)

    def schedule(count):
        c = _count(count)
        if transition_steps == 0:
            return torch.full_like(c, init_value)
        t = torch.clamp(c - transition_begin, 0.0, float(transition_steps))
        frac = 1.0 - t / transition_steps
        return (init_value - end_value) * frac.pow(power) + end_value

    return schedule


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: dict | None = None
) -> Schedule:
    """``init_value`` times the product of the scales of every boundary ``<= count``
    (optax ``piecewise_constant_schedule``): ``{100: 0.1, 200: 0.1}`` divides by 10 at step 100
    and again at step 200.

    Raises:
        ValueError: a negative boundary or scale. TypeError: a boundary that is not an int.
    """
    where = "piecewise_constant_schedule"
    init_value = V.number("init_value", init_value, where=where)
    boundaries, scales = _scales(boundaries_and_scales, where)

    def schedule(count):
        c = _count(count)
        v = torch.full_like(c, init_value)
        for b, sc in zip(boundaries, scales):
            v = torch.where(c < b, v, v * sc)
        return v

    return schedule


def _linear_interpolate(start, end, pct):
    return (end - start) * pct + start


def _cosine_interpolate(start, end, pct):
    return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1.0)


def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: float, boundaries_and_scales: dict | None = None
) -> Schedule:
    """Values ``v_0 = init_value``, ``v_k = v_{k-1} * scale_k`` at the sorted boundaries
    ``b_k`` (``b_0 = 0``), interpolated linearly or by half a cosine between consecutive
    boundaries (over ``max(b_k - b_{k-1}, 1)`` steps), the last value from the last boundary on
    (optax ``piecewise_interpolate_schedule``).

    Raises:
        ValueError: ``interpolate_type`` not ``"linear"`` or ``"cosine"``; a negative boundary
            or scale.
    """
    where = "piecewise_interpolate_schedule"
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError(
            f"{where}: interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}"
        )
    interpolate = _linear_interpolate if interpolate_type == "linear" else _cosine_interpolate
    init_value = V.number("init_value", init_value, where=where)
    boundaries, scales = _scales(boundaries_and_scales, where)
    bounds = (0,) + boundaries
    values = [init_value]
    for sc in scales:
        values.append(values[-1] * sc)

    def schedule(count):
        c = _count(count)
        out = torch.where(c >= bounds[-1], torch.full_like(c, values[-1]), torch.zeros_like(c))
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            pct = (c - lo) / max(hi - lo, 1)
            inside = (c >= lo) & (c < hi)
            out = out + torch.where(inside, interpolate(values[k], values[k + 1], pct), 0.0)
        return out

    return schedule


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate^((count - transition_begin) / transition_steps)`` from
    ``transition_begin`` on, ``init_value`` before (optax ``exponential_decay``); the exponent
    floored with ``staircase``; bounded by ``end_value`` (below when ``decay_rate < 1``, above
    otherwise). ``transition_steps=0`` or ``decay_rate=0`` give ``init_value`` always (as optax).

    Raises:
        ValueError: negative ``transition_steps``, ``transition_begin`` or ``decay_rate``.
    """
    where = "exponential_decay"
    init_value = V.number("init_value", init_value, where=where)
    transition_steps = V.integer("transition_steps", transition_steps, where=where, low=0)
    decay_rate = V.number("decay_rate", decay_rate, where=where, low=0.0)
    transition_begin = V.integer("transition_begin", transition_begin, where=where, low=0)
    if not isinstance(staircase, bool):
        raise TypeError(f"{where}: staircase must be a bool, got {type(staircase).__name__}")
    if end_value is not None:
        end_value = V.number("end_value", end_value, where=where)

    def schedule(count):
        c = _count(count)
        if transition_steps == 0 or decay_rate == 0.0:
            return torch.full_like(c, init_value)
        d = c - transition_begin
        p = d / transition_steps
        if staircase:
            p = torch.floor(p)
        v = torch.where(d <= 0, init_value, init_value * torch.pow(decay_rate, p))
        if end_value is not None:
            v = v.clamp_min(end_value) if decay_rate < 1.0 else v.clamp_max(end_value)
        return v

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
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
        if exponent != 1.0:  # (x ** 1 is x: the same bits without the operator)
            cosine = cosine.pow(exponent)
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
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
        raise ValueError(
            f"{where}: decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})"
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warm = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)

    def schedule(count):
        c = _count(count)
        if warmup_steps == 0:
            return decay(c)
        return torch.where(c < warmup_steps, warm(c), decay(c - warmup_steps))

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[0]`` until ``boundaries[0]``, then ``schedules[k](count - boundaries[k-1])``
    from ``boundaries[k-1]`` on (optax ``join_schedules``): each schedule counts from its own
    start. Any callable of the count may be joined (its result is taken as float64).

    Raises:
        ValueError: no schedule, or not one boundary fewer than schedules.
        TypeError: a schedule that is not callable, a boundary that is not an int.
    """
    where = "join_schedules"
    schedules = list(schedules)
    boundaries = [V.integer("boundary", b, where=where, low=0) for b in boundaries]
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"{where}: needs one boundary fewer than schedules, got "
            f"{len(schedules)} schedules and {len(boundaries)} boundaries"
        )
    for k, f in enumerate(schedules):
        if not callable(f):
            raise TypeError(f"{where}: schedules[{k}] must be callable, got {type(f).__name__}")

    def schedule(count):
        raw = torch.as_tensor(count)
        c = raw.to(torch.float64)
        out = _value(schedules[0](count), c)
        for b, f in zip(boundaries, schedules[1:]):
            out = torch.where(c < b, out, _value(f(raw - b), c))
        return out

    return schedule


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Linear from ``init_value`` to ``peak_value`` over ``warmup_steps``, then ``peak_value``
    (optax ``warmup_constant_schedule``).

    Raises:
        ValueError: negative ``warmup_steps``.
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_exponential_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    :func:`exponential_decay` of ``peak_value`` counted from the end of the warmup (optax
    ``warmup_exponential_decay_schedule``).

    Raises:
        ValueError: as :func:`linear_schedule` and :func:`exponential_decay`.
    """
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            exponential_decay(
                peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value
            ),
        ],
        [V.integer("warmup_steps", warmup_steps, where="warmup_exponential_decay_schedule", low=0)],
    )


def _onecycle_args(
    where: str, transition_steps, peak_value, pct_start, div_factor, final_div_factor
) -> tuple:
    """The one-cycle schedules' shared arguments, checked."""
    return (
        V.integer("transition_steps", transition_steps, where=where, low=1),
        V.number("peak_value", peak_value, where=where),
        V.number("pct_start", pct_start, where=where, low=0.0, high=1.0),
        V.number("div_factor", div_factor, where=where, low=0.0, low_open=True),
        V.number("final_div_factor", final_div_factor, where=where, low=0.0, low_open=True),
    )


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle schedule (Smith & Topin 2017), linear pieces (optax
    ``linear_onecycle_schedule``): from ``peak_value / div_factor`` up to ``peak_value`` at step
    ``int(pct_start * transition_steps)``, down to ``peak_value / div_factor`` at
    ``int(pct_final * transition_steps)``, then to ``peak_value / (div_factor *
    final_div_factor)`` at ``transition_steps``, constant after.

    Raises:
        ValueError: ``transition_steps < 1``; non-positive factors.
    """
    where = "linear_onecycle_schedule"
    T, peak_value, pct_start, div_factor, final_div_factor = _onecycle_args(
        where, transition_steps, peak_value, pct_start, div_factor, final_div_factor
    )
    pct_final = V.number("pct_final", pct_final, where=where, low=0.0, high=1.0)
    return piecewise_interpolate_schedule(
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * T): div_factor,
            int(pct_final * T): 1.0 / div_factor,
            T: 1.0 / final_div_factor,
        },
    )


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """The one-cycle schedule with half-cosine pieces (optax ``cosine_onecycle_schedule``, torch
    ``OneCycleLR``'s shape): from ``peak_value / div_factor`` up to ``peak_value`` at step
    ``int(pct_start * transition_steps)``, then down to ``peak_value / (div_factor *
    final_div_factor)`` at ``transition_steps``, constant after.

    Raises:
        ValueError: ``transition_steps < 1``; non-positive factors.
    """
    T, peak_value, pct_start, div_factor, final_div_factor = _onecycle_args(
        "cosine_onecycle_schedule",
        transition_steps,
        peak_value,
        pct_start,
        div_factor,
        final_div_factor,
    )
    return piecewise_interpolate_schedule(
        "cosine",
        peak_value / div_factor,
        {int(pct_start * T): div_factor, T: 1.0 / (div_factor * final_div_factor)},
    )


def sgdr_schedule(cosine_kwargs: Iterable[dict]) -> Schedule:
    """Stochastic gradient descent with warm restarts (Loshchilov & Hutter 2017; optax
    ``sgdr_schedule``): one :func:`warmup_cosine_decay_schedule` per dict of its keyword
    arguments, each run for its ``decay_steps``, one after the other.

    Raises:
        ValueError: no cycle; as :func:`warmup_cosine_decay_schedule`.
        TypeError: a cycle that is not a dict.
    """
    schedules, boundaries, step = [], [], 0
    for k, kwargs in enumerate(cosine_kwargs):
        if not isinstance(kwargs, dict):
            raise TypeError(
                f"sgdr_schedule: cosine_kwargs[{k}] must be a dict of "
                f"warmup_cosine_decay_schedule's arguments, got "
                f"{type(kwargs).__name__}"
            )
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    if not schedules:
        raise ValueError("sgdr_schedule: needs at least one cycle")
    return join_schedules(schedules, boundaries[:-1])
