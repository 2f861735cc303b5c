"""GaLore (Zhao et al. 2024): gradient low-rank projection as composable transforms, exact under
sharding.

* :func:`galore` wraps any inner transform: every 2-D update leaf is projected onto a rank-``r``
  subspace of its gradient (refreshed from an SVD every ``update_proj_gap`` steps), the inner
  transform runs on the projected gradient, and its result is projected back and scaled;
* :func:`galore_adamw` is the chain equal to ``galore_torch.GaLoreAdamW`` (HF AdamW heritage);
* :func:`galore_param_labels` builds its labels from dotted parameter paths as Colossal-AI's
  ``get_galore_param_groups`` builds its parameter groups.

Reference: Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection"; ``galore_torch.GaLoreAdamW`` and ``galore_torch.galore_projector.GaLoreProjector``
(galore-torch 1.0), the semantics followed here.

Sharding. A 2-D DTensor leaf ``g`` of global shape ``(m, n)`` is projected
on its local shard:

* the projector ``P`` is the same on every rank: a replicated DTensor of its global shape in the
  state (so checkpoints reshard), computed on a refresh step from the SVD of the GLOBAL gradient.
  Only leaves with a ``Shard`` placement are gathered for it (one bucketed all-gather per mesh dim
  that shards them); replicated leaves and plain tensors need no communication;
* ``R = g P^T`` (``P`` of shape ``(r, n)``) or ``R = P^T g`` (``P`` of shape ``(m, r)``) contracts
  one tensor dim of ``g``. The other dim keeps its placement, so ``R`` is a DTensor with the
  leaf's placements, the contracted dim's ``Shard`` replaced by ``Replicate``. When the
  contracted dim is sharded the local product (the local shard times the matching slice of
  ``P``) is a partial sum, completed by ONE bucketed all-reduce for all such leaves
  (:meth:`~functional_train.sharding.Prepared.leaf_sums`);
* the back-projection ``R P`` / ``P R`` is local: the output dim that ``P`` brings back gets
  the slice of the replicated ``P`` that matches the local shard of the leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from . import _validate as V
from .autograd import host_value, not_differentiable
from .base import (
    GradientTransformation,
    chain,
    check_state,
    declare,
    elementwise_transform,
)
from .combine import leaf_values, partition
from .engine import elementwise as E
from .engine.dtensor import Spec, spec_of, to_local, wrap, wrap_like
from .engine.pool import MIN_MEAN_BYTES, Scratch
from .engine.scalars import schedule_value
from .engine.view import Prepared, prepare
from .engine.whole import (
    gather_global as _gather_global,
)
from .engine.whole import (
    is_sharded as _is_sharded,
)
from .engine.whole import (
    local_part as _local_part,
)
from .engine.whole import (
    per_rank as _per_rank,
)
from .hyperparams import injectable, value_of
from .spec import attach_spec, transform_spec
from .transforms import (
    AdamLeaf,
    ScalarOrSchedule,
    ScaleByAdamState,
    ScaleByScheduleState,
    reject_complex,
    scale_by_adam,
    scale_by_learning_rate,
    stateless_elementwise,
)
from .tree import (
    PyTree,
    contiguous_stride,
    first_device,
    flatten_as,
    leaves_of,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)

__all__ = [
    "galore",
    "GaLoreState",
    "galore_adamw",
    "galore_param_labels",
    "PROJ_TYPES",
]


PROJ_TYPES = ("std", "reverse_std", "left", "right")
REFRESH = ("svd", "randomized")
_RIGHT, _LEFT = "right", "left"


class GaLoreState(NamedTuple):
    """State of :func:`galore`.

    Attributes:
        count: number of previous updates (int64, 0-dim, always on the CPU: the refresh decision
            ``count % update_proj_gap == 0`` is read on the host, like
            :class:`~functional_train.MultiStepsState`'s ``mini_step``; reading a CPU tensor needs
            no device synchronisation).
        projectors: params-shaped tree. For a projected leaf of global shape ``(m, n)``, its
            orthonormal projector in float32 (the SVD's own precision): ``Vh[:r]`` of shape
            ``(r, n)`` for a right projection, ``U[:, :r]`` of shape ``(m, r)`` for a left one,
            with ``r = min(rank, m, n)``; zeros until the first update. For a DTensor leaf a
            DTensor of that global shape, ``Replicate`` on every dim of the leaf's mesh.
            ``None`` for leaves that are not projected.
        inner_state: the inner transform's state, initialised on the projected shapes (see
            :func:`galore`) and kept across refreshes, as galore-torch keeps its moments.
    """

    count: torch.Tensor
    projectors: Any
    inner_state: Any


# ---------------------------------------------------------------------------------------------
# geometry: which side a leaf is projected on, shapes and placements
# ---------------------------------------------------------------------------------------------
def _is_projected(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim == 2 and min(x.shape) > 0


def _side(shape: Sequence[int], proj_type: str) -> str:
    """``"right"`` (``R = g P^T``, ``P = Vh[:r]``) or ``"left"`` (``R = P^T g``, ``P = U[:, :r]``),
    as galore-torch's ``GaLoreProjector.project`` chooses it."""
    m, n = int(shape[0]), int(shape[1])
    if proj_type == "std":
        return _RIGHT if m >= n else _LEFT
    if proj_type == "reverse_std":
        return _LEFT if m >= n else _RIGHT
    return proj_type


