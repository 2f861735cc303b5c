"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the hidden 2-D weights.

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

Leaves with more than two dims are orthogonalised as the ``(shape[0], prod(shape[1:]))`` matrix
(a convolution's filters as rows, as Keller Jordan's reference flattens them) and ``A, B`` are
that matrix's dims.

Sharding: the momentum is elementwise on local shards. Newton-Schulz needs each whole matrix and
runs ONCE per matrix, on an owner rank (:mod:`functional_train.engine.owners`): the DTensor
leaves of a mesh are given owners balanced by their Newton-Schulz cost, so each of N ranks does
about 1/N of the work; the Nesterov updates' blocks go to the owners by one all-to-all (none
when every matrix is replicated: its owner holds it), each owner orthogonalises its global
matrices and one all-to-all sends every rank its block of the results back (on a sub-mesh of
more than one dim, one all-to-all per mesh dim each way). Blocks are copied, never computed on:
sharded equals unsharded bit for bit. Plain tensors (and meshes of one rank) need no
communication.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import _validate as V
from .base import GradientTransformation, chain, declare
from .combine import partition
from .engine.owners import run_at_owners
from .engine.view import prepare
from .engine.whole import gather_global, is_sharded, local_part, per_rank
from .hyperparams import injectable, value_of
from .optimizers import adamw
from .transforms import (
    ScalarOrSchedule,
    _cast_like,
    _check_state,
    _lerp,
    add_decayed_weights,
    reject_complex,
    scale_by_learning_rate,
    zero_count,
)
from .tree import PyTree, state_zeros_like, tree_flatten, tree_paths, tree_unflatten

