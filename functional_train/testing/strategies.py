"""Hypothesis strategies for sharded-vs-unsharded property tests.

Needs ``hypothesis`` (the ``test`` extra: ``pip install functional-train[test]``);
``functional_train.testing`` imports this module only when one of its names is used.

Everything here draws small, *readable* examples: mesh shapes are tuples, placements are tuples
of ``Shard`` / ``Replicate``, and tensor values come from a drawn integer seed (hypothesis
shrinks the seed, the shapes and the placements, not individual elements), so a failing example
prints as a few lines and is rebuilt bit for bit.

The building blocks:

* :func:`mesh_shapes`: 1-D and 2-D device-mesh shapes of up to 8 simulated ranks;
* :func:`placements`, :func:`leaf_placements`, :func:`tree_placements`: ``Shard(d)`` on any dim
  (negative dims included), ``Replicate()``, every combination on 2-D meshes (nested
  ``[Shard(0), Shard(0)]`` included), or ``None`` for a plain tensor leaf;
* :func:`shapes`, :func:`tensors`, :func:`pytrees`: leaves of 0 to 3 dims whose sizes mostly do
  not divide the mesh (uneven, even empty shards), given dtypes, ``None`` leaves;
* :func:`gradients`, :func:`gradients_like`: gradients of controllable rank (rank-1 gradients
  hide bugs in factored second-moment statistics);
* :func:`sharded_cases`: all of the above in one :class:`ShardedCase`, ready for
  ``assert_sharded_equivalent(tx, **case)``, optionally with all-zero gradient leaves (the parts
  of a model that got no signal at a step: an expert that received no tokens, an unused layer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch.distributed.tensor import Replicate, Shard

__all__ = [
    "mesh_shapes",
    "placements",
    "leaf_placements",
    "tree_placements",
    "shapes",
    "tensors",
    "gradients",
    "gradients_like",
    "pytrees",
    "ShardedCase",
    "sharded_cases",
]

IntOrStrategy = int | None | SearchStrategy
FloatOrStrategy = float | SearchStrategy

DEFAULT_SIZES = (1, 2, 3, 4, 5, 7)
"""Default dim sizes: most do not divide 2, 4 or 8 (uneven shards), some are smaller than the
mesh (empty shards on the last ranks)."""


def _as_strategy(x: Any) -> SearchStrategy:
    return x if isinstance(x, SearchStrategy) else st.just(x)


# =============================================================================================
# meshes and placements
# =============================================================================================
def mesh_shapes(
    *, max_ranks: int = 8, ndims: Sequence[int] = (1, 2), min_dim_size: int = 2
) -> SearchStrategy[tuple]:
    """Device-mesh shapes: tuples of ``len in ndims`` dim sizes ``>= min_dim_size`` whose product
    (the number of simulated ranks) is at most ``max_ranks``.

    The defaults give ``(2,) ... (8,)`` and ``(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)``; shapes
    shrink towards the fewest ranks. Odd sizes (3, 5, 7) make most leaves shard unevenly.

    Raises:
        ValueError: no shape fits (``ndims`` empty or outside 1..3, ``max_ranks`` too small).
    """
    out = []
    for nd in ndims:
        if nd not in (1, 2, 3):
            raise ValueError(f"mesh_shapes: ndims must be among 1, 2, 3, got {nd}")

        def rec(prefix):
            if len(prefix) == nd:
                out.append(tuple(prefix))
                return
            for s in range(min_dim_size, max_ranks + 1):
                if math.prod(prefix) * s * min_dim_size ** (nd - len(prefix) - 1) <= max_ranks:
                    rec(prefix + [s])

        rec([])
    if not out:
        raise ValueError(
            f"mesh_shapes: no mesh of {tuple(ndims)} dims with dims >= "
            f"{min_dim_size} has at most {max_ranks} ranks"
        )
    out.sort(key=lambda s: (math.prod(s), len(s), s))
    return st.sampled_from(out)


_mesh_shapes = mesh_shapes


def _shard_choices(ndim: int, negative_dims: bool) -> list:
    out = [Shard(d) for d in range(ndim)]
    if negative_dims and ndim:
        out.append(Shard(-1))
        if ndim >= 3:
            out.append(Shard(-2))
    return out


def placements(
    ndim: int,
    mesh_ndim: int,
    *,
    replicate: bool = True,
    nested: bool = True,
    negative_dims: bool = True,
) -> SearchStrategy[tuple]:
    """Placements of one DTensor leaf with ``ndim`` tensor dims on a mesh of ``mesh_ndim`` dims:
    a tuple of ``mesh_ndim`` placements, each ``Replicate()`` or ``Shard(d)`` for any tensor dim
    ``d`` (``Shard(-1)`` too when ``negative_dims``).

    Args:
        replicate: allow ``Replicate()`` (always used for 0-dim leaves, which cannot be sharded).
        nested: allow two mesh dims to shard the same tensor dim (``[Shard(0), Shard(0)]``).

    Shrinks towards ``Replicate()`` everywhere, then ``Shard(0)``.
    """
    choices = ([Replicate()] if replicate or ndim == 0 else []) + _shard_choices(
        ndim, negative_dims
    )

    def ok(pl):
        if nested or ndim == 0:
            return True
        dims = [p.dim % ndim for p in pl if isinstance(p, Shard)]
        return len(dims) == len(set(dims))

    return st.tuples(*[st.sampled_from(choices) for _ in range(mesh_ndim)]).filter(ok)


def leaf_placements(
    shape: Sequence[int], mesh_shape: Sequence[int], *, plain: bool | float = 0.2, **kwargs
) -> SearchStrategy:
    """Placements of a leaf of global ``shape`` on a mesh of ``mesh_shape``, or ``None`` (a
    plain tensor: every rank holds the whole value) with probability ``plain`` (``True``: 0.2,
    ``False``/``0``: never). Shrinks towards ``None``, then ``Replicate()``.

    ``kwargs`` go to :func:`placements`. Whether a shard is uneven or empty follows from
    ``shape`` and ``mesh_shape`` (use sizes that do not divide the mesh).
    """
    pl = placements(len(shape), len(mesh_shape), **kwargs)
    p = 0.2 if plain is True else float(plain)
    if p <= 0:
        return pl
    if p >= 1:
        return st.none()
    cut = round(p * 100)  # sampled_from draws uniformly (integers() favours its bounds)
    return st.sampled_from([True] * cut + [False] * (100 - cut)).flatmap(
        lambda is_plain: st.none() if is_plain else pl
    )


def _leaf_is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def tree_placements(
    tree: Any, mesh_shape: Sequence[int], *, plain: bool | float = 0.2, **kwargs
) -> SearchStrategy:
    """A placements tree for ``tree`` (a pytree of tensors or shapes): the same structure with
    each tensor leaf replaced by a tuple of placements (or ``None``, a plain tensor), drawn with
    :func:`leaf_placements`; ``None`` leaves of ``tree`` stay ``None``.

    The result is the ``placements=`` argument of
    :func:`~functional_train.testing.assert_sharded_equivalent`.
    """
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True, is_leaf=_is_shape)
    parts = []
    for x in leaves:
        if x is None:
            parts.append(st.none())
            continue
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)
        parts.append(leaf_placements(shape, mesh_shape, plain=plain, **kwargs))
    return st.tuples(*parts).map(lambda pls: optree.tree_unflatten(treedef, list(pls)))


def _is_shape(x: Any) -> bool:
    return isinstance(x, torch.Size) or (
        isinstance(x, tuple) and all(isinstance(i, int) for i in x) and type(x) is tuple
    )


# =============================================================================================
# tensors, gradients, pytrees
# =============================================================================================
def shapes(
    *,
    ndims: Sequence[int] = (0, 1, 2, 3),
    sizes: Sequence[int] = DEFAULT_SIZES,
    max_numel: int = 128,
) -> SearchStrategy[tuple]:
    """Tensor shapes of ``len in ndims`` dims with every size in ``sizes`` and at most
    ``max_numel`` elements (keeps the simulation fast). Shrinks towards fewer dims first listed
    in ``ndims`` and smaller sizes."""
    sizes = sorted(sizes)
    return (
        st.sampled_from(list(ndims))
        .flatmap(lambda nd: st.tuples(*[st.sampled_from(sizes) for _ in range(nd)]))
        .filter(lambda s: math.prod(s) <= max_numel)
    )


def _seed() -> SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


def _random(shape, dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    return torch.randint(-8, 9, tuple(shape), generator=gen).to(dtype)


def tensors(
    shape: Sequence[int], *, dtype: torch.dtype = torch.float32, scale: FloatOrStrategy = 1.0
) -> SearchStrategy[torch.Tensor]:
    """Tensors of ``shape`` and ``dtype``: standard normal values times ``scale`` (integers in
    [-8, 8] for integer dtypes), from a drawn seed (drawn in float64, then cast)."""
    return st.builds(lambda s, k: _random(tuple(shape), dtype, s, k), _seed(), _as_strategy(scale))


def _low_rank(shape, rank: int | None, dtype, seed: int, scale: float) -> torch.Tensor:
    if rank is None or len(shape) < 2:
        return _random(shape, dtype, seed, scale)
    if rank < 0:
        raise ValueError(f"gradients: rank must be >= 0 or None, got {rank}")
    gen = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    u = torch.randn(*batch, m, rank, generator=gen, dtype=torch.float64)
    v = torch.randn(*batch, rank, n, generator=gen, dtype=torch.float64)
    g = (u @ v) / math.sqrt(max(rank, 1))
    return (g * scale).to(dtype)


def gradients(
    shape: Sequence[int],
    *,
    rank: IntOrStrategy = None,
    dtype: torch.dtype = torch.float32,
    scale: FloatOrStrategy = 1.0,
) -> SearchStrategy[torch.Tensor]:
    """Gradients of ``shape`` whose matrices have a controlled rank.

    For a leaf of 2 or more dims ``(*batch, m, n)``, each ``m x n`` matrix is the sum of ``rank``
    random outer products (``u_k v_k^T`` over the last two dims, scaled by ``1/sqrt(rank)``);
    ``rank=None`` gives full random values, ``rank=0`` zeros. 0-dim and 1-D leaves ignore
    ``rank``. Rank-1 gradients make factored statistics exact (row x column outer products
    reproduce the second moment), so they hide bugs in how those statistics are reduced: draw
    both (``rank=st.sampled_from([1, None])``).

    Raises (when drawn):
        ValueError: ``rank < 0``.
    """
    return st.builds(
        lambda r, s, k: _low_rank(tuple(shape), r, dtype, s, k),
        _as_strategy(rank),
        _seed(),
        _as_strategy(scale),
    )


def gradients_like(
    tree: Any,
    *,
    rank: IntOrStrategy = None,
    scale: FloatOrStrategy = 1.0,
    none: bool | SearchStrategy = False,
) -> SearchStrategy:
    """A gradient tree for the params tree ``tree``: each tensor leaf replaced by
    :func:`gradients` of its shape and dtype; ``None`` leaves stay ``None``; with ``none=True``
    (or a strategy of booleans) a leaf is sometimes ``None`` too (a frozen parameter)."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    none_st = st.booleans() if none is True else (_as_strategy(False) if none is False else none)
    parts = []
    for x in leaves:
        if x is None:
            parts.append(st.none())
            continue
        g = gradients(tuple(x.shape), rank=rank, dtype=x.dtype, scale=scale)
        parts.append(st.tuples(none_st, g).map(lambda t: None if t[0] else t[1]))
    return st.tuples(*parts).map(lambda gs: optree.tree_unflatten(treedef, list(gs)))