def _contracted(side: str) -> int:
    """The tensor dim of the leaf that the projection sums over."""
    return 1 if side == _RIGHT else 0


def _proj_shape(shape: Sequence[int], side: str, rank: int) -> tuple[int, int]:
    m, n = int(shape[0]), int(shape[1])
    r = min(rank, m, n)
    return (r, n) if side == _RIGHT else (m, r)


def _low_rank_shape(shape: Sequence[int], side: str, rank: int) -> tuple[int, int]:
    m, n = int(shape[0]), int(shape[1])
    r = min(rank, m, n)
    return (m, r) if side == _RIGHT else (r, n)


def _check_placements(spec: Spec, path: str) -> None:
    for p in spec.placements:
        if isinstance(p, Partial):
            raise ValueError(
                f"galore: parameter '{path}' is Partial; GaLore needs parameters in "
                "Shard/Replicate placements"
            )
        if isinstance(p, Shard) and type(p) is not Shard:
            raise ValueError(
                f"galore: leaf '{path}' has placement {p!r}; only Shard and "
                "Replicate placements are supported on projected (2-D) leaves"
            )


def _low_rank_spec(spec: Spec, side: str, rank: int) -> Spec:
    """Layout of ``R``: the leaf's placements with the contracted dim's ``Shard`` replaced by
    ``Replicate``; global shape ``(m, r)`` or ``(r, n)``."""
    c = _contracted(side)
    pl = tuple(
        Replicate()
        if isinstance(p, Shard) and p.dim % 2 == c
        else (Shard(p.dim % 2) if isinstance(p, Shard) else p)
        for p in spec.placements
    )
    shape = _low_rank_shape(spec.shape, side, rank)
    return Spec(spec.mesh, pl, torch.Size(shape), contiguous_stride(shape))


def _proj_spec(spec: Spec, side: str, rank: int) -> Spec:
    """Layout of the projector in the state: replicated, global shape."""
    shape = _proj_shape(spec.shape, side, rank)
    return Spec(
        spec.mesh, (Replicate(),) * spec.mesh.ndim, torch.Size(shape), contiguous_stride(shape)
    )


def _slice_placements(spec: Spec, side: str) -> tuple:
    """Placements under which the local part of the projector is the slice that matches the
    local shard of the leaf along the contracted dim (``P``'s dim ``c`` is the leaf's dim ``c``)."""
    c = _contracted(side)
    return tuple(
        Shard(c) if isinstance(p, Shard) and p.dim % 2 == c else Replicate()
        for p in spec.placements
    )


# ---------------------------------------------------------------------------------------------
# rank-dependent local blocks (run once per simulated rank under LocalTensorMode)
# ---------------------------------------------------------------------------------------------
@_per_rank
def _low_rank_zeros(x: torch.Tensor, side: str, r: int) -> torch.Tensor:
    shape = (x.shape[0], r) if side == _RIGHT else (r, x.shape[1])
    return torch.zeros(shape, dtype=x.dtype, device=x.device)


# ---------------------------------------------------------------------------------------------
# the refresh: global gradients of sharded leaves, SVD
# ---------------------------------------------------------------------------------------------
def _orthogonal(full: torch.Tensor, side: str, rank: int) -> torch.Tensor:
    """galore-torch's ``get_orthogonal_matrix``: SVD of the gradient in float32;
    ``Vh[:r]`` (right) or ``U[:, :r]`` (left), kept in float32 (galore-torch casts it to the
    gradient's dtype, which :func:`galore` does at use, with the same values)."""
    U, _, Vh = torch.linalg.svd(full.to(torch.float32), full_matrices=False)
    return (Vh[:rank, :] if side == _RIGHT else U[:, :rank]).contiguous()


def _like_dim(spec: Spec | None, dim: int) -> tuple:
    """Placements under which the local part of a ``(size of dim, k)`` matrix matches the local
    shard of the leaf along its tensor dim ``dim``."""
    return tuple(
        Shard(0) if isinstance(p, Shard) and p.dim % 2 == dim else Replicate()
        for p in spec.placements
    )


def _rows_for(x: torch.Tensor, spec: Spec | None, dim: int) -> torch.Tensor:
    """The rows of the replicated matrix ``x`` matching this rank's shard of leaf dim ``dim``."""
    if spec is None or not _is_sharded(spec, dim):
        return x
    return _local_part(x, spec.mesh, _like_dim(spec, dim))


