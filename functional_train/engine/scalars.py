"""A step's scalar arithmetic as opaque operators under ``torch.compile``: :func:`scalar_program`.

Around its fused passes a step computes a few dozen 0-dim values: counters, bias corrections,
the global norm's root and the clip factor, ``multi_steps``' and ``apply_if_finite``'s flags.
Traced as they are, a compiled step on CPU tensors hands them to inductor, which generates C++
kernels for them; the first C++ kernel of a process makes inductor probe the CPU's vector
instruction sets (g++ builds of its test programs, about 6 s with an empty cache) and each
kernel is one more g++ build: about 8 of the ~20 s a compiled step's first call takes cold,
for arithmetic worth microseconds. (The passes themselves are already opaque operators, see
``functional_train::fused_stage``.)

A function decorated with :func:`scalar_program` takes tensors (small ones: 0-dim values or a
vector of one value per leaf) and constants (numbers, bools, ``None``, dtypes, strings) and
returns a tuple of tensors. Called eagerly, or under ``torch.compile`` with tensors that are
not plain CPU tensors (CUDA: inductor's Triton kernels need no probe) or with another
argument (an injected hyperparameter's cell), or recorded for autograd, it is the function
itself. Under ``torch.compile`` with plain CPU tensors it is one call of
``functional_train::scalars``, whose kernel runs the function on the real tensors, and whose
fake kernel on fake ones: the same operations, so the same bits as the eager step, and
nothing for inductor to build. A compiled step made only of the library's operators (every
row of ``benchmarks/bench_compose.py``: ``tests/test_fused.py -k leaves_inductor``) compiles
without a C++ build. Each call costs a trip down the dispatcher (about 10 us) besides the
function's own operations, which the eager step runs too.

The function and its constant arguments are a *program*, written as text when dynamo traces
the call (the function's qualified name and each constant, floats exactly): a constant of the
graph, which a process loading a precompiled step reads as the one that compiled it. A
function among the constants (a schedule) is passed as the number :func:`function_number`
gave it when its transform was built.

A program called while a part's prologue runs under a flag (:func:`gated`: ``multi_steps``'
compiled micro-steps, whose inner parts only matter on the cycle's last; ``apply_if_finite``'s
inner parts, only on a finite step) takes the flag as one more input; where its real call
finds the flag false, its results are discarded by the part's selects, and it returns zeros
of their shapes and dtypes (those of its first call, which runs the function) without running
the function: a compiled non-final micro-step skips its inner parts' arithmetic (Adam's bias
corrections, the clip factor, ...), as the eager one does.

Reference: ``torch.library.custom_op`` (torch's "custom operators" guide).
"""

from __future__ import annotations

import contextvars
import functools
import types
import weakref
from collections.abc import Callable

import torch

from .._validate import plain_cpu
from .operators import register_kernels
from .owners import assume_constant_result

__all__ = [
    "counted",
    "function_number",
    "function_of",
    "gated",
    "positions_index",
    "scalar_program",
    "schedule_numbers",
    "schedule_value",
    "sharing_schedules",
]

ENABLED = True  # (False: traced as they are, for inductor; read when dynamo traces)

_FUNCTIONS: dict[str, Callable] = {}  # (the decorated functions, by their qualified names)
_DECODED: dict[str, tuple] = {}  # (a program's text: its function's name, arguments' template)
_TENSOR = ("tensor",)  # (a template's mark for a tensor argument; a constant's: ("c", value))
_GATE = ("gate",)  # (a template's last mark where the program is gated: its flag, a tensor)
_MARKS = {_TENSOR: "T", _GATE: "G"}  # (their letters in a program's text, see _decode)
_MARKED = {letter: mark for mark, letter in _MARKS.items()}  # (_decode's: the same letters)
_FUNCTIONS_GIVEN: list = []  # (weak references to the functions given to function_number)


def function_number(fn: Callable) -> int:
    """A number for ``fn`` (a plain function, such as a schedule) that a program may take
    among its constants and turn back into ``fn`` with :func:`function_of`: given when a
    transform is built, so that a process building its transforms in the same order gives
    the same numbers (a precompiled step names them; :func:`~functional_train.precompiled_step`
    fingerprints the transform, the number in its closure included). Held weakly."""
    _FUNCTIONS_GIVEN.append(weakref.ref(fn))
    return len(_FUNCTIONS_GIVEN) - 1


def function_of(number: int) -> Callable:
    """The function :func:`function_number` gave ``number``.

    Raises:
        RuntimeError: it is gone (its transform was collected)."""
    fn = _FUNCTIONS_GIVEN[number]()
    if fn is None:
        raise RuntimeError(f"scalar program: function number {number} has been collected")
    return fn


def _encode(value) -> str:
    if value is None:
        return "N"
    if isinstance(value, bool):
        return "B1" if value else "B0"
    if isinstance(value, int):
        return f"I{value}"
    if isinstance(value, float):
        return "F" + value.hex()
    if isinstance(value, str):
        return "S" + value.encode().hex()
    if isinstance(value, torch.dtype):
        return "D" + str(value).removeprefix("torch.")
    raise TypeError(f"scalar program: a constant argument {value!r} has no encoding")


