"""What a pure function may hand back without a copy, and what a donated step must copy.

Two records, both by object identity and weak (an entry is dropped after its tensor is gone;
a dict by ``id`` because a tensor's ``==`` is elementwise):

* **shared** tensors: a pure ``ft.step`` or ``apply_updates`` returns a leaf it leaves as it
  was (a ``None`` gradient's parameter and its state, a ``multi_steps`` micro-step's
  parameters and inner state) as it is, as optax returns an unchanged array, and records its
  local shard here. The caller's older trees hold it too, so a donated ``ft.step`` copies a
  shared tensor before writing into it (:func:`claimed`): one copy, the first time it is
  donated. No work while no shared tensor is alive, and while none is in the donated trees
  a walk of their containers that looks their tensors up (no flatten).
* **known zeros**: the zero updates of a ``multi_steps`` micro-step that is not the cycle's
  last are ``torch.zeros((), dtype).expand(shape)`` (no memory; writing into one raises, as
  for any expanded tensor), recorded here, and ``apply_updates`` leaves a parameter whose
  update is a known zero as it is (shared) instead of adding zeros to it: a non-final
  micro-step then costs its accumulation only, as ``loss.backward()`` into ``.grad`` does.

Eagerly only: under ``torch.compile`` and ``torch.func`` transforms nothing is recorded (a pure
step copies what it would share; zero updates are real zeros).
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .autograd import traced
from .engine.dtensor import to_local, to_locals
from .engine.metadata import Memo
from .leaves import DEVICE, DTYPE, SHAPE
from .tree import tensors_into, tree_flatten, tree_unflatten

__all__ = [
    "mark_shared",
    "mark_shared_locals",
    "forget_shared",
    "claimed",
    "known_zeros",
    "is_known_zero",
    "known_zero_flags",
    "known_zeros_of",
    "recording",
]

# id(local shard) -> a weak reference to it. An entry is valid while its reference gives the
# tensor of that id back; the references' one callback counts the tensors gone (``_GONE``), and
# :func:`_sweep` drops their entries when the dict has grown past ``_SWEEP_AT`` and, where some
# are gone, before a donated step reads it. (Made and read by whole-list C loops: a pure
# ``multi_steps`` micro-step hands back ~1,000 leaves of a 244-leaf tree as they were, ~730 of
# them new tensors each cycle, the last micro-step's results; a reference with a callback of
# its own each, made one at a time, cost about 0.9 us a tensor, 6% of such a cycle's host time.)
# Threads: the writers (marks, drops, sweeps) hold ``_WRITING``; a reader (a donated step's
# :func:`claimed`) takes no lock and never misses a live record: a sweep binds a new dict
# rather than emptying this one and filling it again.
_SHARED: dict = {}
_WRITING = threading.RLock()  # (reentrant: a collection inside a sweep may run anything)
_SWEEP_AT = [4096]
_GONE = [0]
_CALL = weakref.ref.__call__  # (a reference's object, or None: C calls in a map)
_NONES = itertools.repeat(None)


class _Absent:
    """What an unrecorded tensor's lookup gives back: never a leaf."""


_ABSENT = _Absent()
_NO_ENTRY = weakref.ref(_ABSENT)


def _gone(ref: weakref.ref) -> None:
    _GONE[0] += 1


def _sweep() -> None:
    """Drop the entries whose tensor is gone (the caller holds ``_WRITING``): a new dict of
    the others, bound in one step (a reader holding the old one still finds every record)."""
    global _SHARED
    _GONE[0] = 0
    if _SHARED:
        keys, refs = list(_SHARED), list(_SHARED.values())  # (in one order: no other writer)
        alive = list(map(operator.is_not, map(_CALL, refs), _NONES))
        if not all(alive):
            _SHARED = dict(zip(itertools.compress(keys, alive), itertools.compress(refs, alive)))
    _SWEEP_AT[0] = 2 * len(_SHARED) + 4096


def _recorded(locals_: Sequence[Any]) -> list:
    """Per element of ``locals_`` (local shards, plain tensors, ``None``), whether it is a
    recorded tensor: its entry's reference gives it back (whole-list C loops)."""
    refs = map(_SHARED.get, map(id, locals_), itertools.repeat(_NO_ENTRY))
    return list(map(operator.is_, map(_CALL, refs), locals_))


def recording() -> bool:
    """Whether the records apply: eagerly, outside ``torch.compile`` and ``torch.func``."""
    return not torch.compiler.is_compiling() and not traced()


def mark_shared(x: torch.Tensor) -> None:
    """Record ``x``'s local shard as held by the caller's trees too."""
    mark_shared_locals([to_local(x)])


