"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the hidden weight matrices.

Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024,
https://kellerjordan.github.io/posts/muon/, reference code github.com/KellerJordan/Muon), and
Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025, arXiv:2502.16982), whose
``match_rms_adamw`` learning-rate ratio and AdamW for the other parameters :func:`muon` follows.
The numbers are ``torch.optim.Muon``'s (torch 2.9+):

* momentum ``buf <- lerp(buf, g, 1 - beta)``; Nesterov ``u = lerp(g, buf, beta)``, else
  ``u = buf``;
* ``O = NS(u)``: ``u`` in ``ns_dtype`` (bfloat16 by default), transposed when it has more rows
  than columns, divided by ``max(||u||_F, eps)``, then ``ns_steps`` quintic iterations
  ``A = X X^T; B = b A + c A A; X = a X + B X`` with ``(a, b, c) = ns_coefficients``, and
  transposed back;
* the update ``ratio * O`` in the gradient's dtype, ``ratio = sqrt(max(1, A / B))`` (``None`` /
  ``"original"``, Keller Jordan's) or ``0.2 * sqrt(max(A, B))`` (``"match_rms_adamw"``,
  Moonlight's) for an ``A x B`` matrix; the learning rate and decoupled weight decay follow in
  :func:`muon`'s chain (``param - lr * (ratio * O + weight_decay * param)``).

