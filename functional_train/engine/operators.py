"""Kernels registered over ``torch.library.custom_op``'s own, for the library's operators
(``functional_train::fused_stage`` and ``fused_stage_donated``, and ``scalars``, see
:mod:`.scalars`): a stage operator is called once per stage of a compiled step with hundreds
of tensors in its list arguments (~600 for a 122-leaf stage), and every trip down the
dispatcher converts each of them to and from the dispatcher's boxed values; ``custom_op``'s
own kernels take two such trips more than these.

:func:`register_kernels` gives an operator

* a ``CompositeExplicitAutograd`` kernel that is its Python function itself, without the
  check ``custom_op`` wraps it in, that no result aliases an input or another result (a pass
  over every input and result, 0.1 to 0.2 ms per call of a 122-leaf stage: the operators
  make their results fresh themselves);
* for an operator that mutates an argument, an ``ADInplaceOrView`` kernel that bumps the
  version counters of the argument's tensors in one call for the list (autograd's record of
  an in-place write, which ``custom_op``'s own kernel makes with one Python call per tensor:
  ~0.3 ms per call of a 122-leaf stage);
* an ``Autograd`` kernel that goes straight to the function where nothing asks for autograd
  and the backend's is the only kernel below (:func:`backend_only`), and elsewhere hands the
  call to ``custom_op``'s own (its ``autograd.Function``).

Reference: the dispatcher's keys and ``torch.library.Library.impl(..., with_keyset=True)``
(torch's "extending PyTorch with custom operators" guide).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["backend_only", "register_kernels"]

# (the keysets, by their raw bits, of calls whose kernel below autograd is the backend's:
# plain CPU or CUDA tensors, nothing between)
_BACKEND_ONLY: dict = {}
_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def backend_only(keyset) -> bool:
    """Whether the only kernel below autograd a call with ``keyset`` meets is the backend's
    (CPU or CUDA): no fake, functional or Python-mode tensors, no conjugate or negative bits
    (those keys lie between: the call goes down the dispatcher there)."""
    raw = keyset.raw_repr()
    hit = _BACKEND_ONLY.get(raw)
    if hit is None:
        below = keyset & torch._C._after_ADInplaceOrView_keyset
        hit = _BACKEND_ONLY[raw] = below.highestPriorityTypeId() in _BACKENDS
    return hit


def _straight_through(op, mutated: tuple) -> Callable | None:
    """The ``Autograd`` kernel of the module's docstring for ``op`` (a
    ``torch.library.custom_op``), bumping the version counters of the tensors of the
    arguments at the positions ``mutated`` where it calls the function itself. ``None``
    where this torch does not expose custom_op's own kernel."""
    try:  # (custom_op's own kernel for the key, made as custom_op makes it: private)
        from torch._library.autograd import make_autograd_impl

        original = make_autograd_impl(op._opoverload, op)
    except Exception:
        return None
    any_requires_grad = torch._C._any_requires_grad
    increment_version = torch._C._increment_version

    def kernel(keyset, *args):
        if (torch.is_grad_enabled() and any_requires_grad(*args)) or not backend_only(keyset):
            return original(keyset, *args)
        for i in mutated:
            increment_version(args[i])
        with torch._C._AutoDispatchBelowAutograd():
            return op._init_fn(*args)

    return kernel


def _bump_versions_once(op, mutated: tuple) -> Callable:
    """The ``ADInplaceOrView`` kernel of the module's docstring for ``op``."""
    increment_version = torch._C._increment_version

    def kernel(keyset, *args):
        for i in mutated:
            increment_version(args[i])
        return op._opoverload.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)

    return kernel


_LIBS: dict = {}  # (a Library unregisters its kernels when it is collected)


def register_kernels(op, mutated: tuple = ()) -> None:
    """Register the kernels of the module's docstring for ``op``, a ``torch.library.custom_op``
    (``mutated``: the positions of the arguments it writes in place, lists of tensors). On a
    torch without the keysets they need (before 2.5), its ``ADInplaceOrView`` and
    ``Autograd`` kernels stay ``custom_op``'s."""
    namespace, name = op._qualname.split("::")
    lib = _LIBS.get(namespace)
    if lib is None:
        lib = _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")

    def impl(key, fn, **kw):
        # torch before 2.12 refuses a second Python kernel for a key (it has no
        # ``allow_override``); the dispatcher itself takes it, with a warning
        getattr(torch.library, "_impls", set()).discard(f"{namespace}/{name}/{key}")
        lib.impl(name, fn, key, **kw)

    keysets = hasattr(torch._C, "_after_ADInplaceOrView_keyset")
    with warnings.catch_warnings():  # (it replaces custom_op's kernels for those keys: intended)
        warnings.simplefilter("ignore")
        if mutated and keysets:
            impl("ADInplaceOrView", _bump_versions_once(op, mutated), with_keyset=True)
        impl("CompositeExplicitAutograd", op._init_fn)
        kernel = _straight_through(op, mutated) if keysets else None
        if kernel is not None:
            impl("Autograd", kernel, with_keyset=True)