def mark_shared_locals(locals_: list) -> None:
    """:func:`mark_shared` of tensors that are local shards already (or plain tensors), in
    one pass: a lookup each, an entry for those not recorded yet (a ``multi_steps`` cycle
    marks the same ones again) that have elements (an empty tensor is never written).
    Whole-list C loops."""
    with _WRITING:
        new = list(itertools.compress(locals_, map(operator.not_, _recorded(locals_))))
        if new and set(map(type, new)) == {torch.Tensor}:
            new = list(itertools.compress(new, map(torch.Tensor.numel, new)))
        if new:
            _SHARED.update(zip(map(id, new), map(weakref.ref, new, itertools.repeat(_gone))))
            if len(_SHARED) > _SWEEP_AT[0]:
                _sweep()


def forget_shared(locals_: tuple | list) -> None:
    """Drop the records of ``locals_`` (plain tensors or local shards) that nothing outside
    the library holds any more, before the library writes them again (reused buffers: a
    record would have a donated step copy them for nothing)."""
    if _SHARED:
        with _WRITING:
            for key in map(id, locals_):
                _SHARED.pop(key, None)


def is_shared(x: torch.Tensor) -> bool:
    return _recorded([to_local(x)])[0]


def claimed(trees: tuple, copy) -> tuple:
    """``trees`` (a donated step's grads, state and params) with every shared tensor replaced by
    ``copy(tensor)`` (a copy in its layout, which the step may then write)."""
    # (the mode first: under torch.compile dynamo would guard on the records' keys, and a
    # record made or dropped by an eager step would recompile the compiled one)
    if not recording() or not _SHARED:
        return trees
    if _GONE[0]:  # (records of tensors gone: after pure steps whose results were dropped)
        with _WRITING:
            _sweep()
        if not _SHARED:
            return trees
    # (first whether any record is of these trees at all, by their tensors' ids: no flatten,
    # which sorts every dict's keys; the records of another system's trees, a pure step's
    # stepped beside this one, made the flatten below cost a donated `multi_steps` micro-step
    # more than the rest of its host time)
    if not _may_hold_record(trees):
        return trees
    out = []
    for tree in trees:
        leaves, treedef = tree_flatten(tree)
        hits = list(itertools.compress(range(len(leaves)), _recorded(to_locals(leaves))))
        for k in hits:
            leaves[k] = copy(leaves[k])
        out.append(tree_unflatten(treedef, leaves) if hits else tree)
    return tuple(out)


def _may_hold_record(trees: tuple) -> bool:
    """Whether some tensor of ``trees`` may be recorded: its local shard's ``id`` is a key of
    the records (``False`` is certain; ``True`` may be a tensor gone whose ``id`` a new one
    took, which :func:`_recorded` tells apart). The tensors are collected without a flatten
    (:func:`~functional_train.tree.tensors_into`)."""
    tensors: list = []
    for tree in trees:
        tensors_into(tree, tensors)
    return not _SHARED.keys().isdisjoint(map(id, to_locals(tensors)))


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
        if len(_EXPANDED) >= _MAX_EXPANDED:  # (a zero made before is then a plain zero tensor)
            _EXPANDED.clear()
            _ZEROS.clear()
            _ZEROS_BY_METADATA.clear()
        z = _EXPANDED[key] = zero.expand(like.shape)
        _ZEROS[id(z)] = z
    return z


def known_zeros_of(likes: Sequence[Any]) -> list:
    """:func:`known_zeros` of each of ``likes`` (their own dtypes): one lookup by whole-list
    C loops where they are plain tensors whose zeros were made before (a ``multi_steps``
    micro-step asks for the same ones every time)."""
    if recording():
        hits = _ZEROS_BY_METADATA.get(None, (likes,))
        if hits is not None:
            return list(hits)
        if set(map(type, likes)) == {torch.Tensor}:
            keys = zip(map(SHAPE, likes), map(DTYPE, likes), map(DEVICE, likes))
            hits = list(map(_EXPANDED.get, keys))
            if not any(map(operator.is_, hits, itertools.repeat(None))):
                _ZEROS_BY_METADATA.put(None, (likes,), hits)
                return list(hits)
    return [known_zeros(x) for x in likes]


# (the known zeros of lists with these exact metadata, see .engine.metadata; cleared with
# _EXPANDED, so that every zero it gives is a known one)
_ZEROS_BY_METADATA = Memo()


_ZERO: dict = {}  # (dtype, device) -> the 0-dim zero the known zeros expand
_EXPANDED: dict = {}  # (shape, dtype, device) -> a known zero (no memory of its own)
_ZEROS: dict = {}  # id -> the known zero of that id (those of _EXPANDED, cleared with it)
_MAX_EXPANDED = 4096


def is_known_zero(x: Any) -> bool:
    """Whether ``x`` is a tensor :func:`known_zeros` made."""
    return _ZEROS.get(id(x)) is x


def known_zero_flags(xs: Sequence[Any]) -> list:
    """:func:`is_known_zero` of each element of ``xs`` (whole-list C loops)."""
    return list(map(operator.is_, map(_ZEROS.get, map(id, xs)), xs))