def _decode(text: str):
    kind, rest = text[0], text[1:]
    if kind in _MARKED:
        return _MARKED[kind]
    if kind == "N":
        return ("c", None)
    if kind == "B":
        return ("c", rest == "1")
    if kind == "I":
        return ("c", int(rest))
    if kind == "F":
        return ("c", float.fromhex(rest))
    if kind == "S":
        return ("c", bytes.fromhex(rest).decode())
    return ("c", getattr(torch, rest))  # (D: a dtype)


@assume_constant_result
def _program(name: str, template: tuple) -> str:
    """The program's text: the function's qualified name ``name`` and the constant arguments
    of ``template``, ``|``-separated (called by dynamo while it traces: a constant of the
    graph; in another process, which loads a precompiled step, the same text)."""
    return "|".join([name, *(_MARKS[c] if len(c) == 1 else _encode(c[1]) for c in template)])


# (a gated program's results' shapes and dtypes, per program text and its inputs' shapes and
# dtypes: what it returns where its flag is false; bounded)
_SHAPES: dict = {}


def _run(program: str, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    hit = _DECODED.get(program)
    if hit is None:
        name, *args = program.split("|")
        hit = _DECODED[program] = (name, tuple(map(_decode, args)))
    name, template = hit
    if template and template[-1] is _GATE:
        *xs, flag = xs
        template = template[:-1]
        # (a CPU tensor: read without a synchronisation)
        if not _faking() and not flag.item():
            key = (program, *((x.shape, x.dtype) for x in xs))
            shapes = _SHAPES.get(key)
            if shapes is not None:
                return [torch.zeros(shape, dtype=dtype, device=d) for shape, dtype, d in shapes]
            out = _call(name, template, xs)
            if len(_SHAPES) >= 1024:
                _SHAPES.clear()
            _SHAPES[key] = [(x.shape, x.dtype, x.device) for x in out]
            return out
    return _call(name, template, xs)


def _faking() -> bool:
    """Whether a fake tensor mode is on (the operator's fake kernel, or dynamo tracing)."""
    return (
        torch.compiler.is_compiling()
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    )


def _call(name: str, template: tuple, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The function ``name`` on the arguments ``template`` gives (``xs`` its tensors), its
    results fresh tensors."""
    it = iter(xs)
    out = _FUNCTIONS[name](*[next(it) if len(c) == 1 else c[1] for c in template])
    res = []
    seen: set = set()
    for x in out:
        # (an operator's results are fresh: none is an input, a view, or twice in the list)
        if x._base is not None or id(x) in seen or any(x is y for y in xs):
            x = x.clone()
        seen.add(id(x))
        res.append(x)
    return res


@torch.library.custom_op("functional_train::scalars", mutates_args=())
def _scalars_op(program: str, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A :func:`scalar_program`'s function on its tensor arguments ``xs`` (``program``: the
    function's name and its constant arguments, see :func:`_program`)."""
    return _run(program, xs)


@_scalars_op.register_fake
def _(program, xs):
    return _run(program, xs)


register_kernels(_scalars_op)


# (the arguments a program takes: tensors, and constants it can write as text; with another
# argument, such as an injected hyperparameter's cell, the function is traced as it is)
_ARGUMENTS = (torch.Tensor, int, float, str, type(None), torch.dtype)


def _opaque(tensors: list) -> bool:
    from ..autograd import is_differentiable

    if not ENABLED or not tensors or is_differentiable():
        return False
    return all(
        type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad for t in tensors
    )


def scalar_program(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """Decorate ``fn(*args) -> tuple of tensors`` (its arguments tensors or constants), the
    arithmetic of a step on small tensors, as the module's docstring says: called under
    ``torch.compile`` with plain CPU tensors, one ``functional_train::scalars`` operator.
    Its results must be new tensors or its inputs (the operator copies those it returns as
    they were). A compiled step names it by its qualified name: a module-level function,
    whose values come as arguments (not a closure's); a later function of the same name
    (a notebook cell run again) replaces it."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _FUNCTIONS[name] = fn

    @functools.wraps(fn)
    def call(*args):
        if not torch.compiler.is_compiling():
            return fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not _opaque(tensors) or not all(isinstance(a, _ARGUMENTS) for a in args):
            return fn(*args)
        template = tuple(_TENSOR if isinstance(a, torch.Tensor) else ("c", a) for a in args)
        flag = _FLAG
        if flag is not None and _opaque([flag]):
            template, tensors = (*template, _GATE), [*tensors, flag]
        return tuple(_scalars_op(_program(name, template), tensors))

    return call


# (while dynamo traces a prologue under a flag, :func:`gated`: the flag; dynamo tracks the
# stores as side effects, so that a compiled call leaves it None)
_FLAG: torch.Tensor | None = None


def gated(flag: torch.Tensor | None, fn: Callable, *args):
    """``fn(*args)``, the scalar programs it calls under ``torch.compile`` gated by ``flag``
    (a 0-dim bool tensor: their results are used only where it is true, as a guarded part's
    prologue's are; see the module's docstring; ``None``: not gated, inside a gated call
    too). Eagerly ``fn(*args)`` as it is."""
    global _FLAG
    if not torch.compiler.is_compiling():
        return fn(*args)
    outer = _FLAG
    _FLAG = flag
    try:
        return fn(*args)
    finally:
        _FLAG = outer


# (positions text, device) -> its index tensor, for the operator's real calls; bounded
_INDICES: dict = {}


def positions_index(positions: str, device: torch.device) -> torch.Tensor:
    """The comma-separated leaf positions ``positions`` (a program's constant) as an int64
    index tensor on ``device``, for a scalar program's function to read (an index: never
    written). Made once per text and device for the operator's real calls, which run every
    step (parsing and building it took about 0.1 ms a call at 121 positions); a new one
    under a fake tensor mode (the operator's fake kernel) or while dynamo traces."""
    if _faking():
        return _index(positions, device)
    key = (positions, device)
    hit = _INDICES.get(key)
    if hit is None:
        if len(_INDICES) >= 256:
            _INDICES.clear()
        hit = _INDICES[key] = _index(positions, device)
    return hit


def _index(positions: str, device: torch.device) -> torch.Tensor:
    # (no position: "", an empty index, a partition's group without leaves)
    ints = [int(i) for i in positions.split(",")] if positions else []
    return torch.tensor(ints, dtype=torch.long, device=device)


def schedule_value(schedule: Callable, count: torch.Tensor) -> torch.Tensor:
    """A schedule's value at the update count ``count`` (optax semantics: the first update
    reads ``schedule(0)``): ``schedule(count)`` as a float64 tensor (0-dim for a 0-dim count,
    on its device)."""
    return torch.as_tensor(schedule(count), dtype=torch.float64)


def schedule_numbers(schedules) -> tuple:
    """For each of ``schedules`` (callables), its :func:`function_number` where it is a plain
    function (a program can name it), else ``None``: taken when a transform is built, for
    :func:`counted`."""
    return tuple(
        function_number(f) if isinstance(f, types.FunctionType) else None for f in schedules
    )


def counted(count: torch.Tensor, schedules, numbers: tuple) -> tuple:
    """``(count + 1, *values)``: the next update count and each of ``schedules``' value at
    ``count`` (:func:`schedule_value`), ``numbers`` their :func:`schedule_numbers`. The plain
    functions' values and the count: one scalar program (under ``torch.compile``, one
    ``functional_train::scalars`` call); another callable (an injected hyperparameter's
    cell, a ``functools.partial``) is called as it is."""
    named = [n for n in numbers if n is not None]
    shared = _SHARED.get() if named and not torch.compiler.is_compiling() else None
    key = None if shared is None else _shared_key(count, named)
    hit = None if key is None else shared.get(key)
    if hit is not None:  # (a transform beside this one read these schedules at this count)
        (new,) = _counted(count)
        values = [v.clone() for v in hit]
    else:
        new, *values = _counted(count, *named)
        if key is not None:
            shared[key] = tuple(values)
    it = iter(values)
    return (
        new,
        *(
            next(it) if n is not None else schedule_value(f, count)
            for f, n in zip(schedules, numbers)
        ),
    )


# ((the count's value, the schedules), their values at it) while a combinator runs its
# transforms side by side (:func:`sharing_schedules`: a partition's param groups, each with
# inject_hyperparams of the same schedule, evaluate it once per step). Schedules are functions
# of the count (optax's contract), so the values are the same tensors' clones, bit for bit.
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "functional_train_shared_schedules", default=None
)


def sharing_schedules(fn: Callable) -> Callable:
    """``fn`` (a combinator's update, which runs its transforms side by side), during whose
    eager calls :func:`counted` evaluates each schedule once per count value: a second
    transform holding the same schedule function at the same (CPU) count gets a clone of the
    first one's value. Under ``torch.compile`` ``fn`` itself (the values are traced there)."""

    def shared(*args, **kwargs):
        token = _share()
        try:
            return fn(*args, **kwargs)
        finally:
            _unshare(token)

    return shared


# (module-level, so that a pickled transform, whose closures cloudpickle writes by value,
# names these functions rather than holding the context variable)
def _share():
    if torch.compiler.is_compiling() or _SHARED.get() is not None:
        return None
    return _SHARED.set({})


def _unshare(token) -> None:
    if token is not None:
        _SHARED.reset(token)


def _shared_key(count: torch.Tensor, named: list) -> tuple | None:
    """The key of :func:`counted`'s schedules ``named`` (numbers) at ``count`` among the shared
    values, or ``None`` where the count is not read: not a plain CPU int64 tensor (on a device,
    reading it would wait for the device), or one that ``torch.func`` transforms or autograd
    records (:func:`~functional_train._validate.plain_cpu`)."""
    if not plain_cpu(count, torch.int64):
        return None
    return (int(count), *(function_of(n) for n in named))


@scalar_program
def _counted(count: torch.Tensor, *numbers: int) -> tuple:
    """``(count + 1, *(schedule_value(function_of(n), count) for n in numbers))``."""
    return (count + 1, *(schedule_value(function_of(n), count) for n in numbers))