def _randomized(
    b: Prepared, proj: Sequence[tuple[int, str]], rank: int, oversample: int, seed: int
) -> dict:
    """Projectors from a randomized range finder (Halko, Martinsson & Tropp 2011) of the GLOBAL
    gradients, communicating ``O(k (m + n))`` per leaf (``k = min(r + oversample, m, n)``)
    instead of gathering ``m n``: two all-reduces for all leaves (``leaf_sums(whole=True)``).

    Right side (``P ~ Vh[:r]``): ``Y = G^T Omega`` (``n x k``, ``Omega`` ``m x k`` Gaussian),
    ``Q = qr(Y)``, ``B = G Q`` (``m x k``), ``B = U_B S Vh_B``, ``P = (Vh_B Q^T)[:r]``.
    Left side (``P ~ U[:, :r]``): ``Y = G Omega`` (``m x k``), ``Q = qr(Y)``, ``B = Q^T G``,
    ``P = (Q U_B)[:, :r]``. ``Omega`` is drawn on the CPU from ``seed`` and the leaf's position,
    so every rank (and an unsharded run) draws the same; float32 throughout, like the SVD."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    geo = {}
    for i, side in proj:
        m, n = (int(d) for d in b.updates[i].shape)
        r = min(rank, m, n)
        k = min(r + oversample, m, n)
        with maybe_disable_local_tensor_mode():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            omega = torch.randn((m if side == _RIGHT else n, k), generator=gen)
        geo[i] = (side, r, omega.to(b.locals[i].device))
    # round 1: the range Y of G^T (right) or G (left)
    items = []
    for i, (side, _, omega) in geo.items():
        g, s = b.locals[i].to(torch.float32), b.specs[i]
        if side == _RIGHT:  # (k, n_local) = Omega[rows]^T G, summed over the row shards
            items.append((i, _rows_for(omega, s, 0).T @ g, (0,)))
        else:  # (m_local, k) = G Omega[cols], summed over the column shards
            items.append((i, g @ _rows_for(omega, s, 1), (1,)))
    ys = b.leaf_sums(items, whole=True)
    # round 2: B = G Q (right) or Q^T G (left)
    items, qs = [], {}
    for (i, (side, _, _)), y in zip(geo.items(), ys):
        g, s = b.locals[i].to(torch.float32), b.specs[i]
        q = torch.linalg.qr(y.T if side == _RIGHT else y).Q  # (n, k) or (m, k)
        qs[i] = q
        if side == _RIGHT:
            items.append((i, g @ _rows_for(q, s, 1), (1,)))  # (m_local, k)
        else:
            items.append((i, _rows_for(q, s, 0).T @ g, (0,)))  # (k, n_local)
    bs = b.leaf_sums(items, whole=True)
    out = {}
    for (i, (side, r, _)), bm in zip(geo.items(), bs):
        U, _, Vh = torch.linalg.svd(bm, full_matrices=False)
        q = qs[i]
        out[i] = ((Vh @ q.T)[:r] if side == _RIGHT else (q @ U)[:, :r]).contiguous()
    return out


def _project(g: torch.Tensor, p: torch.Tensor, side: str) -> torch.Tensor:
    p = p.to(g.dtype)
    return g @ p.T if side == _RIGHT else p.T @ g


def _project_back(r: torch.Tensor, p: torch.Tensor, side: str) -> torch.Tensor:
    p = p.to(r.dtype)
    return r @ p if side == _RIGHT else p @ r


class BackProjection(NamedTuple):
    """A projected leaf's update before its back-projection, as :func:`galore`'s per-leaf path
    hands it to ``ft.step``: the full-shape update is ``scale * (low @ proj)`` (right side) or
    ``scale * (proj @ low)`` (left side)."""

    low: torch.Tensor
    proj: torch.Tensor
    side: str
    scale: float

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two matrices whose product is the unscaled update, in order."""
        return (self.low, self.proj) if self.side == _RIGHT else (self.proj, self.low)

    def into(self, buf: torch.Tensor) -> torch.Tensor:
        """The scaled update written into ``buf`` (contiguous, the leaf's shape and dtype)."""
        u = torch.matmul(*self.factors(), out=buf)  # _project_back's product
        return _scaled_(u, self.scale)


def _scaled_(u: torch.Tensor, scale) -> torch.Tensor:
    """``u *= scale`` in place (nothing for a float 1; a 0-dim tensor ``scale``, injected and
    compiled, in ``u``'s dtype)."""
    if isinstance(scale, torch.Tensor):
        return u.mul_(scale.to(u.dtype))
    return u.mul_(scale) if scale != 1.0 else u