def _nest(leaves: list, names: list | None = None) -> Any:
    """A small nested tree (dict / dict / list) of ``leaves``: ``{"w0": a, "blk": {"w1": b,
    "seq": [c, d, ...]}}``."""
    tree: dict = {"w0": leaves[0]}
    if len(leaves) > 1:
        tree["blk"] = {"w1": leaves[1]}
    if len(leaves) > 2:
        tree["blk"]["seq"] = list(leaves[2:])
    return tree


def _nest_paths(n: int) -> list:
    """Dotted paths of the leaves of :func:`_nest` of ``n`` leaves, in the order given."""
    return ["w0", "blk.w1", *[f"blk.seq.{i}" for i in range(n - 2)]][:n]


def pytrees(
    *,
    min_leaves: int = 1,
    max_leaves: int = 4,
    ndims: Sequence[int] = (0, 1, 2, 3),
    sizes: Sequence[int] = DEFAULT_SIZES,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    none_leaves: bool = True,
    max_numel: int = 128,
) -> SearchStrategy:
    """Pytrees (nested dict / list) of ``min_leaves..max_leaves`` tensor leaves of
    :func:`shapes` ``(ndims, sizes)`` and ``dtypes``, plus, when ``none_leaves``, now and then a
    ``None`` leaf (never the only one). Values are standard normal (see :func:`tensors`)."""

    @st.composite
    def draw_tree(draw):
        n = draw(st.integers(min_leaves, max_leaves))
        leaves: list = []
        for _ in range(n):
            shape = draw(shapes(ndims=ndims, sizes=sizes, max_numel=max_numel))
            dtype = draw(st.sampled_from(list(dtypes)))
            leaves.append(draw(tensors(shape, dtype=dtype)))
        if none_leaves and draw(st.sampled_from([False, False, False, True])):
            leaves.insert(draw(st.integers(1, len(leaves))), None)
        return _nest(leaves)

    return draw_tree()


