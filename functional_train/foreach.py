"""``torch._foreach_*`` operations that also run under ``torch.func`` transforms.

torch's foreach operations (one call for a list of tensors) have no batching rules: under
``torch.func.vmap`` they raise "Batching rule not implemented for aten::_foreach_...". Each
function here is the foreach operation of the same name (``add`` is ``torch._foreach_add``,
``mul_`` is ``torch._foreach_mul_``, ``norm`` is ``torch._foreach_norm``), same arguments and
results; under a ``torch.func`` transform (:func:`functional_train.autograd.traced`) it runs the
per-tensor operation on each element of its list arguments instead (a list or tuple argument
is zipped; any other argument, a number or a 0-dim tensor, is given to every element), which
``vmap``, ``grad`` and ``jvp`` handle. In-place operations (``..._``) return ``None``, as torch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .autograd import traced

__all__ = [
    "abs",
    "add",
    "add_",
    "clamp_max",
    "clamp_min",
    "clamp_min_",
    "copy_",
    "div",
    "lerp",
    "mul",
    "mul_",
    "norm",
    "reciprocal",
    "rsqrt",
    "sqrt",
]


def _per_tensor(name: str) -> Callable:
    if name == "norm":

        def norm(x, ord=2, dtype=None):
            return torch.linalg.vector_norm(x, ord, dtype=dtype)

        return norm
    return getattr(torch.Tensor, name)


def _make(name: str) -> Callable:
    fused = getattr(torch, f"_foreach_{name}")
    one = _per_tensor(name)
    inplace = name.endswith("_")

    def op(*args, **kwargs):
        if not traced():
            return fused(*args, **kwargs)
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        cols = [a if isinstance(a, (list, tuple)) else [a] * n for a in args]
        out = [one(*leaf, **kwargs) for leaf in zip(*cols)]
        return None if inplace else out

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``torch._foreach_{name}``; leaf by leaf under a ``torch.func`` transform."
    return op


abs = _make("abs")  # noqa: A001  (torch's name)
add = _make("add")
add_ = _make("add_")
clamp_max = _make("clamp_max")
clamp_min = _make("clamp_min")
clamp_min_ = _make("clamp_min_")
copy_ = _make("copy_")
div = _make("div")
lerp = _make("lerp")
mul = _make("mul")
mul_ = _make("mul_")
norm = _make("norm")
reciprocal = _make("reciprocal")
rsqrt = _make("rsqrt")
sqrt = _make("sqrt")