# ---------------------------------------------------------------------------------------------
# galore
# ---------------------------------------------------------------------------------------------
def galore(
    inner: GradientTransformation,
    rank: int,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    *,
    refresh: str = "svd",
    oversample: int = 10,
    seed: int = 0,
) -> GradientTransformation:
    """GaLore's gradient low-rank projection around ``inner`` (Zhao et al. 2024), exactly as
    galore-torch's ``GaLoreProjector`` computes it.

    For every 2-D update leaf ``g`` of global shape ``(m, n)`` (both dims > 0), with
    ``r = min(rank, m, n)`` and ``t`` the update number (1 on the first update):

    * on refresh steps ``t = 1, T+1, 2T+1, ...`` (``T = update_proj_gap``; galore-torch checks
      ``step % T == 0`` before its increment) the projector is recomputed from the SVD
      ``U, s, Vh = svd(g)`` of the GLOBAL gradient in float32: ``P = Vh[:r]`` (``r x n``) for a
      right projection, ``P = U[:, :r]`` (``m x r``) for a left one;
    * the side: ``proj_type="std"``: right if ``m >= n`` else left (project the smaller dim);
      ``"reverse_std"``: the opposite; ``"left"`` / ``"right"``: always that side;
    * ``R = g P^T`` (``m x r``, right) or ``R = P^T g`` (``r x n``, left), in ``g``'s dtype
      (``P`` cast to it, as galore-torch does);
    * ``inner`` runs on ``R`` (its state has the projected shapes and is kept across refreshes,
      like galore-torch's moments); its output ``N`` is projected back,
      ``u = scale * (N P)`` (right) or ``u = scale * (P N)`` (left), in ``N``'s dtype.

    The side of the back-projection is the side of the projection. (galore-torch re-derives it
    from the shape of ``N``; for ``"reverse_std"`` on a wide ``m < n`` leaf with ``rank >= m``
    it then multiplies on the wrong side and raises; here that case is well defined.)

    Other leaves (non-2-D, or with an empty dim) go to ``inner`` unprojected; ``None`` leaves
    (frozen parameters) pass through untouched and keep their projector; an update where every
    leaf is ``None`` returns the state unchanged (no step counted). ``inner`` is called
    with ``params=None``: it has no parameter in the projected space, so transforms that need
    params (weight decay, parameter scaling) belong outside ``galore`` (see
    :func:`galore_adamw`). The refresh counter is global (galore-torch counts per parameter; the
    two differ only for parameters whose gradient is sometimes ``None``).

    Sharding: updates are materialised first (:func:`~functional_train.sharding.prepare`:
    unreduced gradients over ``Mesh.data_axis`` or ``Partial`` are reduced, and redistributed
    into the parameters' placements when ``params`` is given; without ``params`` the gradients
    must already be in the placements the state was initialised for). For a DTensor leaf
    (``Shard`` / ``Replicate`` placements, uneven shards fine), ``R`` is handed to ``inner`` as a
    DTensor of global shape ``(m, r)`` / ``(r, n)`` whose placements are the leaf's with the
    contracted dim's ``Shard`` replaced by ``Replicate`` (right: dim 1 contracted; left: dim 0);
    the inner state is initialised in that layout; the update keeps the leaf's placements. The
    SVD runs on every rank on the same gathered gradient (deterministic, so every rank gets the
    same projector).

    Collectives per update issued by ``galore`` itself (``inner`` adds its own):

    * refresh steps: no all-reduce; the 2-D leaves with any ``Shard`` placement are gathered:
      one all-gather per sharding mesh dim for each distinct set of sharding process groups
      (and dtype), whatever the number of leaves. Replicated leaves and plain tensors: none.
      The projection of a gathered leaf is then computed from its global gradient;
    * other steps: no SVD and no gather. Zero collectives when no contracted dim is sharded,
      else ONE all-reduce (per dtype) completing the local partial products of every leaf whose
      contracted dim is sharded, whatever its mesh dims (each rank writes its partial
      ``R`` at its global offsets, see :meth:`~functional_train.sharding.Prepared.leaf_sums`).

    Args:
        inner: the transform run on the projected gradients (e.g. ``scale_by_adam``).
        rank: projection rank ``r`` (>= 1; ``min(rank, m, n)`` is used per leaf).
        update_proj_gap: ``T``, steps between projector refreshes (>= 1, default 200).
        scale: GaLore's scale ``alpha`` multiplying the back-projected update (default 0.25).
        proj_type: ``"std"`` (default), ``"reverse_std"``, ``"left"`` or ``"right"``
            (galore-torch's ``"full"`` two-sided projection is not offered).
        refresh: ``"svd"`` (default: galore-torch's exact SVD of the gathered gradient) or
            ``"randomized"``: a randomized range finder (Halko et al. 2011) with
            ``k = min(r + oversample, m, n)`` Gaussian directions drawn from ``seed`` and the
            step, whose refresh communicates ``O(k (m + n))`` per leaf instead of ``m n``: TWO
            all-reduces for all leaves and no gather; the projector spans the top-``r``
            subspace exactly when the gradient's rank is at most ``k``, approximately
            otherwise. Sharded and unsharded runs draw the same directions (same numbers).
        oversample: extra directions of the randomized refresh (>= 0, default 10).
        seed: seed of the randomized refresh (>= 0, default 0).

    State: :class:`GaLoreState`.

    Raises:
        ValueError: ``rank < 1``, ``update_proj_gap < 1`` or an unknown ``proj_type`` (naming
            the argument); at init, a ``Partial`` or strided-shard parameter; at update, a state
            from another transform or for other parameters (naming the leaf).
        TypeError: ``inner`` is not a GradientTransformation, ``rank`` / ``update_proj_gap``
            not ints, ``scale`` not a real number.
    """
    where = "galore"
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"{where}: inner must be a GradientTransformation, got {type(inner).__name__}"
        )
    rank = V.integer("rank", rank, where=where, low=1)
    gap = V.integer("update_proj_gap", update_proj_gap, where=where, low=1)
    scale_arg = V.number("scale", scale, where=where)
    if proj_type not in PROJ_TYPES:
        raise ValueError(f"{where}: proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")
    if refresh not in REFRESH:
        raise ValueError(f"{where}: refresh must be one of {REFRESH}, got {refresh!r}")
    oversample = V.integer("oversample", oversample, where=where, low=0)
    seed = V.integer("seed", seed, where=where, low=0)
    refresh_kind = refresh

    def init_fn(params):
        leaves, treedef = tree_flatten(params)
        paths = None
        projs, low = [], []
        for k, x in enumerate(leaves):
            if not _is_projected(x):
                projs.append(None)
                low.append(x)
                continue
            side = _side(x.shape, proj_type)
            pshape = _proj_shape(x.shape, side, rank)
            r = _low_rank_shape(x.shape, side, rank)[1 if side == _RIGHT else 0]
            s = spec_of(x)
            local = to_local(x)
            z = torch.zeros(pshape, dtype=torch.float32, device=local.device)
            if s is None:
                projs.append(z)
                low.append(_low_rank_zeros(local, side, r))
                continue
            if paths is None:
                paths = tree_paths(params)
            _check_placements(s, paths[k])
            projs.append(wrap(z, _proj_spec(s, side, rank)))
            low.append(wrap(_low_rank_zeros(local, side, r), _low_rank_spec(s, side, rank)))
        return GaLoreState(
            torch.zeros((), dtype=torch.int64, device="cpu"),
            tree_unflatten(treedef, projs),
            inner.init(tree_unflatten(treedef, low)),
        )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        return run(updates, state, params, mesh, extra, None, None)

    def per_leaf(updates, state, params, on_update, scratch, outputs=None):
        """``update`` for ``ft.step``'s per-leaf path (plain tensors, one process): instead of
        returning the updates, hands each active leaf's update to ``on_update(i, u)`` as soon
        as it exists: a :class:`BackProjection` for a projected leaf, else a tensor (in
        ``scratch``, valid until the next call); returns the new state. Between refreshes, an
        ``inner`` with a ``leafwise`` form (32-bit :func:`scale_by_adam`) and ``outputs``
        given, each leaf is projected, through Adam and handed on before the next is read;
        ``outputs(kind, tensors)`` gives the new moments' buffers (the old ones to update them
        in place). Scratch slots 2 and 3 are this function's."""
        return run(updates, state, params, None, {}, on_update, scratch, outputs)[1]

    def run(updates, state, params, mesh, extra, on_update, scratch, outputs=None):
        check_state(state, GaLoreState, where)
        scale = value_of(scale_arg)
        b = prepare(updates, params, mesh, name=where)
        reject_complex(b, where)
        if not b.active:  # every leaf frozen: nothing to project, no step taken
            return updates, state
        old = flatten_as(state.projectors, b.treedef, "GaLoreState.projectors", "the updates")
        proj = []  # (leaf index, side)
        for i in b.active:
            g, p = b.updates[i], old[i]
            if not _is_projected(g):
                if p is not None:
                    raise ValueError(
                        f"{where}: update leaf '{b.paths[i]}' has shape "
                        f"{tuple(g.shape)}, but the state holds a projector for it "
                        "(a state for other parameters?)"
                    )
                continue
            side = _side(g.shape, proj_type)
            want = _proj_shape(g.shape, side, rank)
            if p is None or tuple(p.shape) != want:
                got = "none" if p is None else f"one of shape {tuple(p.shape)}"
                raise ValueError(
                    f"{where}: update leaf '{b.paths[i]}' of shape "
                    f"{tuple(g.shape)} needs a projector of shape {want}, the "
                    f"state holds {got} (a state for other parameters?)"
                )
            proj.append((i, side))
        count = int(host_value(state.count, "galore: GaLoreState.count"))  # CPU counter: a host
        # read without device synchronisation
        refresh = count % gap == 0
        randomized = refresh_kind == "randomized"
        p_full = {i: to_local(old[i]) for i, _ in proj}
        new_proj = list(old)
        full = {}
        if refresh and any(V.is_traced(b.locals[i], batched=False) for i, _ in proj):
            not_differentiable(
                where,
                "the projector refresh (an SVD of the gradient, whose singular vectors have no "
                "stable derivative)",
            )
        if refresh and proj and randomized:
            for i, p_new in _randomized(b, proj, rank, oversample, seed + count).items():
                p_full[i] = p_new
                new_proj[i] = wrap_like(p_new, old[i])
        elif refresh and proj:
            full = _gather_global(b, [i for i, _ in proj if _is_sharded(b.specs[i])])
            for i, side in proj:
                p_full[i] = _orthogonal(full.get(i, b.locals[i]), side, rank)
                new_proj[i] = wrap_like(p_full[i], old[i])
        leafwise = transform_spec(inner).adam_leaf
        if (
            on_update is not None
            and outputs is not None
            and leafwise is not None
            and not refresh
            and isinstance(state.inner_state, ScaleByAdamState)
        ):
            inner_state = _leafwise(
                b,
                dict(proj),
                p_full,
                state.inner_state,
                leafwise,
                on_update,
                scratch,
                outputs,
                scale,
                rank,
            )
            return None, GaLoreState(
                state.count + 1, tree_unflatten(b.treedef, new_proj), inner_state
            )
        # projection: local products, partial sums completed by one bucketed all-reduce
        low: dict = {}
        p_slice: dict = {}
        partial = []
        for i, side in proj:
            s = b.specs[i]
            c = _contracted(side)
            if s is not None and _is_sharded(s, c):
                p_slice[i] = _local_part(p_full[i], s.mesh, _slice_placements(s, side))
            else:
                p_slice[i] = p_full[i]
            if i in full:  # refresh of a sharded leaf: from its global gradient, no all-reduce
                rs = _low_rank_spec(s, side, rank)
                low[i] = _local_part(_project(full[i], p_full[i], side), s.mesh, rs.placements)
            elif s is not None and _is_sharded(s, c):
                partial.append((i, _project(b.locals[i], p_slice[i], side), (c,)))
            else:
                low[i] = _project(b.locals[i], p_slice[i], side)
        for (i, _, _), r in zip(partial, b.leaf_sums(partial)):
            low[i] = r
        inner_in = [None] * len(b.locals)
        for i in b.active:
            inner_in[i] = b.updates[i]
        for i, side in proj:
            s = b.specs[i]
            inner_in[i] = low[i] if s is None else wrap(low[i], _low_rank_spec(s, side, rank))
        inner_out, inner_state = inner.update(
            tree_unflatten(b.treedef, inner_in), state.inner_state, None, mesh=b.mesh, **extra
        )
        out = flatten_as(
            inner_out, b.treedef, f"{where}: the inner transform's updates", "the updates"
        )
        out = list(out)
        new_state = GaLoreState(state.count + 1, tree_unflatten(b.treedef, new_proj), inner_state)
        if on_update is not None:  # ft.step's per-leaf path: plain tensors, one process
            sides = dict(proj)
            for i in b.active:
                r = out[i]
                on_update(
                    i,
                    r
                    if i not in sides
                    else BackProjection(r, p_slice[i].to(r.dtype), sides[i], scale),
                )
            return None, new_state
        for i, side in proj:
            u = _project_back(to_local(out[i]), p_slice[i], side)
            out[i] = wrap(_scaled_(u, scale), b.specs[i])
        return tree_unflatten(b.treedef, out), new_state

    attach_spec(update_fn, per_leaf=per_leaf)
    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


