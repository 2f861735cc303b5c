"""Autograd and the library: nothing is recorded unless asked.

By default, as with ``torch.optim`` (``differentiable=False``), an update records nothing for
autograd: gradients that require grad (a ``backward(create_graph=True)``) and parameters that
are ``nn.Parameter`` are read detached, so no state holds a graph, and ``apply_updates`` /
``step`` compute the new parameters under ``torch.no_grad()`` -- a parameter that required grad
gives a new *leaf* that requires grad, and no graph grows from step to step.

``with ft.differentiable():`` turns that off inside the block: updates, states and new
parameters are ordinary functions of their inputs for autograd and ``torch.func`` (meta-learning
through an optimizer step, learning a learning rate), as ``torch.optim``'s
``differentiable=True`` does. The library's fused ``ft.step`` kernels are not differentiable;
inside the block ``ft.step`` takes the general path.

Under a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``, ``jacrev``, ...) nothing
needs asking: the transform is the request, as ``jax.grad`` is (:func:`traced` is true, and so
is :func:`is_differentiable`). Every tensor is then a function of the transform's inputs: none
is detached, none is read as a Python number (a tensor hyper-parameter stays a tensor, so its
derivative is not cut and it may be batched), and the engine runs each primitive's per-leaf
definition in plain torch operations (no generated or native kernel, no ``torch._foreach_*``,
which have no batching rules). ``ft.differentiable()`` remains the one switch for plain autograd
(``torch.autograd.grad``, ``backward``), whose recording cannot be told from the default use
(``torch.optim``'s ``differentiable=False``) by looking at the tensors.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "differentiable",
    "is_differentiable",
    "traced",
    "differentiating",
    "not_differentiable",
    "detached",
]

_MODE = [False]


@contextlib.contextmanager
def differentiable(enabled: bool = True) -> Iterator[None]:
    """Within the block, updates and ``apply_updates`` / ``step`` are differentiable (see the
    module docstring). Nests; restores the previous mode on exit. Not thread-local."""
    prev = _MODE[0]
    _MODE[0] = bool(enabled)
    try:
        yield
    finally:
        _MODE[0] = prev


def is_differentiable() -> bool:
    """Whether the library records its computations for autograd: inside
    :func:`differentiable`, or under a ``torch.func`` transform (:func:`traced`)."""
    return _MODE[0] or traced()


def traced() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``, ...) is active:
    its tensors are wrappers (no storage, maybe batched) that must be computed on with plain
    torch operations and never read as Python numbers (see the module docstring). False while
    ``torch.compile`` traces (its graphs take the compiled paths)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.peek_interpreter_stack() is not None


def differentiating() -> bool:
    """Whether derivatives are being taken through the library's computations: a
    ``torch.func`` ``grad`` / ``vjp`` / ``jacrev`` / ``jvp`` / ``jacfwd`` transform is active
    (``vmap`` alone takes none), or :func:`differentiable` with autograd recording."""
    if _MODE[0] and torch.is_grad_enabled():
        return True
    if not traced():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    kinds = (TransformType.Grad, TransformType.Jvp)
    return any(i.key() in kinds for i in retrieve_all_functorch_interpreters())


def not_differentiable(where: str, what: str) -> None:
    """Raise where a computation with no useful derivative would be differentiated
    (:func:`differentiating`): ``where`` names the transform, ``what`` the computation.

    Raises:
        NotImplementedError: naming both (never a silent zero or a wrong derivative).
    """
    if differentiating():
        raise NotImplementedError(
            f"{where}: {what} is not differentiable, and torch.func (grad, vjp, jvp) or "
            f"ft.differentiable() is taking derivatives through it; differentiate a "
            f"transform without it (see the README's 'torch.func' section)"
        )


def host_value(x: torch.Tensor, what: str) -> float:
    """A CPU counter or flag the library reads on the host (``int()`` of a 0-dim CPU tensor:
    no device synchronisation), also under ``torch.func``: there the value under its wrappers,
    which must be the same for every batch element (``vmap(tx.init)`` broadcasts it so).

    Raises:
        ValueError: batch elements holding different values (naming ``what``): the host
            decision they drive cannot differ per element.
        TypeError: a differentiated value (its derivative would be cut).
    """
    if not traced() or not torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x.item()
    from . import _validate as V

    if V.is_traced(x, batched=False):
        raise TypeError(f"{what} is read on the host: it cannot be differentiated")
    values = set(V.base_values(x))
    if len(values) != 1:
        raise ValueError(
            f"{what} is read on the host, so under vmap every batch element must hold the same "
            f"value (a state from ft.vmap(tx.init) does), got {sorted(values)}"
        )
    return values.pop()


def host_values(xs, what: str) -> list:
    """:func:`host_value` of each of ``xs`` (one check of the transform stack for them all:
    a flag per leaf is read every step)."""
    if not traced():
        return [x.item() for x in xs]
    return [host_value(x, what) for x in xs]


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# (the leaf types whose __torch_function__ is torch's disabled one: DTensor dispatches below it)
_OWN_FUNCTIONS = frozenset(
    {torch.Tensor}
    | ({DTensor} if DTensor.__torch_function__ is torch._C._disabled_torch_function_impl else set())
)


def detached(leaves: list, *, dtensors: bool = True) -> list:
    """``leaves`` with every tensor that autograd tracks detached, unless differentiable.
    Under ``torch.no_grad()`` too: nothing would be recorded there, but a leaf that requires
    grad (an ``nn.Parameter``) is not a plain value, and the fused kernels take plain values
    only (a step under ``no_grad``, as ``torch.optim`` runs its own, would leave the fused
    path). Returns the same list when nothing needs it. ``dtensors=False``: DTensor leaves
    are left as they are (for a caller that reads their layouts and detaches their local
    shards itself: detaching a DTensor is a dispatch through DTensor's, about 5 us a leaf,
    and every parameter of an FSDP2 model requires grad)."""
    if _MODE[0] or traced():
        return leaves
    keep = not dtensors and not torch.compiler.is_compiling()  # (DTensors as they are)
    if keep and set(map(type, leaves)) <= _DTENSOR_OR_NONE:
        return leaves
    if _none_requires_grad(leaves):
        return leaves
    if not any([isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]):
        return leaves  # (a list, not a generator: dynamo resumes a generator per item)
    return [
        x.detach()
        if isinstance(x, torch.Tensor) and x.requires_grad and not (keep and type(x) is DTensor)
        else x
        for x in leaves
    ]


_DTENSOR_OR_NONE = frozenset({DTensor, type(None)})


def _none_requires_grad(leaves: Sequence[Any]) -> bool:
    """Eagerly, whether ``leaves`` are tensors none of which requires grad, by one C loop
    (this runs for every leaf of every step); ``False`` where that is not so or not known
    (a leaf that is not a tensor; under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return False
    # (tensors whose torch functions are torch's own, DTensor's included, are read without
    # asking each one's class for a __torch_function__: a DTensor's requires_grad took 0.15
    # to 0.2 us so, a plain tensor's 0.05)
    own = set(map(type, leaves)) <= _OWN_FUNCTIONS
    try:
        with torch._C.DisableTorchFunctionSubclass() if own else contextlib.nullcontext():
            return not any(map(_REQUIRES_GRAD, leaves))
    except AttributeError:  # (None leaves)
        return False


def requires_grads_like(news: Sequence[Any], olds: Sequence[Any]) -> list:
    """:func:`requires_grad_like` of every pair, as a list: ``news`` as they are where no
    element of ``olds`` requires grad (one C loop)."""
    if _none_requires_grad(olds):
        return list(news)
    return [requires_grad_like(n, o) for n, o in zip(news, olds)]


def requires_grad_like(new: Any, old: Any) -> Any:
    """``new`` marked as a leaf that requires grad when ``old`` did (outside
    :func:`differentiable`, new parameters are computed without a graph)."""
    if (
        isinstance(old, torch.Tensor)
        and old.requires_grad
        and not new.requires_grad
        and not traced()
    ):
        new.requires_grad_(True)
        from .engine.metadata import forget_verified  # (its metadata changed in place)

        forget_verified()
    return new
