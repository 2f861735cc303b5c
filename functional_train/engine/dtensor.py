"""DTensor views and specs: the one place that touches DTensor's private construction API.

Arithmetic runs on local shards (``DTensor._local_tensor``); results are rewrapped in the layout
of the leaf they belong to. Eagerly a DTensor is built straight from a cached ``DTensorSpec``
(about 4 us, against about 50 us for ``DTensor.from_local``); under ``torch.compile`` the public
``DTensor.from_local`` is used, which dynamo traces.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, overload

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "DTENSOR_OR_NONE",
    "TENSOR_OR_NONE",
    "Spec",
    "spec_of",
    "to_local",
    "to_locals",
    "wrap",
    "wrap_like",
    "wraps_like",
    "cache_clear",
]


@dataclasses.dataclass(frozen=True)
class Spec:
    """How a DTensor leaf is spread: its mesh, placements, global shape and global stride."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple
    # not an init field: dataclasses.replace(spec, placements=...) starts with an empty cache
    _dtensor_specs: dict = dataclasses.field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def dtensor_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The (cached) ``DTensorSpec`` of a DTensor of this layout and ``dtype``."""
        hit = self._dtensor_specs.get(dtype)
        if hit is None:
            hit = DTensorSpec(
                self.mesh, self.placements, tensor_meta=TensorMeta(self.shape, self.stride, dtype)
            )
            self._dtensor_specs[dtype] = hit
        return hit


# DTensor.__new__ builds the DTensor (a C function); DTensor.__init__ only calls the base
# class's no-op __init__, through an export hook and a dynamo guard costing ~3 us per leaf.
# Eagerly the DTensors are made by __new__ alone (checked below to give what DTensor() gives).
_NEW = DTensor.__new__


def _make(local: torch.Tensor, dspec: DTensorSpec) -> DTensor:
    return _NEW(DTensor, local, dspec, requires_grad=False)


# id(DTensorSpec) -> (DTensorSpec, Spec). Bounded: meshes made
# and dropped (simulated process groups re-initialised in one process) must not pile up.
_SPECS: dict = {}
_MAX_SPECS = 4096


def cache_clear() -> None:
    """Forget every cached spec (``functional_train.testing.simulate`` calls this when it
    re-initialises the simulated process group)."""
    _SPECS.clear()


@overload
def spec_of(x: DTensor) -> Spec: ...


@overload
def spec_of(x: Any) -> Spec | None: ...


def spec_of(x: Any) -> Spec | None:
    """The :class:`Spec` of a DTensor (cached per layout: the same object for every DTensor of
    one layout, so its ``DTensorSpec`` cache hits), ``None`` for a plain tensor or ``None``."""
    if not isinstance(x, DTensor):
        return None
    if torch.compiler.is_compiling():
        return Spec(x.device_mesh, tuple(x.placements), x.shape, tuple(x.stride()))
    ds = x._spec
    # keyed by the DTensorSpec object (the entry holds it alive, so its id is not reused): the
    # DTensors this library makes share their spec objects, and hashing a DTensorSpec costs
    # more than the lookup; equal specs on equal-looking but different meshes stay apart
    hit = _SPECS.get(id(ds))
    if hit is not None and hit[0] is ds:
        return hit[1]
    if len(_SPECS) >= _MAX_SPECS:
        _SPECS.clear()
    meta = ds.tensor_meta
    assert meta is not None, "a DTensor's spec carries its tensor meta"
    spec = Spec(ds.mesh, tuple(ds.placements), meta.shape, tuple(meta.stride))
    spec._dtensor_specs[meta.dtype] = ds
    _SPECS[id(ds)] = (ds, spec)
    return spec


def to_local(x: Any) -> Any:
    """The local shard of a DTensor (no copy, no autograd edge); plain tensors and ``None`` are
    returned as is."""
    if isinstance(x, DTensor):
        if torch.compiler.is_compiling():
            return x.to_local()
        return x._local_tensor
    return x


# the element types of a list of plain tensors (or DTensors) where some leaves are absent (a
# restricted part's state: None outside its leaves), for whole-list checks by type sets
TENSOR_OR_NONE = frozenset({torch.Tensor, type(None)})
DTENSOR_OR_NONE = frozenset({DTensor, type(None)})
_LOCAL = operator.attrgetter("_local_tensor")
_ONLY_DTENSOR = {DTensor}


def to_locals(xs) -> list:
    """:func:`to_local` of every element of ``xs`` (one compile check for the whole list)."""
    if torch.compiler.is_compiling():
        return [x.to_local() if isinstance(x, DTensor) else x for x in xs]
    kinds = set(map(type, xs))
    if kinds <= TENSOR_OR_NONE:  # (plain tensors: whole-list C loops)
        return list(xs)
    if kinds == _ONLY_DTENSOR:  # (every leaf a DTensor: one C loop)
        return list(map(_LOCAL, xs))
    if kinds == DTENSOR_OR_NONE:  # (a restricted part's state: half the time of getattr's)
        return [None if x is None else x._local_tensor for x in xs]
    # (DTensors among other leaves: a DTensor's own attribute, else the leaf; one C loop)
    return list(map(getattr, xs, itertools.repeat("_local_tensor"), xs))


def wrap(local: Any, spec: Spec | None) -> Any:
    """Rewrap a local shard in ``spec`` (no communication, no check); identity for ``spec=None``.

    Eagerly this builds the DTensor directly from the spec's cached ``DTensorSpec``; under
    ``torch.compile`` it uses ``DTensor.from_local``.
    """
    if spec is None or local is None:
        return local
    if torch.compiler.is_compiling():
        return DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
    return _make(local, spec.dtensor_spec(local.dtype))


def wrap_like(local: Any, like: Any) -> Any:
    """Rewrap a local shard in the layout of ``like`` (a DTensor; plain tensors and ``None``
    give ``local`` back). Reuses ``like``'s own spec when the dtypes agree."""
    if not isinstance(like, DTensor) or local is None:
        return local
    if not torch.compiler.is_compiling() and local.dtype == like.dtype:
        return _make(local, like._spec)
    return wrap(local, spec_of(like))


def wraps_like(locals_, likes) -> list:
    """:func:`wrap_like` of every pair (one compile check for the whole list). Eagerly a
    DTensor whose own local shard is the new local (a donated step wrote into it, or left it
    as it was) is given back as it is: the same object, spec and shard, no new DTensor."""
    if torch.compiler.is_compiling():  # (plain leaves without a call: dynamo traces each)
        return [
            wrap_like(x, like) if isinstance(like, DTensor) else x
            for x, like in zip(locals_, likes)
        ]
    kinds = set(map(type, likes))
    if kinds <= TENSOR_OR_NONE:  # (plain tensors: whole-list C loops)
        return list(locals_)
    if kinds == _ONLY_DTENSOR and all(map(operator.is_, locals_, map(_LOCAL, likes))):
        return list(likes)  # (every shard the DTensor's own: C loops)
    return [
        x
        if x is None or not isinstance(like, DTensor)
        else (
            like
            if x is like._local_tensor
            else (_make(x, like._spec) if x.dtype == like.dtype else wrap(x, spec_of(like)))
        )
        for x, like in zip(locals_, likes)
    ]
