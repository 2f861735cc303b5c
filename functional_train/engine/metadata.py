"""Facts about lists of plain tensors, remembered by the tensors' exact metadata.

Every eager step asks the same questions of the same kind of lists: are the gradients plain
tensors of the plan's shapes, dtypes and devices; are a stage's inputs contiguous, of one dtype
per list, on one device, without autograd; are the accumulators the gradients' shapes. Asked
by reading each tensor's attributes from Python, that costs about 50 to 100 ns a tensor and
attribute, several attributes a list, several lists a stage: a large share of a small step's
host time (the time a CUDA step waits on Python, and a CPU step on tiny leaves).

torch answers the same question for its compiled graphs: dynamo guards a graph's tensor inputs
with ``torch._C._dynamo.guards.TensorGuards``, which checks, in one C++ call, that each tensor
of a list has the Python type, dispatch keys (autograd, conjugate and negative bits, the
thread's include and exclude sets), dtype, device, ``requires_grad``, sizes and strides of the
tensor it was made from (about 60 ns a tensor). :class:`Memo` keeps, per question, the guards
of the lists it was answered for and the answer: a later list that passes them has exactly the
metadata of one that was asked, so the answer -- a function of that metadata -- is the same.
A miss (another layout, a tensor that is not plain, a ``None``, ``torch.inference_mode``, a
``torch.func`` wrapper) costs a failed check, which stops at the first tensor that differs,
and the caller answers as before.

Eager only: under ``torch.compile`` the callers do not ask (dynamo does not trace the C++
call, and guards its inputs itself). Where this torch has no ``TensorGuards`` of the form used
here (checked once at import), :data:`ENABLED` is false and nothing is remembered.

A transform remembers answers of its own between calls too (the labels a ``partition``
resolved for a params tree, the flags it made from them last): it keeps them in a
:class:`MemoList` or a :class:`MemoDict`, so that what it remembers is told apart from what it
is. :data:`MEMOS` names the memo types, which ``precompiled_step``'s fingerprint of a
transform leaves out: a transform is the same transform before and after it has been used.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from ..autograd import traced

__all__ = [
    "Memo",
    "MemoDict",
    "MemoList",
    "MEMOS",
    "remembered",
    "ENABLED",
    "forget_verified",
    "guards_of",
    "verifying",
]


def _find_guards() -> Any:
    """``TensorGuards`` if it takes a list with its static sizes and strides and checks it as
    documented above (a private torch class: its form has changed between releases)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    try:
        a, b = torch.zeros(2, 3), torch.zeros(3, 2).t()
        g = _make(TensorGuards, [a, a])
        ok = (
            g.check(a, torch.ones(2, 3))
            and not g.check(a, b)  # (other strides)
            and not g.check(a, torch.zeros(2, 3, dtype=torch.float64))
            and not g.check(a, torch.zeros(2, 3, requires_grad=True))
            and not g.check(a, torch.nn.Parameter(torch.zeros(2, 3)))
            and not g.check(a, None)
        )
    except Exception:  # (another signature, or other semantics: not used)
        return None
    return TensorGuards if ok else None


def _make(cls: Any, xs: Sequence[torch.Tensor]) -> Any:
    return cls(
        *xs,
        dynamic_dims_sizes=[list(x.shape) for x in xs],
        dynamic_dims_strides=[list(x.stride()) for x in xs],
    )


_GUARDS = _find_guards()
_GUARDS_CLASS = _GUARDS  # (the class found, whatever tests put in _GUARDS)
ENABLED = _GUARDS is not None


# the tensor types whose metadata is all the guards' (a DTensor's placements are not, nor is
# another subclass's own state)
_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _guardable(xs: Sequence[Any]) -> bool:
    # (a tensor twice: the guards never pass then, dynamo's inputs being distinct)
    return bool(xs) and set(map(type, xs)) <= _TYPES and len(set(map(id, xs))) == len(xs)


def guards_of(xs: Sequence[Any]) -> Any:
    """The guards of the list ``xs`` (every element a ``torch.Tensor`` or an
    ``nn.Parameter``), or ``None``: anything else, a list holding one tensor twice (which
    the guards reject), or :data:`ENABLED` false."""
    if _GUARDS is None or not _guardable(xs):
        return None
    return _make(_GUARDS, xs)


# Guards shared by the memos: a list's guards are those of an earlier list of the same
# metadata where one is remembered (the latest first, a few per length), so that the memos a
# step consults for its gradients, accumulators and parameters (often all of one metadata)
# hold one guards object for them, which :func:`verifying` checks once a list a step.
_CANONICAL: dict[int, list] = {}
_CANONICAL_PER_LENGTH = 8
_CANONICAL_LENGTHS = 64  # (then the oldest length's go: the memos keep their own)


def _canonical(xs: Sequence[torch.Tensor]) -> Any:
    found = _CANONICAL.get(len(xs))
    if found is None:
        if len(_CANONICAL) >= _CANONICAL_LENGTHS:
            del _CANONICAL[next(iter(_CANONICAL))]
        found = _CANONICAL[len(xs)] = []
    for g in found:
        if g.check(*xs):
            return g
    g = _make(_GUARDS, xs)
    found.insert(0, g)
    del found[_CANONICAL_PER_LENGTH:]
    return g


# (within verifying(): per guards object, (the guards, the lists of tensors they passed))
_VERIFIED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "functional_train_verified", default=None
)


