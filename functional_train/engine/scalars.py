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
vector of one value per leaf) and constants (numbers, bools, ``None``, dtypes, strings, plain
functions such as a schedule) and returns a tuple of tensors. Called eagerly, or under
``torch.compile`` with tensors that are not plain CPU tensors (CUDA: inductor's Triton kernels
need no probe) or with another argument (an injected hyperparameter's cell), or recorded for
autograd, it is the function itself. Under ``torch.compile`` with plain CPU tensors it is one
call of ``functional_train::scalars``, whose kernel runs the function on the real tensors, and
whose fake kernel on fake ones: the same operations, so the same bits as the eager step, and
nothing for inductor to build. A compiled step made only of the library's operators (every
row of ``benchmarks/bench_compose.py``: ``tests/test_fused.py -k leaves_inductor``) compiles
without a C++ build. Each call costs a trip down the dispatcher (about 10 us) besides the
function's own operations, which the eager step runs too.

The function and its constant arguments are a *program*, numbered when dynamo first traces
the call (the number is a constant of the graph); programs are kept for the process's life
(one per call site and set of constants, a schedule's function included).

Reference: ``torch.library.custom_op`` (torch's "custom operators" guide).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

from .operators import register_kernels
from .owners import assume_constant_result

__all__ = ["scalar_program"]

ENABLED = True  # (False: traced as they are, for inductor; read when dynamo traces)

_FUNCTIONS: list[Callable] = []  # (the decorated functions, by their number)
_PROGRAMS: list[tuple] = []  # (function number, its arguments' template), by program number
_NUMBERS: dict[tuple, int] = {}
_TENSOR = ("tensor",)  # (a template's mark for a tensor argument; a constant's: ("c", value))


@assume_constant_result
def _program(function: int, template: tuple) -> int:
    """The number of the program: the function ``function`` with the constant arguments of
    ``template`` (called by dynamo while it traces: a graph constant)."""
    key = (function, template)
    n = _NUMBERS.get(key)
    if n is None:
        n = _NUMBERS[key] = len(_PROGRAMS)
        _PROGRAMS.append(key)
    return n


def _run(program: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    function, template = _PROGRAMS[program]
    it = iter(xs)
    out = _FUNCTIONS[function](*[next(it) if len(c) == 1 else c[1] for c in template])
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
def _scalars_op(program: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A :func:`scalar_program`'s function (``program``: its number with its constant
    arguments) on its tensor arguments ``xs``."""
    return _run(program, xs)


@_scalars_op.register_fake
def _(program, xs):
    return _run(program, xs)


register_kernels(_scalars_op)


# (the arguments a program takes: tensors, and constants dynamo passes to _program by value;
# a plain function by identity, such as a schedule, but no other object, such as an
# injected hyperparameter's cell: the function is then traced as it is)
_ARGUMENTS = (torch.Tensor, int, float, str, type(None), torch.dtype, types.FunctionType)


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
    they were); its constant arguments hashable."""
    number = len(_FUNCTIONS)
    _FUNCTIONS.append(fn)

    @functools.wraps(fn)
    def call(*args):
        if not torch.compiler.is_compiling():
            return fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not _opaque(tensors) or not all(isinstance(a, _ARGUMENTS) for a in args):
            return fn(*args)
        template = tuple(_TENSOR if isinstance(a, torch.Tensor) else ("c", a) for a in args)
        return tuple(_scalars_op(_program(number, template), tensors))

    return call
