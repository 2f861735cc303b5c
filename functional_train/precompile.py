"""``ft.step`` compiled ahead of time and loaded by later processes: :func:`precompiled_step`.

``torch.compile(ft.step)`` traces the step's Python in every process (dynamo; seconds for a
model's tree) even when inductor's cache holds the kernels. torch's precompile
(``torch.compile(fn, fullgraph=True).aot_compile(example_inputs)``, then
``save_compiled_function`` / ``torch.compiler.load_compiled_function``) saves the traced
step itself, so a later process loads it without tracing. What it saves guards the inputs
(their structure, shapes, dtypes, devices) but not the transform: dynamo's guards on the
transform's closures are object identities, which a file cannot keep, and torch drops them.
A step loaded for a transform other than the one it was compiled for would run the old
hyper-parameters silently. :func:`precompiled_step` names each file by a fingerprint of the
transform (its ``cloudpickle`` bytes: its functions' code and every closure value,
hyper-parameters and schedules included), ``donate``, this library's sources and torch's
version, and the inputs' signature, so a file is loaded only for the step it holds.
"""

from __future__ import annotations

import builtins
import hashlib
import itertools
import os
import pathlib
import types
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import aliasing
from .base import GradientTransformation
from .engine.metadata import MEMOS
from .step import step as _step_function
from .tree import tree_paths

__all__ = ["precompiled_step", "PrecompiledStep"]


def _body(grads, state, params):  # traced with the globals of one PrecompiledStep
    return _ft_step(_tx, grads, state, params, mesh=None, donate=_donate)  # type: ignore[name-defined]  # noqa: F821


_SOURCES: list[str] = []


def _sources_digest() -> str:
    """A digest of this library's sources (a step compiled by other code is not loaded)."""
    if not _SOURCES:
        root = pathlib.Path(__file__).parent
        h = hashlib.sha256()
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".c") and path.is_file():
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _SOURCES.append(h.hexdigest())
    return _SOURCES[0]