def _passes(g: Any, xs: Sequence[Any], verified: dict) -> bool:
    """``g.check(*xs)``, remembered for the step: a list of the very tensors a check passed
    for earlier in it passes (their identity compared, a C loop, about a third of a check;
    the tensors held, so that no other tensor takes their ids)."""
    held = verified.get(id(g))
    if held is not None:
        for seen in held[1]:
            if len(seen) == len(xs) and all(map(operator.is_, seen, xs)):
                return True
    if not g.check(*xs):
        return False
    if held is None:
        held = verified[id(g)] = (g, [])
    held[1].append(tuple(xs))
    return True


@contextlib.contextmanager
def dict_scope(var: contextvars.ContextVar) -> Iterator[None]:
    """A scope in which ``var`` holds a dict of its own, where it holds none already (nested
    scopes share the outer one's); nothing under ``torch.compile`` (``var`` stays ``None``:
    a traced step remembers nothing between its operations)."""
    if torch.compiler.is_compiling() or var.get() is not None:
        yield
        return
    token = var.set({})
    try:
        yield
    finally:
        var.reset(token)


def verifying() -> contextlib.AbstractContextManager:
    """A scope (one eager ``ft.step``) within which a list of tensors that passed a memo's
    guards passes them again without a check while it holds the same tensor objects: no
    tensor's metadata changes in place within a step (the one place the library changes
    one, :func:`~functional_train.autograd.requires_grad_like`, calls
    :func:`forget_verified`). Checks under ``torch.func`` transforms and
    ``torch.inference_mode`` (other dispatch keys) are not remembered. Nothing under
    ``torch.compile``; nested scopes share the outer one (:func:`dict_scope`)."""
    return dict_scope(_VERIFIED)


def forget_verified() -> None:
    """Forget what the current :func:`verifying` scope has checked (a tensor's metadata
    changed in place)."""
    verified = _VERIFIED.get()
    if verified is not None:
        verified.clear()


class Memo:
    """Answers remembered by the exact metadata of the lists of plain tensors they were given
    for (see the module's docstring), under a key of the caller's (which only narrows the
    candidates: an answer is given for lists that pass its guards, whatever the key).

    ``get(key, lists)`` gives the answer remembered for lists with exactly the metadata of
    ``lists`` (a sequence of lists of tensors), else ``None``; ``put(key, lists, answer)``
    remembers ``answer`` (not ``None``) where every list is of plain tensors (or
    ``nn.Parameter`` ones). At most
    ``per_key`` answers a key (the latest first) and ``keys`` keys (the oldest go). A key's
    list of answers is replaced whole, never changed in place: a thread reading it while
    another puts or reorders meets one list or the other."""

    __slots__ = ("entries", "per_key", "keys")

    def __init__(self, per_key: int = 4, keys: int = 256):
        self.entries: dict = {}
        self.per_key = per_key
        self.keys = keys

    def get(self, key: Hashable, lists: Sequence[Sequence[Any]]) -> Any:
        # (the mode first: under torch.compile dynamo would guard on the entries)
        if torch.compiler.is_compiling() or _GUARDS is None:
            return None
        found = self.entries.get(key)
        if not found:
            return None
        lens = tuple(map(len, lists))
        verified = _VERIFIED.get()
        if verified is not None and (traced() or torch.is_inference_mode_enabled()):
            verified = None  # (other dispatch keys than the step's: checked)
        for entry in found:
            n, guards, answer = entry
            if n == lens and all(
                g.check(*xs) if verified is None else _passes(g, xs, verified)
                for g, xs in zip(guards, lists)
            ):
                if entry is not found[0]:  # (the latest first: a new list, bound whole, as
                    # another thread may be reading this one)
                    self.entries[key] = [entry, *(e for e in found if e is not entry)]
                return answer
        return None

    def put(self, key: Hashable, lists: Sequence[Sequence[Any]], answer: Any) -> None:
        # (not under inference_mode: guards made with its dispatch keys fail outside it)
        if (
            torch.compiler.is_compiling()
            or answer is None
            or _GUARDS is None
            or traced()
            or torch.is_inference_mode_enabled()
        ):
            return
        if not all(map(_guardable, lists)):
            return
        guards = [_canonical(xs) for xs in lists]
        found = self.entries.get(key)
        if found is None and len(self.entries) >= self.keys:
            try:
                del self.entries[next(iter(self.entries))]
            except (KeyError, RuntimeError, StopIteration):  # (another thread's put evicted it)
                pass
        entry = (tuple(map(len, lists)), tuple(guards), answer)
        self.entries[key] = [entry, *(found or ())][: self.per_key]  # (a new list: see get)

    def clear(self) -> None:
        self.entries.clear()


class MemoList(list):
    """A list a transform keeps answers in between calls (see the module's docstring): what
    it holds follows from the transform and the inputs it was asked about. A list in every
    other way (pickled and copied with its contents)."""

    __slots__ = ()


class MemoDict(dict):
    """A dict a transform keeps answers in between calls; see :class:`MemoList`. Eager code
    only: dynamo guards the key order of a dict subclass it reads, and a precompiled step's
    loader cannot rebuild that guard where the dict is reached through a transform's spec
    (torch rebuilds functions without their ``__dict__``); answers read under
    ``torch.compile`` go in a plain dict of constant keys held in a :class:`MemoList`
    (``combine.PerLeaf``)."""

    __slots__ = ()


# (the types whose contents are what a transform remembers, not what it is)
MEMOS = (Memo, MemoList, MemoDict)


def remembered(last: MemoList, key: Any, make: Callable[[], Any]) -> Any:
    """The answer for ``key`` (by identity) that ``last`` (a ``MemoList`` of ``[key, answer]``)
    holds where ``key`` was the last asked about, else ``make()``'s, then held. Read with one
    unpacking and replaced with one slice assignment, each atomic: a thread stepping beside
    another never reads the other's answer for its own key."""
    held, answer = last
    if held is not key:
        answer = make()
        last[:] = key, answer
    return answer