__all__ = [
    "ScaleByMuonState",
    "scale_by_muon",
    "muon",
    "muon_param_labels",
    "MUON_EXCLUDE",
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


def _matrix_shape(shape: Sequence[int]) -> tuple:
    cols = 1
    for s in shape[1:]:  # (a loop: dynamo does not trace math.prod of a generator)
        cols *= int(s)
    return int(shape[0]), cols


def _orthogonalised_global(
    u: torch.Tensor, shape: tuple, coeffs, steps, eps, ns_dtype, adjust, out_dtype
) -> torch.Tensor:
    rows, cols = _matrix_shape(shape)
    o = newton_schulz(u.reshape(rows, cols), coeffs, steps, eps, ns_dtype)
    return (o.to(out_dtype) * _ratio(adjust, rows, cols)).reshape(shape)


_orthogonalised = per_rank(_orthogonalised_global)  # once per simulated rank


def _ns_cost(shape: Sequence[int]) -> float:
    """Multiply-adds of one Newton-Schulz iteration on the leaf's matrix (``m <= n``:
    ``X X^T``, ``A A``, ``B X``)."""
    rows, cols = _matrix_shape(shape)
    m, n = min(rows, cols), max(rows, cols)
    return float(2 * m * m * n + m * m * m)


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
) -> GradientTransformation:
    """Muon's direction (see the module docstring): momentum, Newton-Schulz orthogonalisation
    of each leaf's matrix, times the shape ratio of ``adjust_lr_fn``. Follow it with the
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

    Shapes and placements: every leaf must have at least 2 dims (more are flattened to
    ``(shape[0], -1)``); any placements; the output has the gradient's dtype and placements.
    Collectives per update: none for plain tensors. For the DTensor leaves of each mesh ONE
    ``all_to_all_single`` to the owners (none if every leaf is replicated) and ONE back, on a
    1-D mesh and on a mesh that is the world; on a sub-mesh of more dims (under a pipeline
    axis) and under torch.compile (which cannot read the mesh's rank layout), one per mesh dim
    that shards a leaf to the owners and at most ``2 ndim - 1`` back. Never more with more
    leaves. Each rank sends others about twice the bytes of its own blocks and runs about 1/N
    of the Newton-Schulz multiply-adds (the owners are balanced by ``2 m^2 n + m^3`` for an
    ``m x n`` matrix, ``m <= n``).

    Raises:
        ValueError: out-of-range hyper-parameters; at update, a leaf with fewer than 2 dims
            (naming its path) or a complex leaf; a state from another transform.
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

    def init_fn(params):
        return ScaleByMuonState(zero_count(params), state_zeros_like(params, mu_dtype))

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        _check_state(state, ScaleByMuonState, "scale_by_muon")
        b = prepare(updates, params, mesh, name="scale_by_muon")
        act = b.active
        if not act:
            return b.rebuild(b.locals), state._replace(count=state.count + 1)
        reject_complex(b, "scale_by_muon")
        shapes = {}
        for i in act:
            s = b.specs[i]
            shape = tuple(s.shape) if s is not None else tuple(b.locals[i].shape)
            if len(shape) < 2:
                raise ValueError(
                    f"scale_by_muon: leaf '{b.paths[i]}' has shape {shape}; Muon "
                    f"orthogonalises matrices (2 or more dims). Give vectors and scalars "
                    f"(biases, norms) to another transform: muon() labels them 'adam' "
                    f"(muon_param_labels)"
                )
            shapes[i] = shape
        g = [b.locals[i] for i in act]
        mu_all = b.state_locals(state.mu, "ScaleByMuonState.mu")
        beta_now, eps = value_of(beta), value_of(eps_arg)
        mu = _lerp(
            [mu_all[i] for i in act], _cast_like(g, [mu_all[i] for i in act]), 1.0 - beta_now
        )
        u = _lerp(_cast_like(g, mu), mu, beta_now) if nesterov else mu
        out = dict(zip(act, u))
        on_mesh = defaultdict(list)  # DTensor leaves: Newton-Schulz once per leaf, at its owner
        for i, gi in zip(act, g):
            s = b.specs[i]
            if s is None or s.mesh.size() == 1 or not _DISTRIBUTED:
                continue
            on_mesh[(s.mesh, out[i].dtype, gi.dtype)].append(i)
        for (_, _, dtype), idx in on_mesh.items():

            def fn(j, full, idx=idx, dtype=dtype):
                return _orthogonalised_global(
                    full, shapes[idx[j]], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, dtype
                )

            res = run_at_owners(
                [b.specs[i] for i in idx],
                [out[i] for i in idx],
                fn,
                dtype,
                [_ns_cost(shapes[i]) for i in idx],
            )
            out.update(zip(idx, res))
        done = {i for idx in on_mesh.values() for i in idx}
        if not _DISTRIBUTED:
            sharded = [i for i in act if is_sharded(b.specs[i])]
            full = gather_global(b, sharded, out) if sharded else {}
            for i, gi in zip(act, g):
                if i in full:
                    o = _orthogonalised(
                        full[i], shapes[i], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, gi.dtype
                    )
                    out[i] = local_part(o, b.specs[i].mesh, b.specs[i].placements)
                    done.add(i)
        for i, gi in zip(act, g):
            if i not in done:
                out[i] = _orthogonalised(
                    out[i], shapes[i], coeffs, ns_steps, eps, ns_dtype, adjust_lr_fn, gi.dtype
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

    Collectives: those of :func:`scale_by_muon` on its leaves and of ``adam`` on the others
    (none for plain tensors).

    Raises:
        ValueError: as :func:`scale_by_muon` and ``partition`` (a label other than ``"muon"`` /
            ``"adam"``, naming the leaf); a leaf labelled ``"muon"`` with fewer than 2 dims.
    """
    V.learning_rate(learning_rate, where="muon")
    V.number("weight_decay", weight_decay, where="muon", low=0.0)
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
) -> GradientTransformation:
    """:func:`muon`'s transform of the matrices, built by a factory of its own so that
    ``inject_hyperparams`` and :class:`~functional_train.TorchOptimizer` (its ``"muon"`` group:
    ``lr``, ``weight_decay``, ``beta``, ``eps``) can set its hyperparameters (defaults: as
    :func:`muon`'s, so that the integer ``ns_steps`` stays static)."""
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
        )
    ]
    if weight_decay:
        txs.append(add_decayed_weights(weight_decay))
    txs.append(scale_by_learning_rate(learning_rate))
    return chain(*txs)