def _leafwise(
    b: Prepared,
    sides: dict,
    proj: dict,
    state: ScaleByAdamState,
    adam: AdamLeaf,
    on_update: Callable,
    scratch: Scratch,
    outputs: Callable,
    scale: float,
    rank: int,
) -> ScaleByAdamState:
    """:func:`galore`'s per-leaf update with its ``inner`` Adam one leaf at a time (plain
    tensors, one process, no refresh): per active leaf, ``R`` projected into scratch slot 2,
    Adam's moments into ``outputs``' buffers and its update into slot 3, then ``on_update``;
    the same operations as the general path on one leaf, so the moments and updates are bit for
    bit its own. Returns the new inner state."""
    act = b.active
    adam = adam.resolved()
    mu_all = flatten_as(state.mu, b.treedef, "ScaleByAdamState.mu", "the updates")
    nu_all = flatten_as(state.nu, b.treedef, "ScaleByAdamState.nu", "the updates")
    mu, nu = [mu_all[i] for i in act], [nu_all[i] for i in act]  # the projected shapes
    for k, i in enumerate(act):
        g, side = b.locals[i], sides.get(i)
        want = tuple(g.shape) if side is None else _low_rank_shape(g.shape, side, rank)
        for what, x in (("mu", mu[k]), ("nu", nu[k])):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"galore: update leaf '{b.paths[i]}' needs a "
                    f"ScaleByAdamState.{what} of shape {want}, the state holds "
                    f"{got} (a state for other parameters?)"
                )
    mu_out, nu_out = outputs("galore.mu", mu), outputs("galore.nu", nu)
    count = state.count + 1
    factors = adam.factors(count)
    for k, i in enumerate(act):
        g = b.locals[i]
        side = sides.get(i)
        if side is not None:
            p = proj[i].to(g.dtype)  # _project's product, into the scratch
            if side == _RIGHT:
                g = torch.matmul(
                    g, p.T, out=scratch.view(2, (g.shape[0], p.shape[0]), g.dtype, g.device)
                )
            else:
                g = torch.matmul(
                    p.T, g, out=scratch.view(2, (p.shape[1], g.shape[1]), g.dtype, g.device)
                )
        r = adam.step(
            g,
            mu[k],
            nu[k],
            mu_out[k],
            nu_out[k],
            scratch.view(3, g.shape, nu[k].dtype, g.device),
            factors,
        )
        on_update(i, r if side is None else BackProjection(r, p.to(r.dtype), side, scale))
    return ScaleByAdamState(
        count,
        b.state_tree(state.mu, "ScaleByAdamState.mu", mu_out),
        b.state_tree(state.nu, "ScaleByAdamState.nu", nu_out),
    )


