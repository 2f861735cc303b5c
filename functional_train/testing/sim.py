"""One-process SPMD simulation helpers (LocalTensorMode + the fake process group)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "simulate",
    "per_rank",
    "replicated",
    "local_tensor",
    "on_rank",
    "gather",
    "count_collectives",
]


def _forget_old_groups() -> None:
    """Drop torch's cached redistribution plans: they are keyed by mesh layout (equal meshes of
    a destroyed process group hit them) and hold meshes of that group, whose names no longer
    resolve (torch 2.13)."""
    try:
        from torch.distributed.tensor import _redistribute
    except ImportError:  # pragma: no cover
        return
    cache = getattr(_redistribute, "_planner_cache", None)
    if isinstance(cache, dict):
        cache.clear()
    infos = getattr(_redistribute, "_gen_transform_infos", None)  # @cache'd, holds meshes
    if hasattr(infos, "cache_clear"):
        infos.cache_clear()
    from ..engine import dtensor as _dt  # this library's layout caches
    from ..engine import plan as _plan

    _dt.cache_clear()
    _plan.cache_clear()
    try:  # the sharding propagation cache returns specs (with their meshes) by layout too
        from torch.distributed.tensor import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
        prop.propagate_op_sharding.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover
        pass


class _NoCoordinateCache(dict):
    """Stands in for ``LocalTensorMode._coordinate_cache``, which torch 2.13 keys by
    ``id(device_mesh)`` without holding the mesh: once a sub-mesh (``mesh["dp"]``) is freed, a
    new one (``mesh["tp"]``) can get its id and its coordinates, and ``distribute_tensor`` then
    hands a rank another rank's shard. Nothing is kept here; :func:`_mesh_coordinates` caches
    instead, holding each mesh."""

    def __setitem__(self, key, value) -> None:
        pass


@contextlib.contextmanager
def _mesh_coordinates() -> Iterator[None]:
    """Within the block, the simulated ranks' coordinates of a device mesh are computed once per
    mesh and kept with the mesh itself, so that its id cannot be reused by another mesh while it
    is cached. torch 2.13's ``LocalTensorMode`` computes them with tensor ops dispatched once per
    simulated rank (about 20 ms a mesh on a small CPU): recomputed at every call, they were most
    of a simulated test's time."""
    from torch.distributed._local_tensor import _LocalDeviceMesh

    compute = _LocalDeviceMesh.__dict__["get_coordinate"]
    cache: dict[int, tuple[Any, Any]] = {}

    def get_coordinate(mesh):
        hit = cache.get(id(mesh))
        if hit is not None and hit[0] is mesh:
            return hit[1]
        out = compute.__func__(mesh)
        cache[id(mesh)] = (mesh, out)
        return out

    _LocalDeviceMesh.get_coordinate = staticmethod(get_coordinate)
    try:
        yield
    finally:
        _LocalDeviceMesh.get_coordinate = compute


@contextlib.contextmanager
def simulate(world_size: int) -> Iterator[Any]:
    """Simulate ``world_size`` ranks in this process.

    Initialises the ``fake`` process group with ``world_size`` ranks (re-initialising it when a
    group of another size exists) and enters ``LocalTensorMode``: inside, every tensor op runs
    once per simulated rank and collectives compute their exact results. Yields the mode.

    Give the transforms DTensors or simulated tensors (:func:`local_tensor`, :func:`replicated`)
    inside it, not plain tensors made outside it: ``LocalTensorMode`` (torch 2.13) runs an
    in-place operation on a plain tensor with a simulated operand once per rank on the same
    tensor (``x.mul_(y)`` multiplies ``x`` by ``y`` twice on 2 ranks), so a stateful
    transform on plain leaves, whose state holds simulated tensors from its second step, is
    silently wrong there (``scale_by_factored_rms``' unfactored leaves). The library's native
    and generated kernels do take plain leaves there (their own buffers are made outside the
    mode, :func:`functional_train.engine.native.outside_dispatch_modes`).

    Raises:
        RuntimeError: a real (non-fake) process group is already initialised.
    """
    from torch.distributed._local_tensor import LocalTensorMode

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("simulate: a real process group is initialised; use real ranks")
        if dist.get_world_size() != world_size:
            dist.destroy_process_group()
    if not dist.is_initialized():
        _forget_old_groups()
        dist.init_process_group("fake", rank=0, world_size=world_size)
    with _mesh_coordinates(), LocalTensorMode(frozenset(range(world_size))) as mode:
        if isinstance(getattr(mode, "_coordinate_cache", None), dict):
            mode._coordinate_cache = _NoCoordinateCache()
        yield mode


