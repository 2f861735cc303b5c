"""Operations on lists of leaves that the algorithms share (the transforms of
``transforms.py``, Adafactor, CAME, GaLore, Muon, the clip): foreach arithmetic whose scalar may
be a 0-dim tensor hyper-parameter, dtype casts, and complex leaves viewed as real pairs."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch

from . import foreach

__all__ = [
    "leafwise",
    "scalar_for",
    "lerp",
    "div",
    "cast_like",
    "as_real",
    "as_complex",
    "on_device",
    "copy_into",
    "CPU",
    "SHAPE",
    "DTYPE",
    "DEVICE",
]

#: Attribute getters for whole-list C loops over leaves (``list(map(SHAPE, xs))``): the
#: steps read their lists' metadata this way every step (about 50 ns a tensor per attribute,
#: where a Python loop costs several times that). Eagerly only: dynamo does not trace
#: ``attrgetter``.
SHAPE, DTYPE, DEVICE = (operator.attrgetter(a) for a in ("shape", "dtype", "device"))


def leafwise(fn: Callable) -> Callable:
    """``fn`` (a foreach helper on lists of leaves ``xs, ...``), returning ``[]`` and doing
    nothing for an empty ``xs``: torch's ``_foreach_*`` ops raise on an empty list, and a step
    where no leaf has a gradient (every gradient ``None``, a ``partition`` label that owns no
    leaf, a frozen group) hands the transforms one (torch.optim makes it a no-op)."""

    @functools.wraps(fn)
    def run(xs: list, *args, **kwargs):
        return fn(xs, *args, **kwargs) if len(xs) else []

    return run


def scalar_for(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor hyperparameter in leaf ``x``'s dtype, for the per-leaf ops the tensor
    path uses (traced, a float64 scalar tensor would promote the result; and torch 2.13's
    inductor bakes the value of a float64 CPU scalar tensor given to ``_foreach_lerp`` into
    the kernel at compile time, so it takes the per-leaf form)."""
    return v.to(x.dtype)


@leafwise
def lerp(xs: list, ys: list, weight) -> list:
    """Foreach ``lerp`` for a float ``weight`` or a 0-dim tensor one (leaf by leaf, in each
    leaf's dtype: only under ``torch.compile``, where the graph fuses them anyway)."""
    if not isinstance(weight, torch.Tensor):
        return foreach.lerp(xs, ys, weight)
    return [torch.lerp(x, y, scalar_for(weight, x)) for x, y in zip(xs, ys)]


@leafwise
def div(xs: list, value) -> list:
    """Foreach ``xs / value`` for a float or a 0-dim tensor ``value`` (in each leaf's dtype)."""
    if not isinstance(value, torch.Tensor):
        return foreach.div(xs, value)
    return [x / scalar_for(value, x) for x in xs]


def cast_like(xs: list, likes: list) -> list:
    """Each ``x`` in the dtype of its ``like`` (the same tensor where it already is)."""
    return [x if x.dtype == like.dtype else x.to(like.dtype) for x, like in zip(xs, likes)]


def as_real(ts: list) -> list:
    """Complex leaves as real pairs (``torch.view_as_real``), as ``torch.optim`` treats them."""
    return [torch.view_as_real(x) if x.is_complex() else x for x in ts]


def as_complex(ts: list, like: list) -> list:
    """Back to complex where ``like`` (the gradients) is complex."""
    return [
        torch.view_as_complex(x) if y.is_complex() and not x.is_complex() else x
        for x, y in zip(ts, like)
    ]


_IS_CPU, _IS_CUDA = (operator.attrgetter(a) for a in ("is_cpu", "is_cuda"))
CPU = torch.device("cpu")  # (for on_device: one object, not one per call)
_GET_DEVICE = torch.Tensor.get_device


def on_device(xs, device: torch.device) -> bool:
    """Whether every tensor of ``xs`` (plain tensors) lies on ``device``: by C loops over the
    list that make no ``torch.device`` objects (``is_cpu``; ``is_cuda`` and ``get_device``'s
    index), as the steps check their lists every step (a Python comparison of device objects
    per leaf cost about 0.4 us on a CUDA machine's host); other devices by their objects."""
    if device.type == "cpu":
        return all(map(_IS_CPU, xs))
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return all(map(_IS_CUDA, xs)) and set(map(_GET_DEVICE, xs)) <= {index}
    return all(x.device == device for x in xs)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, a 0-dim ``dst`` through a 1-element view of it. Torch 2.13 under
    ``torch.compile`` (aot_eager, inductor) loses a ``copy_`` or ``fill_`` into a 0-dim float64
    CPU graph input (dynamo tracks such an input's value as a number, which a restarted
    analysis then specializes), where a write through a view of it is kept: a compiled
    ``TorchOptimizer.step`` recorded a scheduled learning rate's first value only."""
    if dst.dim() == 0:
        dst.view(1).copy_(src.reshape(1))
    else:
        dst.copy_(src)