# =============================================================================================
# whole cases
# =============================================================================================
def _describe_placements(pl) -> str:
    from .equivalence import one_pl_str as _pl_str

    if pl is None:
        return "plain"
    return "[" + ", ".join(_pl_str(p) for p in pl) + "]"


class ShardedCase(Mapping):
    """One drawn sharded-equivalence problem, a mapping of the keyword arguments of
    :func:`~functional_train.testing.assert_sharded_equivalent`::

        assert_sharded_equivalent(tx, **case)

    Attributes (also the mapping's keys):
        params: pytree of plain (global) tensors.
        grads_per_step: list of gradient trees of plain tensors (``None`` for frozen leaves).
        mesh_shape: the device-mesh shape (a tuple).
        placements: params-shaped tree of placement tuples (``None``: plain tensor leaf).

    Other attributes: ``leaves`` (``(path, shape, dtype, placements)`` per params leaf),
    ``seed``, ``grad_rank``, ``grad_scale``, ``frozen`` (path of the frozen leaf or ``None``),
    ``zeros`` (``(step, path)`` of the all-zero gradient leaves, in order), ``steps``. The repr
    lists these, not tensor values: it is what hypothesis prints for a failing example.
    """

    _KEYS = ("params", "grads_per_step", "mesh_shape", "placements")

    def __init__(
        self,
        *,
        params,
        grads_per_step,
        mesh_shape,
        placements,
        leaves,
        seed,
        grad_rank,
        grad_scale,
        frozen,
        zeros=(),
    ):
        self.params, self.grads_per_step = params, grads_per_step
        self.mesh_shape, self.placements = tuple(mesh_shape), placements
        self.leaves, self.seed, self.grad_rank = leaves, seed, grad_rank
        self.grad_scale, self.frozen, self.zeros = grad_scale, frozen, tuple(zeros)

    @property
    def steps(self) -> int:
        return len(self.grads_per_step)

    def __getitem__(self, key):
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def __repr__(self) -> str:
        leaves = ", ".join(
            f"{path}: {tuple(shape)} {str(dtype).replace('torch.', '')} {_describe_placements(pl)}"
            for path, shape, dtype, pl in self.leaves
        )
        return (
            f"ShardedCase(mesh_shape={self.mesh_shape}, steps={self.steps}, "
            f"leaves={{{leaves}}}, frozen={self.frozen!r}, grad_rank={self.grad_rank}, "
            f"grad_scale={self.grad_scale}, seed={self.seed}"
            + (f", zeros={list(self.zeros)}" if self.zeros else "")
            + ")"
        )

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis' pretty printer
        p.text(repr(self))