# ---------------------------------------------------------------------------------------------
# galore_adamw
# ---------------------------------------------------------------------------------------------
def _decay_after_update(
    learning_rate: ScalarOrSchedule, weight_decay: float
) -> GradientTransformation:
    """HF AdamW's decoupled weight decay, applied to the already-updated parameter
    (``p <- p - lr * wd * p`` after ``p <- p + u``): ``u <- u - lr * wd * (param + u)``.

    ``learning_rate`` is a float or a schedule of the number of previous updates, as in
    :func:`~functional_train.scale_by_learning_rate` (put the two at the same place of a chain
    and they see the same learning rate). Needs params. State: ``EmptyState`` for a float,
    :class:`~functional_train.ScaleByScheduleState` for a schedule. Elementwise: fuses with the
    learning rate before it and ``apply_updates`` after it.
    """
    where = "galore_adamw weight decay"

    def leaf(u, p, s, h, key):
        """``u + (u + p) * (-c)``, ``c = lr * weight_decay`` (``p`` in the update's dtype; a
        scheduled ``c``, a tensor, in it too)."""
        c = h[0]
        neg = (-c).to(u.dtype) if isinstance(c, torch.Tensor) else -c
        return u + (u + p.to(u.dtype)) * neg, ()

    if not callable(learning_rate):
        lr = float(learning_rate)
        return stateless_elementwise(
            where, leaf, lambda b: (lr * value_of(weight_decay),), needs_params=True
        )

    def init_fn(params):
        return ScaleByScheduleState(torch.zeros((), dtype=torch.int64, device=first_device(params)))

    def prologue(state, b):
        check_state(state, ScaleByScheduleState, where)
        if b.params is None:
            raise ValueError(f"{where}: needs params (update(..., params))")
        c = schedule_value(learning_rate, state.count) * value_of(weight_decay)
        return (c,), lambda trees: ScaleByScheduleState(state.count + 1)

    spec = E.Elementwise(where, leaf, prologue, E.no_fields, 0, needs_params=True)
    return elementwise_transform(spec, init_fn)