def _signature(tree: Any) -> str:
    """The structure of ``tree`` and each tensor leaf's type, shape, stride, dtype, device and
    ``requires_grad`` (what the saved step's guards check), as text."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    parts = [repr(treedef)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(
                f"{type(x).__name__}{tuple(x.shape)}{x.stride()}{x.dtype}{x.device}"
                f"{x.requires_grad}"
            )
        else:
            parts.append(repr(x))
    return "\n".join(parts)


def _fingerprint_bytes(obj: Any) -> bytes:
    """``obj``'s ``cloudpickle`` bytes, the same in every process and whatever ``obj`` has
    been used for: a set's elements in order of their ``repr`` (a set of strings iterates in
    an order of the process's hash seed), a plain tensor as its dtype, shape, device and
    bytes (torch pickles its storage's address), and what a transform remembers between
    calls (:data:`~.engine.metadata.MEMOS`: answers that follow from the transform and its
    inputs, such as the labels a ``partition`` resolved for a params tree) as its type
    alone."""
    import io

    import cloudpickle

    class Fingerprinter(cloudpickle.Pickler):
        def persistent_id(self, x):  # (called for every object, sets included)
            if isinstance(x, MEMOS):
                return ("memo", type(x).__name__)
            if type(x) in (set, frozenset):
                return (type(x).__name__, tuple(sorted(x, key=repr)))
            if type(x) in (torch.Tensor, torch.nn.Parameter):
                data = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                return ("tensor", str(x.dtype), tuple(x.shape), str(x.device), bytes(data.numpy()))
            return None

    buf = io.BytesIO()
    Fingerprinter(buf).dump(obj)
    return buf.getvalue()


class PrecompiledStep:
    """``(grads, state, params) -> (params, state)``: ``ft.step(tx, grads, state, params,
    donate=donate)``, compiled ahead of time; see :func:`precompiled_step`.

    Attributes:
        compiled: how many steps this object compiled (then saved).
        loaded: how many it loaded from ``cache_dir``.
    """

    def __init__(self, tx: GradientTransformation, cache_dir: str | os.PathLike, donate: bool):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"precompiled_step: tx must be a GradientTransformation, got {type(tx).__name__}"
            )
        self._tx = tx
        self.cache_dir = pathlib.Path(cache_dir)
        self.donate = bool(donate)
        self._key = self._fingerprint()  # (refused here, before any step, where it cannot
        # be taken; what the transform remembers later is not in it)
        self._globals = {
            "__name__": __name__,
            "__builtins__": builtins,
            "_ft_step": _step_function,
            "_tx": tx,
            "_donate": self.donate,
        }
        self._fn = _function_with_globals(_body, self._globals)
        self._steps: list = []
        self.compiled = 0
        self.loaded = 0

    def _fingerprint(self) -> str:
        try:
            tx_bytes = _fingerprint_bytes(self._tx)
        except Exception as e:  # (what cloudpickle raises for an object it cannot pickle)
            raise ValueError(
                "precompiled_step: the transform cannot be fingerprinted (cloudpickle could "
                f"not pickle it: {type(e).__name__}: {e}); compile the step with "
                "torch.compile(ft.step) instead"
            ) from e
        key = hashlib.sha256()
        for part in (torch.__version__, _sources_digest(), repr(self.donate)):
            key.update(part.encode())
            key.update(b"\0")
        key.update(tx_bytes)
        return key.hexdigest()

    def path_for(self, grads, state, params) -> pathlib.Path:
        """The files' name for these inputs (without the variant's ``-N.pt2``: a step
        whose guards fail on other values, as galore_adamw's at its projector refreshes, is
        saved again as the next variant)."""
        sig = hashlib.sha256(_signature((grads, state, params)).encode()).hexdigest()
        return self.cache_dir / f"ft-step-{self._key[:24]}-{sig[:16]}"

    def __call__(self, grads, state, params):
        args = (grads, state, params)
        if self.donate:
            # (eagerly, as ft.step's donated step does: the compiled step cannot read the
            # records, so a tensor an eager pure step handed back as it was, still held by
            # the caller's older trees, is copied here before the step writes it; nothing
            # to do while no record is alive)
            args = aliasing.claimed(args, torch.Tensor.clone)
        for fn in self._steps:
            if fn.guard_check(*args):
                return fn(*args)
        fn = self._load_or_compile(*args)
        self._steps.append(fn)
        return fn(*args)

    def _load_or_compile(self, grads, state, params):
        args = (grads, state, params)
        for name, tree in zip(("grads", "state", "params"), args):
            for path, x in zip(tree_paths(tree), optree.tree_leaves(tree, none_is_leaf=True)):
                if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
                    raise ValueError(
                        f"precompiled_step: {name} leaf {path} is a {type(x).__name__}; the "
                        "precompiled step takes plain tensors (compile a DTensor step with "
                        "torch.compile(ft.step); pass a Parameter's .detach())"
                    )
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    raise ValueError(
                        f"precompiled_step: {name} leaf {path} requires grad; the precompiled "
                        "step takes tensors that do not (pass .detach())"
                    )
        # (a step's guards may hold on values, not only on the signature: galore_adamw's
        # projector refresh. Each variant is a file of its own: -0, -1, ...)
        base = self.path_for(*args)
        for n in itertools.count():
            path = base.with_name(f"{base.name}-{n}.pt2")
            if not path.exists():
                break
            try:
                with open(path, "rb") as fh:
                    fn = torch.compiler.load_compiled_function(fh, f_globals=self._globals)
            except Exception as e:  # (a file torch cannot load back: compiled again below)
                warnings.warn(
                    f"precompiled_step: {path} could not be loaded ({type(e).__name__}: {e}); "
                    "compiling the step again",
                    stacklevel=3,
                )
                break
            if fn.guard_check(*args):
                fn.disable_guard_check()  # (checked in __call__, once per call)
                self.loaded += 1
                return fn
        fn = _aot_compile(self._fn, args)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fn.save_compiled_function(str(path))
        fn.disable_guard_check()
        self.compiled += 1
        return fn


def _aot_compile(fn: Callable, args: tuple):
    """``torch.compile(fn, fullgraph=True).aot_compile``, restarted where dynamo asks for it:
    ``torch.compile`` restarts its analysis when a float it made an input must be a constant
    (``TensorifyScalarRestartAnalysis``, having recorded which), ``aot_compile`` raises it."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    for _ in range(7):
        try:
            return torch.compile(fn, fullgraph=True).aot_compile((args, {}))
        except TensorifyScalarRestartAnalysis:
            pass
    return torch.compile(fn, fullgraph=True).aot_compile((args, {}))  # (the last: it raises)