Which axes of a leaf form its matrix is given by :class:`MuonDimensionNumbers` (optax's
``optax.contrib.MuonDimensionNumbers``, in torch's ``(out, in)`` weight layout): the output
axes are the ``A`` rows, the reduction axes the ``B`` columns, and every other axis is a batch
axis, each of whose indices is a matrix orthogonalised on its own (stacked experts
``(E, d_out, d_in)``: E matrices, as every reference trains experts). The default takes the
last two axes as the matrix and the leading ones as batch axes; a convolution's filters
``(out, in, kh, kw)`` are one ``out x (in kh kw)`` matrix with
``MuonDimensionNumbers(reduction_axis=(1, 2, 3), output_axis=0)``, as Keller Jordan's reference
flattens them.

Sharding: the momentum is elementwise on local shards. Newton-Schulz needs each whole matrix.
A DTensor leaf split over the mesh on batch axes only holds whole matrices on every rank: each
rank orthogonalises its own (stacked experts sharded over an expert-parallel mesh dim: no
communication). Every other DTensor leaf is orthogonalised ONCE, on an owner rank
(:mod:`functional_train.engine.owners`): the leaves of a mesh are given owners balanced by
their Newton-Schulz cost, so each of N ranks does about 1/N of the work; the Nesterov updates'
blocks go to the owners by one all-to-all (none when every matrix is replicated: its owner
holds it), each owner orthogonalises its global leaves and one all-to-all sends every rank its
block of the results back (on a sub-mesh of more than one dim, one all-to-all per mesh dim each
way). Blocks are copied, never computed on, and each matrix of a leaf goes through the same
2-D iteration whatever the layout: sharded equals unsharded bit for bit. Plain tensors (and
meshes of one rank) need no communication.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Shard

from . import _validate as V
from . import leaves as L
from .base import GradientTransformation, chain, check_state, declare
from .combine import PerLeaf, leaf_values, partition
from .engine.owners import run_at_owners
from .engine.view import prepare
from .engine.whole import gather_global, is_sharded, local_part, per_rank
from .hyperparams import injectable, value_of
from .optimizers import adamw
from .transforms import (
    ScalarOrSchedule,
    add_decayed_weights,
    reject_complex,
    scale_by_learning_rate,
    zero_count,
)
from .tree import (
    PyTree,
    leaves_of,
    state_zeros_like,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)

__all__ = [
    "ScaleByMuonState",
    "scale_by_muon",
    "muon",
    "muon_param_labels",
    "MUON_EXCLUDE",
    "MuonDimensionNumbers",
    "newton_schulz",
    "NS_COEFFICIENTS",
]


NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
_ADJUST = (None, "original", "match_rms_adamw")


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`: ``count`` (int64, 0-dim) and the momentum buffer ``mu``
    (params-shaped, float32 by default, placements of the parameter)."""

    count: torch.Tensor
    mu: Any


def newton_schulz(
    x: torch.Tensor,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of the 2-D ``x`` (``torch.optim.Muon``'s
    ``_zeropower_via_newtonschulz`` with its dtype a parameter), in ``ns_dtype``: an
    approximation of ``U V^T`` for ``x = U S V^T`` whose singular values land in about
    ``(0.7, 1.2)`` with the default coefficients. ``x`` is not modified.

    Raises:
        ValueError: ``x`` is not 2-D.
    """
    if x.ndim != 2:
        raise ValueError(f"newton_schulz: expected a 2-D matrix, got shape {tuple(x.shape)}")
    a, b, c = ns_coefficients
    y = x.to(ns_dtype)
    tall = y.size(0) > y.size(1)
    if tall:
        y = y.T
    n = y.norm()
    y = y / n.clamp(min=eps.to(n.dtype) if isinstance(eps, torch.Tensor) else eps)
    for _ in range(ns_steps):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def _ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


@dataclasses.dataclass(frozen=True)
class MuonDimensionNumbers:
    """Which axes of a leaf form the matrix that Muon orthogonalises (optax's
    ``optax.contrib.MuonDimensionNumbers``, in torch's weight layout).

    ``nn.Linear`` stores its weight as ``(out, in)`` (``y = x W^T``), so the defaults are the
    last axis as the reduction axis and the one before it as the output axis (optax's defaults,
    ``reduction_axis=0, output_axis=1``, are for JAX's ``(in, out)``; a ``transformers``
    ``Conv1D`` weight such as GPT-2's ``c_attn`` is ``(in, out)`` too, and takes
    ``MuonDimensionNumbers(reduction_axis=0, output_axis=1)``).

    Attributes:
        reduction_axis: the axis, or axes, contracted with the layer's input: their sizes
            multiply to the matrix's ``B`` columns (fan-in). Default ``-1``.
        output_axis: the axis, or axes, of the layer's output: their sizes multiply to the
            matrix's ``A`` rows (fan-out). Default ``-2``.

    Every other axis is a batch axis: each index of the batch axes is one ``A x B`` matrix,
    orthogonalised on its own with its own ``ratio`` of ``A`` and ``B``. Axes may be negative
    (counted from the end); the axes of a leaf's matrix keep their order within ``A`` and ``B``.
    Examples: stacked experts ``(E, d_out, d_in)`` with the default: ``E`` matrices
    ``d_out x d_in``; a convolution's filters ``(out, in, kh, kw)`` with
    ``reduction_axis=(1, 2, 3), output_axis=0``: one ``out x (in kh kw)`` matrix (Keller
    Jordan's reference flattens them so).

    Raises:
        TypeError: an axis that is not an int (a bool is not one).
        ValueError: an empty sequence of axes. Axes that a leaf does not have, or that name one
            axis twice, are reported by :func:`scale_by_muon` with the leaf's path.
    """

    reduction_axis: int | tuple[int, ...] = -1
    output_axis: int | tuple[int, ...] = -2

    def __post_init__(self):
        for name in ("reduction_axis", "output_axis"):
            value = getattr(self, name)
            axes = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(axes, (tuple, list)) or not all(
                isinstance(a, int) and not isinstance(a, bool) for a in axes
            ):
                raise TypeError(
                    f"MuonDimensionNumbers: {name} must be an int or a sequence of ints, "
                    f"got {value!r}"
                )
            if not axes:
                raise ValueError(f"MuonDimensionNumbers: {name} must name at least one axis")
            object.__setattr__(self, name, tuple(axes))


def _matrix_axes(dims: MuonDimensionNumbers, shape: Sequence[int], path: str) -> tuple:
    """``(batch, output, reduction)`` axes (non-negative) of a leaf of ``shape`` under
    ``dims``.

    Raises:
        ValueError: an axis the leaf does not have, or one named twice (naming the leaf)."""
    ndim = len(shape)
    seen: dict = {}
    for name in ("output_axis", "reduction_axis"):
        for a in getattr(dims, name):
            if not -ndim <= a < ndim:
                raise ValueError(
                    f"scale_by_muon: leaf '{path}' has shape {tuple(shape)}; {dims} names "
                    f"axis {a} in {name}, which a {ndim}-dim leaf does not have"
                )
            if a % ndim in seen:
                raise ValueError(
                    f"scale_by_muon: leaf '{path}' has shape {tuple(shape)}; {dims} names "
                    f"its axis {a % ndim} twice ({seen[a % ndim]} and {name}): the output, "
                    f"reduction and batch axes must be distinct"
                )
            seen[a % ndim] = name
    out = tuple(a % ndim for a in dims.output_axis)
    red = tuple(a % ndim for a in dims.reduction_axis)
    return tuple(a for a in range(ndim) if a not in seen), out, red


def _size(shape: Sequence[int], axes: Sequence[int]) -> int:
    n = 1
    for a in axes:  # (a loop: dynamo does not trace math.prod of a generator)
        n *= int(shape[a])
    return n


def _orthogonalised_global(
    u: torch.Tensor, axes: tuple, coeffs, steps, eps, ns_dtype, adjust, out_dtype
) -> torch.Tensor:
    """``ratio * NS`` of every matrix of ``u`` (``axes``: :func:`_matrix_axes`), each one
    through the 2-D :func:`newton_schulz` on its own, so that a block of whole matrices gives
    the same bits as the whole leaf. ``u``'s shape is read from ``u`` (a rank's block of
    whole matrices when only batch axes are sharded)."""
    batch, out, red = axes
    shape = tuple(u.shape)
    perm = batch + out + red
    moved = perm != tuple(range(len(shape)))
    x = u.permute(perm) if moved else u
    rows, cols = _size(shape, out), _size(shape, red)
    m = x.reshape(_size(shape, batch), rows, cols)
    ratio = _ratio(adjust, rows, cols)
    o = [
        newton_schulz(m[k], coeffs, steps, eps, ns_dtype).to(out_dtype) * ratio
        for k in range(m.size(0))
    ]
    if not o:  # a block without matrices (an uneven shard of the batch axes)
        return u.new_empty(shape, dtype=out_dtype)
    res = (o[0] if len(o) == 1 else torch.stack(o)).reshape(x.shape)
    if moved:
        res = res.permute([perm.index(a) for a in range(len(shape))]).contiguous()
    return res


_orthogonalised = per_rank(_orthogonalised_global)  # once per simulated rank


def _ns_cost(shape: Sequence[int], axes: tuple | None = None) -> float:
    """Multiply-adds of one Newton-Schulz iteration on the leaf's matrices (``m <= n``:
    ``X X^T``, ``A A``, ``B X``, per matrix; ``axes``: :func:`_matrix_axes`, default the last
    two axes)."""
    if axes is None:
        n = len(shape)
        axes = (tuple(range(n - 2)), (n - 2,), (n - 1,))
    batch, out, red = axes
    rows, cols = _size(shape, out), _size(shape, red)
    m, n = min(rows, cols), max(rows, cols)
    return float(_size(shape, batch) * (2 * m * m * n + m * m * m))


def _holds_whole_matrices(spec, batch: tuple) -> bool:
    """Whether the DTensor leaf of ``spec`` is split over its mesh and only on batch axes:
    then every rank's block is made of whole matrices."""
    ndim = len(spec.shape)
    split = [
        p.dim % ndim
        for d, p in enumerate(spec.placements)
        if isinstance(p, Shard) and spec.mesh.size(d) > 1
    ]
    return bool(split) and all(a in batch for a in split)


class _LeafDimensionNumbers:
    """Each leaf's :class:`MuonDimensionNumbers` from ``weight_dimension_numbers`` (one for
    every leaf; a params-shaped tree of them, ``None`` for the default; or a function of the
    params returning such a tree, resolved once per params structure and leaf shapes). Not
    callable, so that ``inject_hyperparams`` (and :class:`~functional_train.TorchOptimizer`)
    does not take a function given here for a schedule."""

    __slots__ = ("spec", "_per_leaf")

    def __init__(self, spec):
        if isinstance(spec, _LeafDimensionNumbers):
            spec = spec.spec
        self.spec = spec
        self._per_leaf = (
            None
            if spec is None or isinstance(spec, MuonDimensionNumbers)
            else PerLeaf(self._resolve, "scale_by_muon")
        )

    def _resolve(self, tree) -> list:
        values = leaf_values(self.spec, tree, "scale_by_muon: weight_dimension_numbers")
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, MuonDimensionNumbers):
                raise TypeError(
                    f"scale_by_muon: weight_dimension_numbers leaf '{tree_paths(tree)[i]}' must "
                    f"be a MuonDimensionNumbers or None, got {type(v).__name__}"
                )
        leaves = leaves_of(tree)
        return [_default_dimension_numbers(x) if v is None else v for v, x in zip(values, leaves)]

    def of(self, treedef, leaves: Sequence) -> list | MuonDimensionNumbers:
        """Per leaf of the tree ``(treedef, leaves)`` its dimension numbers (or the one for
        every leaf)."""
        if self.spec is None:
            return [_default_dimension_numbers(x) for x in leaves]
        if self._per_leaf is None:
            return self.spec
        return self._per_leaf(tree_unflatten(treedef, leaves))


_MATRIX = MuonDimensionNumbers()


def _default_dimension_numbers(x) -> MuonDimensionNumbers:
    """The default for a leaf: its last two axes (leading axes batch axes: stacked experts
    ``(E, d_out, d_in)``) up to 3 dims; from 4 dims (a convolution's filters ``(out, in, kh,
    kw)``) axis 0 against all the others, as Keller Jordan's reference flattens them."""
    ndim = getattr(x, "ndim", 2)
    if ndim < 4:
        return _MATRIX
    return MuonDimensionNumbers(reduction_axis=tuple(range(1, ndim)), output_axis=0)


# Newton-Schulz of DTensor leaves at owner ranks (engine/owners.py); False: every rank gathers
# every sharded matrix and orthogonalises it (the scheme benchmarks/bench_muon.py compares with)
_DISTRIBUTED = True


def scale_by_muon(
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.bfloat16,
    adjust_lr_fn: str | None = None,
    *,
    mu_dtype: torch.dtype | None = None,
    weight_dimension_numbers: MuonDimensionNumbers
    | PyTree
    | Callable[[PyTree], PyTree]
    | None = None,
) -> GradientTransformation:
    """Muon's direction (see the module docstring): momentum, Newton-Schulz orthogonalisation
    of each matrix of each leaf, times the shape ratio of ``adjust_lr_fn``. Follow it with the
    learning rate (and ``add_decayed_weights`` for torch's decoupled decay), or use
    :func:`muon`.

    Args:
        beta: momentum in [0, 1) (torch's ``momentum``, default 0.95).
        nesterov: Nesterov momentum (default ``True``).
        ns_coefficients: the quintic's ``(a, b, c)`` (default ``(3.4445, -4.775, 2.0315)``).
        ns_steps: iterations, 1 to 99 (default 5).
        eps: floor of the Frobenius norm the matrix is divided by (default 1e-7).
        ns_dtype: dtype of the iteration (default ``torch.bfloat16``, torch's; ``torch.float64``
            for reference arithmetic).
        adjust_lr_fn: ``None`` / ``"original"`` (``sqrt(max(1, A/B))``) or
            ``"match_rms_adamw"`` (``0.2 sqrt(max(A, B))``).
        mu_dtype: dtype of the momentum buffer (default float32, or the params' when wider).
        weight_dimension_numbers: which axes of each leaf are its matrix (optax's name):
            ``None`` (default): ``MuonDimensionNumbers()`` for leaves of 2 or 3 dims (the last
            two axes are the ``A x B`` matrix, a leading axis is a batch axis: stacked experts)
            and axis 0 against all the others from 4 dims (a convolution's filters ``(out, in,
            kh, kw)`` as one ``out x (in kh kw)`` matrix, as Keller Jordan's reference flattens
            them); one
            :class:`MuonDimensionNumbers` for every leaf; a tree with the structure of the
            params (inside :func:`muon` and ``partition``: of all the params) whose leaves are
            :class:`MuonDimensionNumbers` or ``None`` (the default); or a function of the
            params returning such a tree (called once per params structure and leaf shapes).
            Under ``inject_hyperparams(scale_by_muon)`` a function here would be taken for a
            schedule: name it in ``static_args`` (:func:`muon` passes it safely).

    Shapes and placements: every leaf must have at least 2 dims; any placements; the output has
    the gradient's dtype and placements. Collectives per update: none for plain tensors, nor for
    DTensor leaves split on batch axes only (each rank orthogonalises the whole matrices it
    holds). For the other DTensor leaves of each mesh ONE ``all_to_all_single`` to the owners
    (none if every such leaf is replicated) and ONE back, on a 1-D mesh and on a mesh that is
    the world; on a sub-mesh of more dims (under a pipeline axis) and under torch.compile
    (which cannot read the mesh's rank layout), one per mesh dim that shards a leaf to the
    owners and at most ``2 ndim - 1`` back. Never more with more leaves. Each rank sends others
    about twice the bytes of its own blocks and runs about 1/N of the Newton-Schulz
    multiply-adds (the owners are balanced by ``2 m^2 n + m^3`` per ``m x n`` matrix,
    ``m <= n``, times the leaf's number of matrices).

    Raises:
        ValueError: out-of-range hyper-parameters; at init and update, a leaf with fewer than 2
            dims, or ``weight_dimension_numbers`` naming an axis the leaf does not have or one
            axis twice (naming the leaf's path); a tree of them without the params' structure;
            at update, a complex leaf; a state from another transform.
        TypeError: a ``weight_dimension_numbers`` tree leaf that is neither a
            :class:`MuonDimensionNumbers` nor ``None`` (naming its path).
    """
    beta = V.beta("beta", beta, where="scale_by_muon")
    eps_arg = V.number("eps", eps, where="scale_by_muon", low=0.0)
    ns_steps = V.integer("ns_steps", ns_steps, where="scale_by_muon", low=1)
    if ns_steps >= 100:
        raise ValueError(f"scale_by_muon: ns_steps must be below 100, got {ns_steps}")
    coeffs = tuple(float(c) for c in ns_coefficients)
    if len(coeffs) != 3:
        raise ValueError(
            f"scale_by_muon: ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients!r}"
        )
    if adjust_lr_fn not in _ADJUST:
        raise ValueError(
            f"scale_by_muon: adjust_lr_fn must be one of {_ADJUST}, got {adjust_lr_fn!r}"
        )
    if not isinstance(ns_dtype, torch.dtype) or not ns_dtype.is_floating_point:
        raise ValueError(
            f"scale_by_muon: ns_dtype must be a floating torch.dtype, got {ns_dtype!r}"
        )
    dims_of = _LeafDimensionNumbers(weight_dimension_numbers)

    def matrix_axes(treedef, leaves, shapes, paths, active) -> dict:
        """Per active leaf ``i`` (of global shape ``shapes[i]``) its ``(batch, output,
        reduction)`` axes."""
        dims = dims_of.of(treedef, leaves)
        out = {}
        for i in active:
            shape = shapes[i]
            if len(shape) < 2:
                raise ValueError(
                    f"scale_by_muon: leaf '{paths[i]}' has shape {shape}; Muon "
                    f"orthogonalises matrices (2 or more dims). Give vectors and scalars "
                    f"(biases, norms) to another transform: muon() labels them 'adam' "
                    f"(muon_param_labels)"
                )
            d = dims if isinstance(dims, MuonDimensionNumbers) else dims[i]
            out[i] = _matrix_axes(d, shape, paths[i])
        return out

    def init_fn(params):
        leaves, treedef = tree_flatten(params)
        active = [i for i, x in enumerate(leaves) if x is not None]
        if active:  # (checks the leaves and resolves their dimension numbers eagerly)
            shapes = {i: tuple(leaves[i].shape) for i in active}
            matrix_axes(treedef, leaves, shapes, tree_paths(params), active)
        return ScaleByMuonState(zero_count(params), state_zeros_like(params, mu_dtype))

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        check_state(state, ScaleByMuonState, "scale_by_muon")
        b = prepare(updates, params, mesh, name="scale_by_muon")
        act = b.active
        if not act:
            return b.rebuild(b.locals), state._replace(count=state.count + 1)
        reject_complex(b, "scale_by_muon")
        shapes = {
            i: tuple(b.specs[i].shape if b.specs[i] is not None else b.locals[i].shape) for i in act
        }
        axes = matrix_axes(b.treedef, b.updates, shapes, b.paths, act)
        g = [b.locals[i] for i in act]
        mu_all = b.state_locals(state.mu, "ScaleByMuonState.mu")
        beta_now, eps = value_of(beta), value_of(eps_arg)
        mu = L.lerp(
            [mu_all[i] for i in act], L.cast_like(g, [mu_all[i] for i in act]), 1.0 - beta_now
        )
        u = L.lerp(L.cast_like(g, mu), mu, beta_now) if nesterov else mu
        out = dict(zip(act, u))
        # DTensor leaves split on batch axes only: each rank's block holds whole matrices
        local = {
            i
            for i in act
            if b.specs[i] is not None and _holds_whole_matrices(b.specs[i], axes[i][0])
        }
        on_mesh = defaultdict(list)  # other DTensor leaves: Newton-Schulz once, at the owner
        for i, gi in zip(act, g):
            s = b.specs[i]
            if s is None or s.mesh.size() == 1 or not _DISTRIBUTED or i in local:
                continue
            on_mesh[(s.mesh, out[i].dtype, gi.dtype)].append(i)
        for (_, _, dtype), idx in on_mesh.items():

            def fn(j, full, idx=idx, dtype=dtype):
                return _orthogonalised_global(
                    full, axes[idx[j]], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, dtype
                )

            res = run_at_owners(
                [b.specs[i] for i in idx],
                [out[i] for i in idx],
                fn,
                dtype,
                [_ns_cost(shapes[i], axes[i]) for i in idx],
            )
            out.update(zip(idx, res))
        done = {i for idx in on_mesh.values() for i in idx}
        if not _DISTRIBUTED:
            sharded = [i for i in act if is_sharded(b.specs[i]) and i not in local]
            full = gather_global(b, sharded, out) if sharded else {}
            for i, gi in zip(act, g):
                if i in full:
                    o = _orthogonalised(
                        full[i], axes[i], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, gi.dtype
                    )
                    out[i] = local_part(o, b.specs[i].mesh, b.specs[i].placements)
                    done.add(i)
        for i, gi in zip(act, g):
            if i not in done:
                out[i] = _orthogonalised(
                    out[i], axes[i], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, gi.dtype
                )
        out = [out[i] for i in act]
        new_mu = b.state_tree(state.mu, "ScaleByMuonState.mu", mu)
        return b.rebuild_active(out), ScaleByMuonState(state.count + 1, new_mu)

    return GradientTransformation(init_fn, declare(update_fn, view=True))


#: :func:`muon_param_labels`'s default ``exclude``: the embeddings (HF Llama's
#: ``model.embed_tokens``, BERT's and ViT's ``embeddings`` module with the ``word_`` /
#: ``position_`` / ``token_type_embeddings`` in it, GPT-2's ``wte`` / ``wpe``, torchtitan's
#: ``tok_embeddings``, timm's ``pos_embed`` / ``patch_embed`` / ``cls_token``) and the output
#: projections and classifier heads (HF's ``lm_head`` and ``classifier``, timm's ``head``,
#: torchtitan's final ``output`` Linear: ``output.weight``, so that BERT's hidden
#: ``layer.N.output.dense`` is not excluded).
MUON_EXCLUDE = (
    "embed",
    "embed_tokens",
    "embeddings",
    "tok_embeddings",
    "word_embeddings",
    "position_embeddings",
    "token_type_embeddings",
    "wte",
    "wpe",
    "pos_embed",
    "patch_embed",
    "cls_token",
    "lm_head",
    "classifier",
    "head",
    "output.weight",
)


def muon_param_labels(params: PyTree, exclude: Sequence[str] = MUON_EXCLUDE) -> PyTree:
    """Labels for :func:`muon`: ``"muon"`` for the hidden weight matrices, ``"adam"`` for the
    rest, as Keller Jordan and Moonlight split a model (AdamW for the embeddings, the output
    head and the gains and biases).

    Per leaf, by its dotted path (``layers.0.attention.wq.weight``; a flat dict of
    ``model.named_parameters()`` has those paths as keys), split at ``.`` into components:
    ``"adam"`` if it has fewer than 2 dims (biases, norm scales), or if an entry of ``exclude``,
    itself split at ``.``, equals one component or a run of consecutive components of the path
    (exact, case-sensitive matches: ``"head"`` excludes ``head.weight`` and ``heads.head.weight``
    but not ``multihead_attn.in_proj_weight``; ``"output.weight"`` excludes torchtitan's final
    projection ``output.weight`` but not BERT's hidden ``layer.0.output.dense.weight``); else
    ``"muon"``. The default is :data:`MUON_EXCLUDE`: ``embed``, ``embed_tokens``,
    ``embeddings``, ``tok_embeddings``, ``word_embeddings``, ``position_embeddings``,
    ``token_type_embeddings``, ``wte``, ``wpe``, ``pos_embed``, ``patch_embed``,
    ``cls_token``, ``lm_head``, ``classifier``, ``head``, ``output.weight``. A model whose
    embedding or head is named otherwise (T5's ``shared``, a ResNet's ``fc``) needs its name
    added: ``exclude=MUON_EXCLUDE + ("fc",)``.

    Returns a tree of strings with the structure of ``params``.

    Raises:
        TypeError: ``exclude`` is a single string rather than a sequence of strings.
        ValueError: an entry of ``exclude`` with an empty component (``""``, ``"a..b"``,
            ``".weight"``).
    """
    if isinstance(exclude, str) or not all(isinstance(s, str) for s in exclude):
        raise TypeError("muon_param_labels: exclude must be a sequence of strings")
    runs = [tuple(e.split(".")) for e in exclude]
    for e, run in zip(exclude, runs):
        if not all(run):
            raise ValueError(
                f"muon_param_labels: exclude entry {e!r} has an empty component; entries are "
                f"module or parameter names, or runs of them joined by '.'"
            )
    leaves, treedef = tree_flatten(params)
    out = []
    for path, x in zip(tree_paths(params), leaves):
        parts = tuple(path.split("."))
        hidden = (
            isinstance(x, torch.Tensor)
            and x.ndim >= 2
            and not any(parts[k : k + len(run)] == run for run in runs for k in range(len(parts)))
        )
        out.append("muon" if hidden else "adam")
    return tree_unflatten(treedef, out)


@injectable(tensors=("beta", "eps", "weight_decay"))
def muon(
    learning_rate: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.bfloat16,
    adjust_lr_fn: str | None = None,
    *,
    adam: GradientTransformation | None = None,
    param_labels: PyTree | Callable[[PyTree], PyTree] | None = None,
    mu_dtype: torch.dtype | None = None,
    weight_dimension_numbers: MuonDimensionNumbers
    | PyTree
    | Callable[[PyTree], PyTree]
    | None = None,
) -> GradientTransformation:
    """Muon for the hidden weight matrices and AdamW for everything else, through
    :func:`~functional_train.partition` (as Moonlight and Kimi train).

    The Muon leaves take ``chain(scale_by_muon(beta, nesterov, ...), add_decayed_weights(
    weight_decay), scale_by_learning_rate(learning_rate))``: ``torch.optim.Muon``'s step with
    the same arguments (``momentum`` is ``beta``), ``param - lr * (ratio * O + weight_decay *
    param)``. The others take ``adam`` (default ``adamw(learning_rate,
    weight_decay=weight_decay)``; with ``adjust_lr_fn="match_rms_adamw"`` both can share a
    learning rate tuned for AdamW, Moonlight's point).

    Args:
        learning_rate, weight_decay, beta, nesterov, ns_coefficients, ns_steps, eps, ns_dtype,
            adjust_lr_fn, mu_dtype: as :func:`scale_by_muon` and ``torch.optim.Muon`` (defaults
            lr 1e-3, weight decay 0.1, momentum 0.95, Nesterov).
        adam: the transform of the non-Muon leaves.
        param_labels: ``"muon"`` / ``"adam"`` per leaf, a tree or a function of the params
            (default :func:`muon_param_labels`).
        weight_dimension_numbers: the matrix axes of the Muon leaves, as
            :func:`scale_by_muon`'s (default: the last two axes up to 3 dims, a leading axis
            a batch axis; axis 0 against the others from 4 dims); a tree has the structure
            of all the params (the ``"adam"`` leaves' entries are not
            used), a function receives the params with ``None`` for the ``"adam"`` leaves.
            :class:`~functional_train.TorchOptimizer` takes a function as it is; under
            ``inject_hyperparams(muon)`` a function (here as in ``param_labels``) must be
            named in ``static_args``, or it is taken for a schedule.

    Collectives: those of :func:`scale_by_muon` on its leaves and of ``adam`` on the others
    (none for plain tensors).

    Raises:
        ValueError: as :func:`scale_by_muon` and ``partition`` (a label other than ``"muon"`` /
            ``"adam"``, naming the leaf); a leaf labelled ``"muon"`` with fewer than 2 dims.
    """
    V.learning_rate(learning_rate, where="muon")
    weight_decay = V.number("weight_decay", weight_decay, where="muon", low=0.0)
    matrices = _muon_matrices(
        learning_rate,
        weight_decay,
        beta,
        nesterov,
        ns_coefficients,
        ns_steps,
        eps,
        ns_dtype,
        adjust_lr_fn,
        mu_dtype,
        _LeafDimensionNumbers(weight_dimension_numbers),
    )
    other = adamw(learning_rate, weight_decay=weight_decay) if adam is None else adam
    return partition(
        {"muon": matrices, "adam": other},
        muon_param_labels if param_labels is None else param_labels,
    )


@injectable(tensors=("beta", "eps", "weight_decay"))
def _muon_matrices(
    learning_rate: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype = torch.bfloat16,
    adjust_lr_fn: str | None = None,
    mu_dtype: torch.dtype | None = None,
    weight_dimension_numbers: _LeafDimensionNumbers | None = None,
) -> GradientTransformation:
    """:func:`muon`'s transform of the matrices, built by a factory of its own so that
    ``inject_hyperparams`` and :class:`~functional_train.TorchOptimizer` (its ``"muon"`` group:
    ``lr``, ``weight_decay``, ``beta``, ``eps``) can set its hyperparameters (defaults: as
    :func:`muon`'s, so that the integer ``ns_steps`` stays static; the dimension numbers come
    wrapped, so that a function of the params is not taken for a schedule)."""
    txs = [
        scale_by_muon(
            beta,
            nesterov,
            ns_coefficients,
            ns_steps,
            eps,
            ns_dtype,
            adjust_lr_fn,
            mu_dtype=mu_dtype,
            weight_dimension_numbers=weight_dimension_numbers,
        )
    ]
    if V.nonzero(weight_decay):
        txs.append(add_decayed_weights(weight_decay))
    txs.append(scale_by_learning_rate(learning_rate))
    return chain(*txs)