_LABELS = ("galore", "decay", "no_decay")


def _canonical_labels(labels: None | PyTree | Callable[[PyTree], PyTree]):
    """``params -> labels tree`` over ``_LABELS``: ``"galore"`` and ``"no_decay"`` kept, every
    other label ``"decay"``; with ``labels=None`` every 2-D leaf is ``"galore"``."""

    def fn(params):
        leaves, treedef = tree_flatten(params)
        if labels is None:
            out = ["galore" if _is_projected(x) else "decay" for x in leaves]
        else:
            given = leaf_values(labels, params, "galore_adamw: labels")
            out = []
            for k, lab in enumerate(given):
                if not isinstance(lab, str):
                    raise TypeError(
                        f"galore_adamw: label of leaf '{tree_paths(params)[k]}' must "
                        f"be a str, got {type(lab).__name__}"
                    )
                out.append(lab if lab in ("galore", "no_decay") else "decay")
        return tree_unflatten(treedef, out)

    return fn


def _hf_adam(
    b1: float, b2: float, eps: float, optim_bits: int = 32, min_8bit_size: int = 4096
) -> GradientTransformation:
    """The Adam scaling of HF / galore-torch AdamW (eps added to sqrt(v) before the bias
    correction, bias correction on), with 32- or 8-bit moments. The one place galore_adamw
    builds it."""
    return scale_by_adam(
        b1, b2, eps, eps_before_correction=True, optim_bits=optim_bits, min_8bit_size=min_8bit_size
    )


@injectable(tensors=("b1", "b2", "eps", "weight_decay", "scale"))
def galore_adamw(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    rank: int = 128,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    labels: None | PyTree | Callable[[PyTree], PyTree] = None,
    optim_bits: int = 32,
    min_8bit_size: int = 4096,
    refresh: str = "svd",
) -> GradientTransformation:
    """``galore_torch.GaLoreAdamW`` as a chain (HF ``AdamW`` heritage, ``correct_bias=True``).

    Per leaf labelled ``"galore"`` (2-D; see :func:`galore` for the projection), with
    ``t`` counted from 1 and ``R`` the projected gradient:

    * ``m <- b1 m + (1-b1) R``, ``v <- b2 v + (1-b2) R^2`` (kept across projector refreshes);
    * ``N = sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`` (eps before the bias
      correction, as HF);
    * ``p <- p - lr * scale * project_back(N)``;
    * then the decoupled decay on the UPDATED parameter: ``p <- p - lr * weight_decay * p``.

    Every other leaf gets the same AdamW without projection; leaves labelled ``"no_decay"`` get
    no weight decay. As an update: ``u = -lr * u_adam``, then ``u <- u - lr * wd * (p + u)``.

    Args:
        learning_rate: a float >= 0 or a schedule of the number of previous updates (see
            :func:`~functional_train.scale_by_learning_rate`); the weight decay uses the same
            ``lr`` (galore-torch: ``group["lr"]``). Default 1e-3.
        b1, b2: Adam decay rates in [0, 1) (galore-torch ``betas``, default (0.9, 0.999)).
        eps: > 0 added to ``sqrt(v)`` (default 1e-6, HF's).
        weight_decay: >= 0 (default 0.0).
        rank, update_proj_gap, scale, proj_type: GaLore's, see :func:`galore` (defaults 128,
            200, 0.25, ``"std"``).
        labels: a tree of strings with the structure of the params, or ``params -> tree``:
            ``"galore"`` for the leaves GaLore projects (2-D ones; a non-2-D leaf labelled
            ``"galore"`` gets plain AdamW with weight decay), ``"no_decay"`` for plain AdamW
            without weight decay, any other string for plain AdamW with weight decay (e.g.
            ``"decay"``). :func:`galore_param_labels` builds these from parameter names as
            Colossal-AI's ``get_galore_param_groups`` does. Default ``None``: every 2-D leaf
            ``"galore"``, every other leaf plain AdamW with weight decay.
        optim_bits: 32 (default) or 8: block-wise 8-bit Adam moments (the seed's 8-bit GaLore;
            see :func:`~functional_train.scale_by_adam`) for the leaves whose Adam state has at
            least ``min_8bit_size`` elements (the projected ``R`` for GaLore leaves, default
            4096 like bitsandbytes).
        refresh: ``"svd"`` (default, galore-torch's) or ``"randomized"`` (see :func:`galore`).

    State: a :class:`~functional_train.PartitionState` with the labels ``"galore"``,
    ``"decay"`` (and ``"no_decay"`` when ``labels`` is given), each a chain state; the GaLore
    one is ``(GaLoreState, ...)`` whose ``inner_state`` is the ``ScaleByAdamState`` over the
    projected shapes (galore-torch's ``exp_avg`` / ``exp_avg_sq``).

    Collectives: those of :func:`galore` (Adam, the learning rate and the decay are local).

    ``ft.step`` runs it leaf by leaf between projector refreshes on plain tensors in one process
    (:func:`functional_train.per_leaf.fused_galore_step`), with the chain's definitions: the
    same moments, and float32
    parameters bit for bit (half precision ones to the rounding of ``p + u``, done once).

    Raises:
        ValueError: out-of-range hyper-parameters (naming the argument); at update, a labels
            tree whose structure differs from the params.
        TypeError: a non-string label.
    """
    where = "galore_adamw"
    lr = V.learning_rate(learning_rate, where=where)
    wd = V.number("weight_decay", weight_decay, where=where, low=0.0)
    _hf_adam(b1, b2, eps, optim_bits, min_8bit_size)  # validates them now

    def tail(decayed: bool) -> list:
        txs = [scale_by_learning_rate(lr)]
        if decayed and V.nonzero(wd):
            txs.append(_decay_after_update(lr, wd))
        return txs

    transforms = {
        "galore": chain(
            galore(
                _hf_adam(b1, b2, eps, optim_bits, min_8bit_size),
                rank,
                update_proj_gap,
                scale,
                proj_type,
                refresh=refresh,
            ),
            *tail(True),
        ),
        "decay": chain(_hf_adam(b1, b2, eps, optim_bits, min_8bit_size), *tail(True)),
    }
    if labels is not None:
        transforms["no_decay"] = chain(
            _hf_adam(b1, b2, eps, optim_bits, min_8bit_size), *tail(False)
        )
    tx = partition(
        {k: _skip_when_empty(t) for k, t in transforms.items()}, _canonical_labels(labels)
    )
    galore_parts = transform_spec(transforms["galore"]).parts
    partitioned = transform_spec(tx).partition
    assert galore_parts is not None and partitioned is not None
    tail = tuple(E.spec_of_transform(t) for t in galore_parts[1:])
    assert all(isinstance(x, E.Elementwise) for x in tail)
    fused = FusedGaLore(
        galore_parts[0],
        tail,
        update_proj_gap,
        partitioned.labels_of,
        {k: _skip_when_empty(t) for k, t in transforms.items() if k != "galore"},
    )
    attach_spec(tx.update, fused=fused)
    return tx