def sharded_cases(
    *,
    mesh_shapes: SearchStrategy = None,
    steps: IntOrStrategy = None,
    min_leaves: int = 1,
    max_leaves: int = 4,
    ndims: Sequence[int] = (1, 2, 3, 0, 2, 1),
    sizes: Sequence[int] = DEFAULT_SIZES,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    grad_rank: IntOrStrategy = None,
    grad_scale: FloatOrStrategy = None,
    plain: bool | float = 0.2,
    frozen: bool = True,
    zero_grads: float = 0.0,
    max_numel: int = 128,
    **placement_kwargs,
) -> SearchStrategy[ShardedCase]:
    """Whole sharded-equivalence problems: a mesh shape, a params tree, per-leaf placements and
    the gradients of every step (see :class:`ShardedCase`).

    Args:
        mesh_shapes: strategy of mesh shapes (default :func:`mesh_shapes`, up to 8 ranks, or
            pass ``st.sampled_from([(2,), (2, 2)])``).
        steps: number of steps, int or strategy (default 2 or 3: bias corrections, moments
            and accumulators only show bugs from the second step on).
        min_leaves, max_leaves, ndims, sizes, dtypes, max_numel: the params leaves (as in
            :func:`pytrees`; repeated entries of ``ndims`` weigh it: the default draws 1-D and
            2-D leaves twice as often as 0-D and 3-D ones); params are standard normal.
        grad_rank: rank of the gradient matrices (see :func:`gradients`), int, ``None`` (full)
            or strategy; the default draws rank 1 or full rank.
        grad_scale: gradient scale, float or strategy (default one of 0.01, 1, 10).
        plain: probability of a plain-tensor leaf (placements ``None``), see
            :func:`leaf_placements`.
        frozen: with more than one leaf, one case in four gives one leaf ``None`` gradients
            (a frozen parameter).
        zero_grads: probability (0 to 1, in steps of 0.01) that a leaf's gradient is all zeros
            at a step, drawn per leaf and step (the parts of a model that got no signal: an
            expert that received no tokens, an unused layer; a later step then sees a non-zero
            state with a zero gradient). ``0`` (the default) draws nothing: the cases are those
            drawn without the option. Shrinks towards no zero leaves. (A ``grad_scale`` below
            the transform's eps, such as ``1e-30``, gives gradients whose squares underflow.)
        placement_kwargs: passed to :func:`placements` (``replicate``, ``nested``,
            ``negative_dims``).

    Raises:
        ValueError: ``zero_grads`` outside [0, 1].
    """
    if not 0.0 <= zero_grads <= 1.0:
        raise ValueError(f"sharded_cases: zero_grads must be in [0, 1], got {zero_grads}")
    mesh_st = mesh_shapes if mesh_shapes is not None else _mesh_shapes()
    cut = round(zero_grads * 100)
    zero_st = st.sampled_from([False] * (100 - cut) + [True] * cut)  # uniform; False first
    steps_st = st.integers(2, 3) if steps is None else _as_strategy(steps)
    rank_st = st.sampled_from([None, 1]) if grad_rank is None else _as_strategy(grad_rank)
    scale_st = (
        st.sampled_from([1.0, 0.01, 10.0]) if grad_scale is None else _as_strategy(grad_scale)
    )

    @st.composite
    def draw_case(draw):
        mesh_shape = tuple(draw(mesh_st))
        n = draw(st.integers(min_leaves, max_leaves))
        specs = []
        for _ in range(n):
            shape = draw(shapes(ndims=ndims, sizes=sizes, max_numel=max_numel))
            dtype = draw(st.sampled_from(list(dtypes)))
            pl = draw(leaf_placements(shape, mesh_shape, plain=plain, **placement_kwargs))
            specs.append((shape, dtype, pl))
        n_steps = draw(steps_st)
        rank = draw(rank_st)
        scale = draw(scale_st)
        seed = draw(_seed())
        frozen_i = (
            draw(st.integers(1, n - 1))
            if frozen and n > 1 and draw(st.sampled_from([False, False, False, True]))
            else None
        )
        zero = [[cut > 0 and draw(zero_st) for _ in specs] for _ in range(n_steps)]
        gen_seed = iter(range(seed, seed + 10**6))
        params = [_random(s, d, next(gen_seed) % 2**63, 1.0) for s, d, _ in specs]

        def grad(t, i, s, d):
            if i == frozen_i:
                return None
            x = _low_rank(s, rank, d, next(gen_seed) % 2**63, scale)  # (drawn either way)
            return torch.zeros_like(x) if zero[t][i] else x

        grads = [[grad(t, i, s, d) for i, (s, d, _) in enumerate(specs)] for t in range(n_steps)]
        ptree = _nest(params)
        paths = _nest_paths(n)
        return ShardedCase(
            params=ptree,
            grads_per_step=[_nest(g) for g in grads],
            mesh_shape=mesh_shape,
            placements=_nest([pl for _, _, pl in specs]),
            leaves=[(path, s, d, pl) for path, (s, d, pl) in zip(paths, specs)],
            seed=seed,
            grad_rank=rank,
            grad_scale=scale,
            frozen=None if frozen_i is None else paths[frozen_i],
            zeros=[
                (t, paths[i])
                for t in range(n_steps)
                for i in range(n)
                if zero[t][i] and i != frozen_i
            ],
        )

    return draw_case()