def local_tensor(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """A simulated tensor holding ``values[r]`` on rank ``r`` (use inside :func:`simulate`)."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: v.detach().clone() for r, v in values.items()})


def replicated(world_size: int, x: torch.Tensor) -> torch.Tensor:
    """A simulated tensor holding a copy of ``x`` on every rank.

    Inside :func:`simulate`, build every input from simulated tensors (this, :func:`per_rank`,
    ``distribute_tensor``, or factory functions called inside the block): a plain tensor made
    outside it and mixed in-place with simulated ones is updated once per simulated rank.
    """
    return local_tensor({r: x for r in range(world_size)})


def per_rank(world_size: int, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A simulated tensor whose value on rank ``r`` is ``fn(r)`` (shapes must agree)."""
    return local_tensor({r: fn(r) for r in range(world_size)})


def on_rank(x: Any, rank: int = 0) -> Any:
    """The plain tensor that rank ``rank`` holds (identity for plain tensors and non-tensors)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(x, LocalTensor):
        return x._local_tensors[rank]
    return x


def _assemble(x: DTensor) -> torch.Tensor | None:
    """The global tensor of a simulated DTensor, assembled from every rank's shard by its
    placements (no collective, no DTensor redistribution); ``None`` when ``x`` is not simulated
    or has ``Partial`` placements."""
    from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
    from torch.distributed.tensor import Partial, Shard

    local = x._local_tensor
    if not isinstance(local, LocalTensor) or any(isinstance(p, Partial) for p in x.placements):
        return None
    mesh = x.device_mesh
    root = mesh._get_root_mesh()
    # a sub-mesh (root["tp"]) lists only this rank's slice: take coordinates from the root
    names = mesh.mesh_dim_names
    dims = (
        [root.mesh_dim_names.index(n) for n in names]
        if root is not mesh and names
        else list(range(mesh.ndim))
    )
    with maybe_disable_local_tensor_mode():
        layout = root.mesh.clone()
        out = torch.zeros(x.shape, dtype=x.dtype)
        for r, shard in local._local_tensors.items():
            full = [int(c) for c in (layout == r).nonzero()[0]]
            coord = [full[d] for d in dims]
            start, size = [0] * x.ndim, list(x.shape)
            for i, p in enumerate(x.placements):
                if isinstance(p, Shard):
                    d = p.dim % x.ndim
                    n, off = Shard.local_shard_size_and_offset(size[d], mesh.size(i), coord[i])
                    start[d] += off
                    size[d] = n
            region = tuple(slice(a, a + n) for a, n in zip(start, size))
            out[region] = shard
    return out


def gather(tree: Any, rank: int = 0) -> Any:
    """Full, plain tensors of a tree: simulated DTensors are assembled from every rank's shard
    (without DTensor redistribution), other DTensors gathered with ``full_tensor``, simulated
    tensors read on ``rank``. Non-tensor leaves are returned unchanged."""

    def one(x):
        if isinstance(x, DTensor):
            full = _assemble(x)
            x = x.full_tensor() if full is None else full
        return on_rank(x, rank)

    return optree.tree_map(one, tree, none_is_leaf=True)


class _CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func.overloadpacket.__name__
        if (
            ns in ("_c10d_functional", "c10d_functional", "c10d")
            and "wait" not in name
            and not name.startswith("_")
        ):
            self.counts[name] += 1
            first = args[0] if args else None
            if isinstance(first, (list, tuple)):
                first = first[0] if first else None
            if isinstance(first, torch.Tensor):
                self.bytes[name] += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


class CollectiveCounts:
    """Result of :func:`count_collectives`: ``counts`` by op name and ``total``."""

    def __init__(self, counter: _CollectiveCounter):
        self._c = counter

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._c.counts)

    @property
    def total(self) -> int:
        return sum(self._c.counts.values())

    @property
    def bytes(self) -> dict[str, int]:
        """Bytes of each collective's (first) input tensor on this rank, summed by op name:
        what a rank contributes (for ``all_to_all_single``: every peer's block, its own
        included)."""
        return dict(self._c.bytes)

    def __repr__(self) -> str:
        return f"CollectiveCounts(total={self.total}, counts={self.counts})"


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives issued inside the block, by kind (``all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...), and the bytes of their inputs
    (``.bytes``). Works in simulation and on real process groups (functional and c10d
    collectives; waits are not counted).

    Example::

        with count_collectives() as c:
            tx.update(grads, state, params, mesh=mesh)
        assert c.total == 1 and c.counts == {"all_reduce": 1}
    """
    counter = _CollectiveCounter()
    with counter:
        yield CollectiveCounts(counter)