def _function_with_globals(fn: Callable, globals_: dict) -> Callable:
    """``fn`` with ``globals_``, its code a copy of its own, named for this step object:
    dynamo keeps what it learnt of a code's inputs across compiles (its automatic dynamic
    state, by file, line and name), and one step's (adafactor's) made a later transform's
    compile of the same code fail in inductor (``ToFloat(False)``)."""
    code = fn.__code__.replace(co_name=f"precompiled_step_{next(_STEP_CODES)}")
    return types.FunctionType(code, globals_, "precompiled_step", fn.__defaults__)


_STEP_CODES = itertools.count()


def precompiled_step(
    tx: GradientTransformation, cache_dir: str | os.PathLike, *, donate: bool = False
) -> PrecompiledStep:
    """``ft.step(tx, grads, state, params, donate=donate)`` compiled ahead of time by torch's
    precompile and kept in ``cache_dir``, for a later process to load instead of tracing
    the step again (``torch.compile(ft.step)`` traces it in every process: seconds for a
    model's tree, with inductor's cache warm).

    The returned callable takes ``(grads, state, params)`` and returns ``(params, state)``,
    as ``ft.step``. Its first call for inputs of a new signature (tree structure, shapes,
    strides, dtypes, devices) loads the step from ``cache_dir`` where a file for this
    transform and signature is there, and otherwise compiles it with
    ``torch.compile(fullgraph=True).aot_compile`` (inductor; as long as
    ``torch.compile(ft.step)``'s first call) and saves it there. Later calls check the
    saved step's guards and run it. Hyper-parameters computed in the step (schedules,
    ``inject_hyperparams``' state) change without compiling again. Donated, a call first
    copies the tensors an eager pure ``ft.step`` handed back as they were (recorded as
    shared, see ``ft.step``), as the eager donated step does, so that donating such a result
    cannot write into the trees the caller still holds (``torch.compile(ft.step)`` cannot:
    its graph does not read the records).

    The file's name holds a fingerprint of everything the saved step was compiled from and
    its guards do not check: ``tx`` (its ``cloudpickle`` bytes, sets in a fixed order and
    tensors by value: the code of its functions and their closures' values, so a different
    learning rate, schedule or chain is another file), ``donate``, this library's sources
    and torch's version. A function a transform calls by reference (a module-level function
    of an installed package other than this library) is fingerprinted by its name only:
    after changing such code, clear ``cache_dir``. The compiled step names the library's
    elementwise parts by the numbers a process gives them as it builds transforms; those
    numbers are in the fingerprint, so a process loads the file when it builds its
    transforms in the same order as the one that saved it (the same training script), and
    compiles again otherwise. What a transform remembers between calls (the labels a mask
    or ``partition`` resolved per params tree, the flags it made from them) is not in the
    fingerprint: the file is found whatever the transform was used for before (``init``
    called again, eager steps).

    Args:
        tx: the transform.
        cache_dir: a directory (created on the first save).
        donate: as ``ft.step``'s ``donate``.

    Returns:
        A :class:`PrecompiledStep`; its ``compiled`` and ``loaded`` count the steps it
        compiled and loaded.

    Raises:
        TypeError: ``tx`` is not a :class:`GradientTransformation`.
        ValueError: ``tx`` cannot be pickled by ``cloudpickle`` (then it cannot be
            fingerprinted: use ``torch.compile(ft.step)``); at a call, a leaf that is a
            tensor subclass (DTensor, ``nn.Parameter``) or requires grad (named by its path).

    Plain tensors that do not require grad, in one process (no ``mesh``): a DTensor step
    holds process groups, which torch's precompile does not serialise, and dynamo cannot
    return a tensor that requires grad from a precompiled graph. Reference: torch's
    ``aot_compile`` precompile API (``torch._dynamo.aot_compile``, experimental in torch
    2.13).
    """
    return PrecompiledStep(tx, cache_dir, donate)
