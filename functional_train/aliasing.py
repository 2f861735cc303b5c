"""What a pure function may hand back without a copy, and what a donated step must copy.

Two records, both by object identity and weak (an entry goes when its tensor does; a dict by
``id`` because a tensor's ``==`` is elementwise):

* **shared** tensors: a pure ``ft.step`` or ``apply_updates`` returns a leaf it leaves as it
  was (a ``None`` gradient's parameter and its state, a ``multi_steps`` micro-step's
  parameters and inner state) as it is, as optax returns an unchanged array, and records its
  local shard here. The caller's older trees hold it too, so a donated ``ft.step`` copies a
  shared tensor before writing into it (:func:`claimed`): one copy, the first time it is
  donated. No work while no shared tensor is alive.
* **known zeros**: the zero updates of a ``multi_steps`` micro-step that is not the cycle's
  last are ``torch.zeros((), dtype).expand(shape)`` (no memory; writing into one raises, as
  for any expanded tensor), recorded here, and ``apply_updates`` leaves a parameter whose
  update is a known zero as it is (shared) instead of adding zeros to it: a non-final
  micro-step then costs its accumulation only, as ``loss.backward()`` into ``.grad`` does.

Eagerly only: under ``torch.compile`` and ``torch.func`` transforms nothing is recorded (a pure
step copies what it would share; zero updates are real zeros).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from .autograd import traced
from .engine.dtensor import to_local
from .tree import tree_flatten, tree_unflatten

__all__ = [
    "mark_shared",
    "mark_shared_locals",
    "forget_shared",
    "claimed",
    "known_zeros",
    "is_known_zero",
    "recording",
]

# id(local shard) -> a weak reference to it, removed when the tensor goes (a plain dict of
# weakrefs rather than a WeakValueDictionary: read by whole-list C loops, ~1,000 leaves a
# pure multi_steps micro-step)
_SHARED: dict = {}


def _forget(ref: weakref.ref, key: int) -> None:
    if _SHARED.get(key) is ref:
        del _SHARED[key]


def _record(local: torch.Tensor) -> None:
    key = id(local)
    _SHARED[key] = weakref.ref(local, functools.partial(_forget, key=key))


def _shared(local: Any) -> bool:
    ref = _SHARED.get(id(local))
    return ref is not None and ref() is local


_ZEROS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def recording() -> bool:
    """Whether the records apply: eagerly, outside ``torch.compile`` and ``torch.func``."""
    return not torch.compiler.is_compiling() and not traced()


def mark_shared(x: torch.Tensor) -> None:
    """Record ``x``'s local shard as held by the caller's trees too."""
    mark_shared_locals([to_local(x)])


def mark_shared_locals(locals_: list) -> None:
    """:func:`mark_shared` of tensors that are local shards already (or plain tensors), in
    one pass: a lookup each, an entry for those not recorded yet (a ``multi_steps`` cycle
    marks the same ones again)."""
    refs = list(map(_SHARED.get, map(id, locals_)))  # (C loops; most are recorded already)
    for local, ref in zip(locals_, refs):
        if ref is None or ref() is not local:
            _record(local)


def forget_shared(locals_: tuple | list) -> None:
    """Drop the records of ``locals_`` (plain tensors or local shards) that nothing outside
    the library holds any more, before the library writes them again (reused buffers: a
    record would have a donated step copy them for nothing)."""
    if _SHARED:
        for key in map(id, locals_):
            _SHARED.pop(key, None)


def is_shared(x: torch.Tensor) -> bool:
    local = to_local(x)
    return _shared(local)


def claimed(trees: tuple, copy) -> tuple:
    """``trees`` (a donated step's grads, state and params) with every shared tensor replaced by
    ``copy(tensor)`` (a copy in its layout, which the step may then write)."""
    if not _SHARED or not recording():
        return trees
    out = []
    for tree in trees:
        leaves, treedef = tree_flatten(tree)
        hits = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and is_shared(x)]
        for k in hits:
            leaves[k] = copy(leaves[k])
        out.append(tree_unflatten(treedef, leaves) if hits else tree)
    return tuple(out)


def known_zeros(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeros of ``like``'s shape (and device; ``dtype``: default ``like``'s) for a plain tensor
    ``like``: eagerly an expanded 0-dim zero, recorded (one per shape, dtype and device, kept
    for the next call: a ``multi_steps`` cycle asks for the same ones at every micro-step);
    otherwise ``torch.zeros_like``."""
    dtype = like.dtype if dtype is None else dtype
    if not recording() or type(like) is not torch.Tensor:
        return torch.zeros_like(like, dtype=dtype)
    key = (like.shape, dtype, like.device)
    z = _EXPANDED.get(key)
    if z is None:
        zero = _ZERO.get(key[1:])
        if zero is None:
            zero = _ZERO[key[1:]] = torch.zeros((), dtype=dtype, device=like.device)
        if len(_EXPANDED) >= _MAX_EXPANDED:
            _EXPANDED.clear()
        z = _EXPANDED[key] = zero.expand(like.shape)
        _ZEROS[id(z)] = z
    return z


_ZERO: dict = {}  # (dtype, device) -> the 0-dim zero the known zeros expand
_EXPANDED: dict = {}  # (shape, dtype, device) -> a known zero (no memory of its own)
_MAX_EXPANDED = 4096


def is_known_zero(x: Any) -> bool:
    """Whether ``x`` is a tensor :func:`known_zeros` made."""
    return _ZEROS.get(id(x)) is x
