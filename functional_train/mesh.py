"""The mesh descriptor: which device-mesh dims split, replicate or separate each leaf.

A leaf's own DTensor placements say how it is spread over the mesh dims it lives on. The
descriptor adds what placements cannot say: which mesh dim carries data parallel replicas whose
gradients are still unreduced, which one separates pipeline stages, and which one separates
experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh"]


@dataclasses.dataclass(frozen=True, eq=False)
class Mesh:
    """Describes the device mesh a gradient tree lives on.

    Args:
        device_mesh: the whole ``torch.distributed.DeviceMesh`` (every dim named). DTensor leaves
            must live on it or on a sub-mesh of it (``device_mesh["tp"]``). ``None`` means one
            process, unless DTensor leaves bring their own mesh.
        data_axis: name of the data parallel mesh dim. Gradients of leaves that are neither
            sharded nor partial over it (plain tensors, DTensors on a sub-mesh without it) are
            per-replica contributions and are averaged over it (DDP semantics) by the first
            transform that needs their value.
        pipeline_axis: name of the pipeline mesh dim: ranks along it hold different leaves, so
            global quantities (the clipping norm) sum over it.
        expert_axis: name of the expert parallel mesh dim.
        is_expert: ``is_expert(path) -> bool`` on dotted leaf paths (``layers.3.moe.w1``): leaves
            it marks differ per rank along ``expert_axis``; the others are replicated over it.
            Experts stacked in one DTensor ``Shard``-ed over ``expert_axis`` need no mark.

    With both ``data_axis`` and ``expert_axis``, the expert axis is data parallel too (experts
    spread over data-parallel ranks, as in DeepSpeed-MoE, Colossal-AI's MoE plugin and
    torchtitan): each rank's loss is the mean over its own tokens, so the gradients of the
    other leaves are per-replica contributions over ``data_axis`` x ``expert_axis`` and are
    averaged over both; an expert's gradient on its rank already sums every expert-axis rank's
    contribution (autograd through the all-to-all token dispatch), so it is averaged over
    ``data_axis`` and divided by the expert axis size. The result is the gradient of the mean
    loss over every rank's tokens. With ``expert_axis`` alone, gradients are taken as reduced.

    Every other mesh dim that does not split a leaf holds replicas of it.

    Raises:
        ValueError: an axis name not among ``device_mesh.mesh_dim_names``, an axis without a
            ``device_mesh``, two roles on one dim, or ``is_expert`` without ``expert_axis``.
        TypeError: ``device_mesh`` is not a ``DeviceMesh`` or ``is_expert`` is not callable.
    """

    device_mesh: DeviceMesh | None = None
    data_axis: str | None = None
    pipeline_axis: str | None = None
    expert_axis: str | None = None
    is_expert: Callable[[str], bool] | None = None

    def __post_init__(self) -> None:
        axes = {
            "data_axis": self.data_axis,
            "pipeline_axis": self.pipeline_axis,
            "expert_axis": self.expert_axis,
        }
        if self.device_mesh is not None and not isinstance(self.device_mesh, DeviceMesh):
            raise TypeError(
                f"Mesh: device_mesh must be a DeviceMesh, got {type(self.device_mesh).__name__}"
            )
        if self.is_expert is not None and not callable(self.is_expert):
            raise TypeError("Mesh: is_expert must be a callable path -> bool")
        if self.is_expert is not None and self.expert_axis is None:
            raise ValueError("Mesh: is_expert is given but expert_axis is None")
        names = tuple(self.device_mesh.mesh_dim_names or ()) if self.device_mesh is not None else ()
        used: dict[str, str] = {}
        for role, name in axes.items():
            if name is None:
                continue
            if self.device_mesh is None:
                raise ValueError(f"Mesh: {role}={name!r} needs a device_mesh")
            if name not in names:
                raise ValueError(
                    f"Mesh: {role}={name!r} is not a dim of the device mesh (dims: {names})"
                )
            if name in used:
                raise ValueError(f"Mesh: {role} and {used[name]} both name mesh dim {name!r}")
            used[name] = role
        if (
            self.device_mesh is not None
            and self.device_mesh.ndim > 1
            and len(names) != self.device_mesh.ndim
        ):
            raise ValueError("Mesh: every dim of a multi-dimensional device_mesh must be named")

    # -- queries ---------------------------------------------------------------------------
    @property
    def dim_names(self) -> tuple[str, ...]:
        if self.device_mesh is None:
            return ()
        return tuple(
            self.device_mesh.mesh_dim_names or (f"dim{i}" for i in range(self.device_mesh.ndim))
        )

    def dim(self, name: str) -> int:
        """Index of the mesh dim called ``name``."""
        return self.dim_names.index(name)

    def size(self, name: str) -> int:
        """Number of ranks along the mesh dim called ``name``."""
        if self.device_mesh is None:
            raise ValueError(f"Mesh.size({name!r}): the descriptor has no device_mesh")
        return self.device_mesh.size(self.dim(name))

    @property
    def pending_data_reduction(self) -> bool:
        """True while plain-tensor gradients are per-replica contributions over ``data_axis``."""
        return self.data_axis is not None and (self.size(self.data_axis) > 1 or self.expert_data)

    @property
    def expert_data(self) -> bool:
        """True when the expert axis is data parallel too (``data_axis`` is given, and the
        expert axis has more than one rank): see the class docstring."""
        return (
            self.data_axis is not None
            and self.expert_axis is not None
            and self.size(self.expert_axis) > 1
        )

    @property
    def data_dims(self) -> list:
        """Indices of the mesh dims whose ranks train on different data: the data axis, and the
        expert axis when it is data parallel too (:attr:`expert_data`)."""
        if self.data_axis is None:
            return []
        return [self.dim(self.data_axis)] + (
            [self.dim(self.expert_axis)]
            if self.expert_axis is not None and self.expert_data
            else []
        )

    def reduced(self) -> Mesh:
        """The descriptor of the same mesh once gradients have been averaged over ``data_axis``."""
        if self.data_axis is None:
            return self
        hit = self.__dict__.get("_reduced")
        if hit is None:  # one object per descriptor: plans are cached by descriptor identity
            hit = dataclasses.replace(self, data_axis=None)
            object.__setattr__(self, "_reduced", hit)
        return hit

    def __repr__(self) -> str:
        shape = (
            None if self.device_mesh is None else dict(zip(self.dim_names, self.device_mesh.shape))
        )
        return (
            f"Mesh({shape}, data_axis={self.data_axis!r}, pipeline_axis={self.pipeline_axis!r}, "
            f"expert_axis={self.expert_axis!r})"
        )