@dataclasses.dataclass(frozen=True)
class FusedGaLore:
    """What ``galore_adamw`` is, for ``ft.step``'s per-leaf path (the ``fused`` of its
    partition's spec): the ``galore`` transform of the ``"galore"`` label, the parts of its
    tail, the projector refresh gap, the partition's labels and the other labels'
    transforms."""

    galore: GradientTransformation
    # the label's transforms after galore (the learning rate, the decay where there is one):
    # their elementwise parts, run with apply_updates per leaf
    tail: tuple
    update_proj_gap: int
    labels_of: Callable
    others: dict

    min_mean_bytes = MIN_MEAN_BYTES  # per-leaf Python work pays only on large leaves


def _skip_when_empty(tx: GradientTransformation) -> GradientTransformation:
    """``tx``, except that an update whose leaves are all ``None`` (a label with no leaf, or
    every leaf frozen) returns them and the state unchanged (``scale_by_adam`` cannot run on an
    empty list of leaves)."""

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if all(x is None for x in leaves_of(updates)):
            return updates, state
        return tx.update(updates, state, params, mesh=mesh, **extra)

    return GradientTransformation(tx.init, declare(update_fn, unreduced=True))


def galore_param_labels(
    params: PyTree, no_decay: Sequence[str] = ("bias", "LayerNorm.weight", "norm")
) -> PyTree:
    """Labels for :func:`galore_adamw` from dotted parameter paths, as Colossal-AI's
    ``get_galore_param_groups`` (``colossalai/nn/optimizer/galore.py``) groups parameters.

    Per leaf, by its dotted path (``layers.0.attn.wq.weight``; a flat dict of
    ``model.named_parameters()`` has those paths as keys):

    * ``"no_decay"`` if any string of ``no_decay`` is a substring of the path (Colossal-AI's
      weight-decay-free group; never projected);
    * else ``"galore"`` for a 2-D tensor (Colossal-AI's GaLore group, with weight decay);
    * else ``"decay"`` (plain AdamW with weight decay).

    Args:
        params: the parameter tree (``None`` leaves are labelled by path like others).
        no_decay: substrings marking weight-decay-free parameters. Colossal-AI uses
            ``("bias", "LayerNorm.weight")``; the default adds ``"norm"`` for Llama-style names
            (``input_layernorm.weight``, ``norm.weight``). Matching is case-sensitive.

    Returns a tree of strings with the structure of ``params``.

    Raises:
        TypeError: ``no_decay`` is a single string rather than a sequence of strings.
    """
    if isinstance(no_decay, str) or not all(isinstance(s, str) for s in no_decay):
        raise TypeError("galore_param_labels: no_decay must be a sequence of strings")
    leaves, treedef = tree_flatten(params)
    out = []
    for path, x in zip(tree_paths(params), leaves):
        if any(nd in path for nd in no_decay):
            out.append("no_decay")
        elif isinstance(x, torch.Tensor) and x.ndim == 2:
            out.append("galore")
        else:
            out.append("decay")
    return tree_unflatten(treedef, out)
