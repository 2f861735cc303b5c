"""``assert_sharded_equivalent``: a gradient transform gives the same numbers sharded and not.

Runs a transform twice over the same steps: on plain tensors with ``mesh=None`` (the reference)
and on DTensors laid out as the caller says over a device mesh (in one process through
``LocalTensorMode`` simulation, or on the real ranks of an initialised process group), then
compares the updates, the parameters and the state of every step rank by rank: each rank's local
shard against the slice of the reference its placements say it holds, so diverging replicas are
caught too. The first difference is reported by step, tree and leaf path with the largest error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

__all__ = ["assert_sharded_equivalent"]

PlacementsSpec = Any | Callable[[str, torch.Tensor | None], Any]


# =============================================================================================
# paths and placements
# =============================================================================================
def _entry_name(e) -> str:
    field = getattr(e, "field", None)  # NamedTuple / dataclass entries
    if isinstance(field, str):
        return field
    name = getattr(e, "name", None)
    if isinstance(name, str):
        return name
    return str(e.entry)


def _flatten(tree: Any):
    """``(dotted paths, leaves, treedef)``; NamedTuple fields by name (``1.0.mu.w0``), the root
    leaf as ``<root>`` (the library's convention)."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree, none_is_leaf=True)
    paths = [".".join(_entry_name(e) for e in a) or "<root>" for a in accessors]
    return paths, leaves, treedef


def _pl_str(pl) -> str:
    if pl is None:
        return "plain tensor"
    return "[" + ", ".join(one_pl_str(p) for p in pl) + "]"


def one_pl_str(p) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return "Partial()" if p.reduce_op == "sum" else f"Partial({p.reduce_op!r})"
    return repr(p)


def _is_placements_leaf(x: Any) -> bool:
    if x is None or isinstance(x, Placement):
        return True
    return (
        isinstance(x, (list, tuple))
        and not hasattr(x, "_fields")
        and len(x) > 0
        and all(isinstance(p, Placement) for p in x)
    )


def _resolve_placements(
    spec: PlacementsSpec,
    what: str,
    paths: list,
    leaves: list,
    treedef,
    mesh_ndim: int,
    allow_partial: bool,
) -> list:
    """One tuple of placements (or ``None``) per leaf of the params tree."""
    if callable(spec) and not isinstance(spec, Placement):
        raw = [spec(p, x) for p, x in zip(paths, leaves)]
    else:
        try:
            raw = treedef.flatten_up_to(spec)
        except (ValueError, TypeError) as e:
            td = optree.tree_structure(spec, none_is_leaf=True, is_leaf=_is_placements_leaf)
            raise ValueError(
                f"assert_sharded_equivalent: {what} does not have the structure of "
                f"params (one placements list or None per leaf):\n  {what}: {td}\n"
                f"  params: {treedef}\n  ({e})"
            ) from e
    out = []
    for path, x, pl in zip(paths, leaves, raw):
        if pl is None:
            out.append(None)
            continue
        if isinstance(pl, Placement):
            pl = (pl,)
        if not _is_placements_leaf(pl):
            raise TypeError(
                f"assert_sharded_equivalent: {what}['{path}'] must be a sequence of "
                f"placements or None, got {pl!r}"
            )
        pl = tuple(pl)
        if x is None:
            raise ValueError(
                f"assert_sharded_equivalent: {what}['{path}'] is {_pl_str(pl)} but the leaf is None"
            )
        if len(pl) != mesh_ndim:
            raise ValueError(
                f"assert_sharded_equivalent: {what}['{path}'] has {len(pl)} "
                f"placements {_pl_str(pl)}, the mesh has {mesh_ndim} dims"
            )
        for p in pl:
            if isinstance(p, Shard):
                if x.ndim == 0 or not -x.ndim <= p.dim < x.ndim:
                    raise ValueError(
                        f"assert_sharded_equivalent: {what}['{path}'] has "
                        f"{one_pl_str(p)}, but the leaf has shape {tuple(x.shape)}"
                    )
            elif isinstance(p, Partial):
                if not allow_partial:
                    raise ValueError(
                        f"assert_sharded_equivalent: {what}['{path}'] is Partial; "
                        "only grad_placements may be"
                    )
                if p.reduce_op not in ("sum", "avg"):
                    raise ValueError(
                        f"assert_sharded_equivalent: {what}['{path}'] is "
                        f"{one_pl_str(p)}; only Partial('sum') and "
                        "Partial('avg') gradients can be generated"
                    )
            elif not isinstance(p, Replicate):
                raise ValueError(
                    f"assert_sharded_equivalent: {what}['{path}'] has an "
                    f"unsupported placement {p!r}"
                )
        out.append(pl)
    return out


def _unravel(r: int, shape: Sequence[int]) -> tuple:
    out = []
    for s in reversed(shape):
        out.append(r % s)
        r //= s
    return tuple(reversed(out))


def _region(
    shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple:
    """The slices of a global tensor of ``shape`` held by the rank at mesh ``coord``
    (``Shard`` placements chunk mesh dim by mesh dim, torch's nested chunking)."""
    start, size = [0] * len(shape), [int(s) for s in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            n, off = Shard.local_shard_size_and_offset(size[d], mesh_shape[i], coord[i])
            start[d] += off
            size[d] = n
    return tuple(slice(a, a + n) for a, n in zip(start, size))


# =============================================================================================
# where the sharded run happens: simulated ranks or this real rank
# =============================================================================================
class _Ranks:
    """The ranks this process sees: every simulated rank, or its own real one."""

    def __init__(self, simulated: bool, mesh_shape: tuple, device_type: str):
        self.simulated = simulated
        self.mesh_shape = mesh_shape
        self.world = math.prod(mesh_shape)
        self.device_type = device_type
        self.ranks = list(range(self.world)) if simulated else [dist.get_rank()]
        self.mesh = None

    def coord(self, r: int) -> tuple:
        return _unravel(r, self.mesh_shape)

    def device(self):
        if self.device_type == "cpu":
            return torch.device("cpu")
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def replicated(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on every rank (a simulated tensor, or a copy on this rank's device)."""
        if self.simulated:
            from .sim import replicated

            return replicated(self.world, x)
        return x.detach().to(self.device(), copy=True)

    def scalar(self, fn: Callable[[int], float]) -> torch.Tensor:
        """A float64 scalar whose value on rank ``r`` is ``fn(r)``."""
        if self.simulated:
            from .sim import per_rank

            return per_rank(self.world, lambda r: torch.tensor(fn(r), dtype=torch.float64))
        return torch.tensor(fn(self.ranks[0]), dtype=torch.float64, device=self.device())

    def local(self, t: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s value of a (simulated) plain tensor, no copy."""
        if self.simulated:
            from .sim import on_rank

            return on_rank(t, r)
        return t

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.simulated:
            from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

            with maybe_disable_local_tensor_mode():
                return t.detach().clone()
        return t.detach().to("cpu", copy=True)


# =============================================================================================
# building the sharded inputs
# =============================================================================================
def _spread(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Elementwise-relative offsets ``x * u`` (``u`` standard normal from ``seed``): per-rank
    contributions ``x * (a + b_r u)`` reduce to ``x`` within a few ulps of each element, zeros
    stay exact zeros. Made outside the simulation (random ops inside it run once per rank)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    return x.detach().to(torch.float64) * u


def _sharded_leaf(
    ctx: _Ranks, x: torch.Tensor | None, pl: tuple | None, unreduced: Sequence[tuple]
):
    """The sharded counterpart of global ``x``: a DTensor in ``pl`` (``None``: a plain tensor).

    ``unreduced``: ``(mesh dim, op, spread)`` along which the ranks hold *contributions* that
    reduce (``"sum"`` / ``"avg"``) to ``x`` instead of ``x`` itself (``Partial`` placements, a
    data axis for plain gradients); ``spread`` is a :func:`_spread` of ``x``."""
    if x is None:
        return None
    mesh = ctx.mesh
    base_pl = None if pl is None else [Replicate() if isinstance(p, Partial) else p for p in pl]

    def lay_out(v):
        v = ctx.replicated(v)
        if base_pl is None:
            return v
        return distribute_tensor(v, mesh, base_pl, src_data_rank=None)._local_tensor

    local = lay_out(x)
    if unreduced:
        # the contribution of rank r: x * prod(1/n over the sum dims) + sum_j b_j(coord_j) *
        # spread_j, with sum_c b_j(c) = 0: every reduction order gives x back (it is linear)
        scale = 1.0
        for d, op, _ in unreduced:
            if op == "sum":
                scale /= ctx.mesh_shape[d]
        out = local.to(torch.float64) * scale
        for d, _, spread in unreduced:
            n = ctx.mesh_shape[d]
            b = ctx.scalar(lambda r, d=d, n=n: float(ctx.coord(r)[d]) - (n - 1) / 2)
            out = out + lay_out(spread) * b
        local = out.to(x.dtype)
    return local if pl is None else _wrap(local, mesh, pl, x)


def _wrap(local, mesh, pl, x):
    return DTensor.from_local(
        local, mesh, list(pl), run_check=False, shape=x.shape, stride=x.stride()
    )


# =============================================================================================
# snapshots of trees and their comparison
# =============================================================================================
@dataclasses.dataclass
class _Leaf:
    """What the ranks hold of one leaf."""

    kind: str  # "none" | "dtensor" | "tensor" | "other"
    value: Any = None  # "other": the value
    dtype: torch.dtype | None = None
    shape: tuple | None = None  # global shape
    placements: tuple | None = None
    locals: dict | None = None  # rank -> local tensor (cpu copy)


def _has_partial(x: Any) -> bool:
    return isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements)


def _snapshot_leaf(
    ctx: _Ranks | None, x: Any, copy: bool = True, reduce_partial: bool = False
) -> _Leaf:
    if x is None:
        return _Leaf("none")
    if isinstance(x, DTensor):
        if reduce_partial and _has_partial(x):
            x = x.redistribute(
                x.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in x.placements]
            )
        loc = x._local_tensor
        return _Leaf(
            "dtensor",
            dtype=x.dtype,
            shape=_int_shape(x.shape),
            placements=tuple(x.placements),
            locals={r: (ctx.copy if copy else _same)(ctx.local(loc, r)) for r in ctx.ranks},
        )
    if isinstance(x, torch.Tensor):
        if ctx is None:  # the unsharded run
            return _Leaf(
                "tensor",
                dtype=x.dtype,
                shape=tuple(x.shape),
                locals={None: x.detach().clone() if copy else x},
            )
        return _Leaf(
            "tensor",
            dtype=x.dtype,
            shape=_int_shape(x.shape),
            locals={r: (ctx.copy if copy else _same)(ctx.local(x, r)) for r in ctx.ranks},
        )
    return _Leaf("other", value=x)


def _same(t):
    return t


def _int_shape(shape) -> tuple:
    """A shape of ints; a dim that differs across simulated ranks (a leaf whose ranks disagree
    on its shape) becomes the string ``"per-rank {rank: size}"``."""
    out = []
    for s in shape:
        try:
            out.append(int(s))
        except Exception:  # noqa: BLE001  (a LocalIntNode-backed SymInt)
            per = getattr(getattr(s, "node", None), "_local_ints", None)
            out.append(f"per-rank {per}" if per is not None else str(s))
    return tuple(out)


@dataclasses.dataclass
class _Tree:
    paths: list
    leaves: list
    treedef: Any


def _snapshot(
    ctx: _Ranks | None, tree: Any, copy: bool = True, reduce_partial: bool = False
) -> _Tree:
    paths, leaves, treedef = _flatten(tree)
    return _Tree(paths, [_snapshot_leaf(ctx, x, copy, reduce_partial) for x in leaves], treedef)


def _snapshots(ctx: _Ranks | None, tree: Any) -> tuple:
    """``(for comparison, as held)``: copies of what the ranks hold of ``tree`` now; the first
    with ``Partial`` DTensor leaves reduced (the same object when there are none)."""
    raw = _snapshot(ctx, tree)
    if any(_has_partial(x) for x in optree.tree_leaves(tree, none_is_leaf=True)):
        return _snapshot(ctx, tree, reduce_partial=True), raw
    return raw, raw


class _Mismatch(Exception):
    pass


def _close_mask(got: torch.Tensor, want: torch.Tensor, rtol, atol, equal_nan) -> tuple:
    """``(bad mask, error)`` elementwise; integer and bool tensors must be equal."""
    if not (want.dtype.is_floating_point or want.dtype.is_complex):
        bad = got != want
        return bad, bad.to(torch.float64)
    g, w = got.to(torch.float64), want.to(torch.float64)
    err = (g - w).abs()
    both_nan = torch.isnan(g) & torch.isnan(w)
    same_inf = torch.isinf(w) & (g == w)
    tol = atol + rtol * w.abs()
    bad = ~(err <= tol) & ~same_inf
    if equal_nan:
        bad &= ~both_nan
    err = torch.where(torch.isnan(err) | torch.isinf(err), torch.full_like(err, math.inf), err)
    err = torch.where(bad, err, torch.zeros_like(err))
    return bad, err


def _shape_str(shape: tuple) -> str:
    inner = ", ".join(str(s) for s in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _compare_leaf(
    where: str, got: _Leaf, want: _Leaf, mesh_shape, rtol, atol, equal_nan
) -> str | None:
    """A description of how ``got`` (sharded) differs from ``want`` (unsharded), or ``None``."""
    mesh_str = f"mesh {tuple(mesh_shape)}"
    if want.kind == "none" or got.kind == "none":
        if want.kind != got.kind:
            return (
                f"{where}: sharded is {'None' if got.kind == 'none' else 'a tensor'}, "
                f"unsharded is {'None' if want.kind == 'none' else repr(want.value)}"
            )
        return None
    if want.kind == "other" or got.kind == "other":
        if want.kind != got.kind or not _equal_values(got.value, want.value):
            gv = got.value if got.kind == "other" else f"a tensor of shape {got.shape}"
            wv = want.value if want.kind == "other" else f"a tensor of shape {want.shape}"
            return f"{where}: sharded {gv!r}, unsharded {wv!r}"
        return None
    pl = got.placements if got.kind == "dtensor" else None
    layout = (
        f"placements {_pl_str(pl)} on {mesh_str}"
        if pl is not None
        else f"a plain tensor on {mesh_str}: every rank must hold the unsharded value"
    )
    if got.dtype != want.dtype:
        return f"{where}: dtype {got.dtype}, unsharded {want.dtype}; {layout}"
    if got.shape != want.shape:
        return (
            f"{where}: global shape {_shape_str(got.shape)}, unsharded "
            f"{_shape_str(want.shape)}; {layout}"
        )
    ref = want.locals[None]
    bad_any = torch.zeros(ref.shape, dtype=torch.bool)
    worst = None  # (error, rank, global index, sharded, unsharded)
    bad_ranks = []
    for r, loc in got.locals.items():
        coord = _unravel(r, mesh_shape)
        region = (
            _region(ref.shape, pl, mesh_shape, coord)
            if pl is not None
            else tuple(slice(0, s) for s in ref.shape)
        )
        expect = ref[region]
        if tuple(loc.shape) != tuple(expect.shape):
            return (
                f"{where}: rank {r} (mesh coordinate {coord}) holds a local shard of shape "
                f"{tuple(loc.shape)}, expected {tuple(expect.shape)} for the global shape "
                f"{want.shape}; {layout}"
            )
        bad, err = _close_mask(loc, expect, rtol, atol, equal_nan)
        if not bool(bad.any()):
            continue
        bad_ranks.append(r)
        bad_any[region] |= bad
        flat = int(torch.argmax(err.reshape(-1)))
        e = float(err.reshape(-1)[flat])
        if worst is None or e > worst[0]:
            local_idx = _unravel(flat, tuple(loc.shape)) if loc.ndim else ()
            gidx = tuple(s.start + i for s, i in zip(region, local_idx))
            worst = (
                e,
                r,
                coord,
                gidx,
                loc.reshape(-1)[flat].item(),
                expect.reshape(-1)[flat].item(),
            )
    if worst is None:
        return None
    e, r, coord, gidx, gv, wv = worst
    n_bad, n = int(bad_any.sum()), ref.numel()
    err_word = "error" if want.dtype.is_floating_point else "difference"
    where_rank = f" on rank {r} (mesh coordinate {coord})"
    msg = (
        f"{where}: max abs {err_word} {_fmt(e)} (rtol {rtol:g}, atol {atol:g}) at index "
        f"{gidx}{where_rank}: sharded {_fmt(gv) if isinstance(gv, float) else gv}, unsharded "
        f"{_fmt(wv) if isinstance(wv, float) else wv}; {n_bad} of {n} elements differ; "
        f"{layout}"
    )
    if len(got.locals) > 1:
        msg += f"; ranks that differ: {bad_ranks}"
    return msg


def _equal_values(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return a is b


def _compare_tree(
    what: str,
    got: _Tree,
    want: _Tree,
    mesh_shape,
    rtol,
    atol,
    equal_nan,
    skip: Callable[[str], bool] | None = None,
) -> str | None:
    if got.treedef != want.treedef:
        extra = set(got.paths) - set(want.paths)
        missing = set(want.paths) - set(got.paths)
        hint = ""
        if missing:
            hint = f"; leaf '{sorted(missing)[0]}' is missing"
        elif extra:
            hint = f"; leaf '{sorted(extra)[0]}' is unexpected"
        return (
            f"{what}: the sharded structure differs from the unsharded one{hint}:\n"
            f"  sharded   {got.treedef}\n  unsharded {want.treedef}"
        )
    for path, g, w in zip(want.paths, got.leaves, want.leaves):
        if skip is not None and skip(path):
            continue
        msg = _compare_leaf(f"{what}['{path}']", g, w, mesh_shape, rtol, atol, equal_nan)
        if msg is not None:
            return msg
    return None


def _placement_check(what: str, updates: _Tree, params: _Tree) -> str | None:
    """Updates of DTensor params are DTensors in their placements; of plain params, plain."""
    for path, u, p in zip(params.paths, updates.leaves, params.leaves):
        if u.kind == "none" or p.kind not in ("dtensor", "tensor"):
            continue
        if p.kind == "dtensor" and u.kind != "dtensor":
            return (
                f"{what}['{path}']: the sharded update is a plain tensor, but its parameter "
                f"is a DTensor with placements {_pl_str(p.placements)}"
            )
        if p.kind == "dtensor" and u.placements != p.placements:
            return (
                f"{what}['{path}']: the sharded update has placements "
                f"{_pl_str(u.placements)}, its parameter {_pl_str(p.placements)}"
            )
        if p.kind == "tensor" and u.kind == "dtensor":
            return (
                f"{what}['{path}']: the sharded update is a DTensor "
                f"({_pl_str(u.placements)}) for a plain-tensor parameter"
            )
    return None


def _unchanged(what: str, before: _Tree, after: _Tree) -> str | None:
    """Whether every tensor leaf still holds, on every rank, what it held when created."""
    for path, b, a in zip(before.paths, before.leaves, after.leaves):
        if b.kind not in ("dtensor", "tensor"):
            continue
        for r, t in b.locals.items():
            now = a.locals[r].detach().cpu()
            if t.shape != now.shape:
                same = False
            elif t.dtype.is_floating_point or t.dtype.is_complex:
                same = torch.equal(t.isnan(), now.isnan()) and torch.equal(
                    torch.nan_to_num(t), torch.nan_to_num(now)
                )
            else:
                same = torch.equal(t, now)
            if not same:
                on = "" if r is None else f" on rank {r}"
                return f"{what}['{path}'] was modified in place{on} after it was created"
    return None


def _nonfinite(what: str, tree: _Tree, skip: Callable[[str], bool] | None = None) -> str | None:
    """The first floating-point leaf of ``tree`` holding a NaN or an infinity on some rank:
    where, how many elements, the first such value and its index (local to the rank's shard)."""
    for path, leaf in zip(tree.paths, tree.leaves):
        if leaf.kind not in ("dtensor", "tensor") or (skip is not None and skip(path)):
            continue
        if not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
            continue
        for r, t in leaf.locals.items():
            bad = ~torch.isfinite(t)
            if not bool(bad.any()):
                continue
            flat = int(torch.argmax(bad.reshape(-1).to(torch.uint8)))
            idx = _unravel(flat, tuple(t.shape)) if t.ndim else ()
            on = "" if r is None else f" on rank {r} (local index)"
            return (
                f"{what}['{path}']: {int(bad.sum())} of {t.numel()} elements are not finite "
                f"(first: {t.reshape(-1)[flat].item()} at index {idx}{on})"
            )
    return None


# =============================================================================================
# the runs
# =============================================================================================
class _Record:
    """Snapshots of every tree of a run when it was created (``cmp`` for the comparison, ``raw``
    as held, for the in-place check) and the live objects."""

    def __init__(self, ctx: _Ranks | None):
        self.ctx = ctx
        self.trees: list = []  # (label, step or None, cmp, raw, live)

    def add(self, label: str, step: int | None, tree: Any) -> None:
        cmp, raw = _snapshots(self.ctx, tree)
        self.trees.append((label, step, cmp, raw, tree))

    def has(self, label: str, step: int | None) -> bool:
        return any(lb == label and t == step for lb, t, *_ in self.trees)

    def get(self, label: str, step: int | None) -> _Tree:
        for lb, t, cmp, _, _ in self.trees:
            if lb == label and t == step:
                return cmp
        raise KeyError((label, step))


def _run(
    tx,
    params,
    grads_per_step,
    mesh,
    ctx: _Ranks | None,
    update_kwargs: dict,
    label: str,
    use_step: str | None = None,
) -> _Record:
    """Run every step, recording the trees of every step (see :class:`_Record`)."""
    from ..step import step as ft_step

    rec = _Record(ctx)
    step = None
    try:
        state = tx.init(params)
        rec.add("params", None, params)
        rec.add("state", None, state)
        for step, g in enumerate(grads_per_step):
            if use_step is not None:  # ft.step: no updates to record
                if use_step == "pure":
                    rec.add("grads", step, g)
                params, state = ft_step(
                    tx, g, state, params, mesh=mesh, donate=use_step == "donate", **update_kwargs
                )
                rec.add("state", step, state)
                rec.add("params", step, params)
                continue
            rec.add("grads", step, g)
            updates, state = tx.update(g, state, params, mesh=mesh, **update_kwargs)
            rec.add("updates", step, updates)
            rec.add("state", step, state)
            params = _apply(params, updates)
            rec.add("params", step, params)
    except Exception as e:
        if hasattr(e, "add_note"):
            at = "in tx.init" if step is None else f"at step {step}"
            e.add_note(f"(assert_sharded_equivalent: raised by the {label} run {at})")
        raise
    return rec


def _apply(params, updates):
    from ..update import apply_updates

    return apply_updates(params, updates)


def _compare_runs(
    ref: _Record,
    got: _Record,
    steps: int,
    mesh_shape,
    rtol,
    atol,
    equal_nan,
    compare_state,
    ignore_state,
    check_placements,
    check_inputs,
    finite=False,
) -> str | None:
    if finite:
        runs = (("unsharded", ref), ("sharded", got))
        for t in [None, *range(steps)]:
            for run, rec in runs:
                for label in ("updates", "params", "state"):
                    if not rec.has(label, t):
                        continue  # no updates under ft.step, nor at init
                    when = "initial " if t is None else f"step {t}, "
                    msg = _nonfinite(
                        f"{run} run, {when}{label}",
                        rec.get(label, t),
                        ignore_state if label == "state" else None,
                    )
                    if msg:
                        return msg
    tol = (mesh_shape, rtol, atol, equal_nan)
    if compare_state:
        msg = _compare_tree(
            "init state", got.get("state", None), ref.get("state", None), *tol, ignore_state
        )
        if msg:
            return msg
    param_tree = got.get("params", None)
    for t in range(steps):
        stepped = not any(lb == "updates" for lb, *_ in got.trees)  # ft.step: no updates
        if check_placements and not stepped:
            msg = _placement_check(f"step {t}, updates", got.get("updates", t), param_tree)
            if msg:
                return msg
        for key in ("updates", "params", "state"):
            if (key == "state" and not compare_state) or (key == "updates" and stepped):
                continue
            msg = _compare_tree(
                f"step {t}, {key}",
                got.get(key, t),
                ref.get(key, t),
                *tol,
                ignore_state if key == "state" else None,
            )
            if msg:
                return msg
        if check_placements:
            msg = _placement_check(f"step {t}, params", got.get("params", t), param_tree)
            if msg:
                return msg
    if check_inputs:
        for run, rec in (("unsharded", ref), ("sharded", got)):
            for label, t, _, raw, live in rec.trees:
                when = "initial " if t is None else f"step {t}, "
                msg = _unchanged(
                    f"{run} run, {when}{label}", raw, _snapshot(rec.ctx, live, copy=False)
                )
                if msg:
                    return msg
    return None


def _clone_tree(tree):
    return optree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


# =============================================================================================
# the assertion
# =============================================================================================
def assert_sharded_equivalent(
    tx,
    params: Any,
    grads_per_step: Sequence[Any],
    *,
    placements: PlacementsSpec,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    grad_placements: PlacementsSpec | None = None,
    data_axis: str | None = None,
    explicit_mesh: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    equal_nan: bool = True,
    compare_state: bool = True,
    ignore_state: Callable[[str], bool] | None = None,
    check_placements: bool = True,
    check_inputs: bool = True,
    finite: bool = False,
    update_kwargs: dict | None = None,
    device_type: str | None = None,
    step: str | None = None,
) -> None:
    """Assert that ``tx`` gives the same numbers on sharded DTensors as on plain tensors.

    Runs ``state = tx.init(params)`` then, for every step ``t``, ``updates, state =
    tx.update(grads_per_step[t], state, params, mesh=...)`` and ``params =
    ft.apply_updates(params, updates)`` twice: on the plain tensors given (``mesh=None``), and
    on DTensors laid out by ``placements`` over a device mesh of ``mesh_shape``. Then compares,
    step by step, the updates, the parameters and the state (``tx.init``'s too), leaf by leaf and
    rank by rank: each rank's local shard of a DTensor leaf against the slice of the unsharded
    value its placements say it holds (so replicas are checked one by one), and each rank's value
    of a plain-tensor leaf (state scalars such as a clipping norm or a step counter) against the
    whole unsharded value. Non-tensor leaves and the tree structure (NamedTuple types included)
    must be identical.

    Where it runs:

    * no process group initialised (or the ``fake`` one): in this process, simulating
      ``prod(mesh_shape)`` ranks (:func:`~functional_train.testing.simulate`);
    * inside an initialised real process group (``torchrun``, gloo / nccl): on the real ranks,
      with real collectives, over ``init_device_mesh(device_type, mesh_shape)``; call it on every
      rank with the same arguments (same seeds); every rank raises the same error.

    Args:
        tx: the :class:`~functional_train.GradientTransformation` under test.
        params: pytree of plain tensors (the global parameter values); ``None`` leaves allowed.
        grads_per_step: one gradient tree (params-shaped, plain global tensors, ``None`` for
            frozen leaves) per step.
        placements: how each parameter leaf is laid out: a params-shaped tree whose leaves are
            sequences of ``len(mesh_shape)`` placements (``Shard(d)`` with any ``d``, negative
            included, and ``Replicate()``; sizes need not divide the mesh) or ``None`` for a
            plain tensor (every rank holds the whole value); or a callable
            ``placements(path, leaf) -> placements or None`` on dotted leaf paths and global
            tensors. A bare placement stands for a one-element list.
        mesh_shape: the device-mesh shape, 1 to 3 dims. Required in simulation; on a real
            process group it defaults to ``(world_size,)`` and its product must equal it.
        mesh_dim_names: names of the mesh dims (default ``("d0", "d1", ...)``).
        grad_placements: the gradients' layout, as ``placements`` (default: the parameters').
            May differ from the parameters' (a ``Shard(0)`` gradient for a ``Replicate()``
            parameter) and may hold ``Partial()`` / ``Partial("avg")``: then the ranks along that
            mesh dim hold different contributions that sum / average to the given gradient.
        data_axis: name of a mesh dim to declare as ``ft.Mesh(..., data_axis=...)``. Plain-tensor
            gradients become per-replica contributions along it that average to the given
            gradient (DDP semantics); DTensor gradients are unaffected (they are reduced over
            every dim of their mesh unless ``Partial``).
        explicit_mesh: pass ``mesh=ft.Mesh(device_mesh, data_axis=data_axis)`` to ``update``
            (default); ``False`` passes ``mesh=None`` and lets the library find the mesh from the
            DTensor leaves (not allowed with ``data_axis``).
        rtol, atol: tolerances, elementwise ``|sharded - unsharded| <= atol + rtol *
            |unsharded|`` as in ``torch.testing.assert_close``; integer and bool leaves must be
            equal.
        equal_nan: NaN in both runs at the same place counts as equal.
        compare_state: compare the states (default ``True``).
        ignore_state: ``ignore_state(path) -> bool`` on dotted state paths (NamedTuple fields by
            name: ``"1.0.mu.w0"``): state leaves to skip (e.g. ``multi_steps``' ``acc_grads``
            under a ``data_axis``, which holds each replica's own contribution by design).
        check_placements: also require every sharded update and parameter leaf to be a DTensor
            in its parameter's placements (a plain tensor for a plain parameter).
        check_inputs: also require that neither run modifies any tree in place after it was
            created (the grads, the params, the states and updates it returned).
        finite: also require every floating-point leaf of the updates, the parameters and the
            state (``tx.init``'s too; ``ignore_state`` applies) of both runs to be finite at
            every step, on every rank: a division by a zero norm gives NaN in both runs, which
            ``equal_nan`` counts as equal. Checked before the comparison, step by step, the
            unsharded run first (default ``False``).
        update_kwargs: extra keyword arguments for every ``tx.update`` call.
        step: ``None`` (the default) runs ``update`` then ``apply_updates``; ``"pure"`` or
            ``"donate"`` runs ``ft.step(tx, grads, state, params, mesh=..., donate=...)``
            instead and compares the params and states (no updates to compare; with
            ``"donate"`` the inputs a step consumes are not checked for modification).
        device_type: the mesh's device type (default ``"cpu"``; ``"cuda"`` on an nccl process
            group).

    Raises:
        AssertionError: the runs differ; the message names the first difference: step (``t`` is
            the update with ``grads_per_step[t]``), tree (updates / params / state) and dotted
            leaf path, the largest error, its global index, rank and mesh coordinate, both
            values, how many elements differ, the leaf's placements and the mesh, e.g.
            ``step 2, updates['blk.w1']: max abs error 0.0123 (rtol 1e-05, atol 1e-06) at index
            (2, 1) on rank 1 (mesh coordinate (0, 1)): sharded 0.51, unsharded 0.4977; 6 of 35
            elements differ; placements [Shard(0), Shard(1)] on mesh (2, 2); ranks that differ:
            [1, 3]``; with ``finite=True``, first the first leaf that is not finite, e.g.
            ``unsharded run, step 0, updates['w']: 12 of 12 elements are not finite (first: nan
            at index (0, 0))``.
        ValueError / TypeError: bad arguments (placements that do not fit a leaf or the mesh,
            gradient trees not shaped like ``params``, no ``mesh_shape`` in simulation, a mesh
            that does not match the real world size, ``data_axis`` not a mesh dim name, ``tx``
            not a transform, an empty ``grads_per_step``).
        RuntimeError: called inside :func:`~functional_train.testing.simulate`.
        Whatever ``tx`` raises, with a note naming the run and the step.
    """
    from ..mesh import Mesh

    if isinstance(grads_per_step, (dict, torch.Tensor)) or not isinstance(grads_per_step, Sequence):
        raise TypeError(
            "assert_sharded_equivalent: grads_per_step must be a list of gradient "
            f"trees (one per step), got {type(grads_per_step).__name__}"
        )
    try:
        from torch.distributed._local_tensor import local_tensor_mode
    except ImportError:  # pragma: no cover
        local_tensor_mode = None
    if local_tensor_mode is not None and local_tensor_mode() is not None:
        raise RuntimeError(
            "assert_sharded_equivalent: call it outside simulate(): it runs the "
            "unsharded reference on plain tensors and simulates the ranks itself"
        )
    real = dist.is_initialized() and dist.get_backend() != "fake"
    if mesh_shape is None:
        if not real:
            raise ValueError(
                "assert_sharded_equivalent: mesh_shape is required in simulation "
                "(no process group is initialised)"
            )
        mesh_shape = (dist.get_world_size(),)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not 1 <= len(mesh_shape) <= 3 or any(s < 1 for s in mesh_shape):
        raise ValueError(
            f"assert_sharded_equivalent: mesh_shape must have 1 to 3 dims >= 1, got {mesh_shape}"
        )
    if real and math.prod(mesh_shape) != dist.get_world_size():
        raise ValueError(
            f"assert_sharded_equivalent: mesh_shape {mesh_shape} has "
            f"{math.prod(mesh_shape)} ranks, the process group has "
            f"{dist.get_world_size()}"
        )
    names = (
        tuple(mesh_dim_names)
        if mesh_dim_names is not None
        else tuple(f"d{i}" for i in range(len(mesh_shape)))
    )
    if len(names) != len(mesh_shape):
        raise ValueError(
            f"assert_sharded_equivalent: mesh_dim_names {names} do not match "
            f"mesh_shape {mesh_shape}"
        )
    if data_axis is not None:
        if data_axis not in names:
            raise ValueError(
                f"assert_sharded_equivalent: data_axis {data_axis!r} is not among "
                f"the mesh dim names {names}"
            )
        if not explicit_mesh:
            raise ValueError("assert_sharded_equivalent: data_axis needs explicit_mesh=True")
    if device_type is None:
        device_type = "cuda" if real and dist.get_backend() == "nccl" else "cpu"
    update_kwargs = dict(update_kwargs or {})
    from ..base import GradientTransformation

    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"assert_sharded_equivalent: tx must be a GradientTransformation, got "
            f"{type(tx).__name__}"
        )
    if len(grads_per_step) == 0:
        raise ValueError(
            "assert_sharded_equivalent: grads_per_step is empty; give at least one "
            "step's gradients (nothing would be compared)"
        )
    if step not in (None, "pure", "donate"):
        raise ValueError(
            f"assert_sharded_equivalent: step must be None, 'pure' or 'donate', got {step!r}"
        )

    # inputs
    paths, pleaves, treedef = _flatten(params)
    for x, p in zip(pleaves, paths):
        if x is not None and (not isinstance(x, torch.Tensor) or isinstance(x, DTensor)):
            raise TypeError(
                f"assert_sharded_equivalent: params['{p}'] must be a plain tensor "
                f"or None, got {type(x).__name__}"
            )
    grad_leaves = []
    for t, g in enumerate(grads_per_step):
        leaves, td = optree.tree_flatten(g, none_is_leaf=True)
        if td != treedef:
            raise ValueError(
                f"assert_sharded_equivalent: grads_per_step[{t}] does not have the "
                f"structure of params:\n  grads:  {td}\n  params: {treedef}"
            )
        for x, p, _w in zip(leaves, paths, pleaves):
            if x is not None and (not isinstance(x, torch.Tensor) or isinstance(x, DTensor)):
                raise TypeError(
                    f"assert_sharded_equivalent: grads_per_step[{t}]['{p}'] must be "
                    f"a plain tensor or None, got {type(x).__name__}"
                )
        grad_leaves.append(leaves)
    ppl = _resolve_placements(
        placements, "placements", paths, pleaves, treedef, len(mesh_shape), allow_partial=False
    )
    if grad_placements is None:
        gpl = ppl
    else:
        gpl = _resolve_placements(
            grad_placements,
            "grad_placements",
            paths,
            pleaves,
            treedef,
            len(mesh_shape),
            allow_partial=True,
        )
    dp_dim = None if data_axis is None else names.index(data_axis)

    # the unsharded reference, on copies (a transform modifying its inputs is reported, and
    # must not spoil the inputs of the sharded run)
    ref = _run(
        tx,
        _clone_tree(params),
        [_clone_tree(g) for g in grads_per_step],
        None,
        None,
        update_kwargs,
        "unsharded",
        step,
    )

    ctx = _Ranks(simulated=not real, mesh_shape=mesh_shape, device_type=device_type)
    # which mesh dims each gradient leaf is unreduced over, with its spreads, made here, outside
    # the simulation (random ops inside it run once per simulated rank)
    unreduced_per_step = []
    for t, leaves in enumerate(grad_leaves):
        per_leaf = []
        for i, (x, pl) in enumerate(zip(leaves, gpl)):
            dims = []
            if x is not None:
                if pl is None and dp_dim is not None:
                    dims.append((dp_dim, "avg"))
                dims += [(d, p.reduce_op) for d, p in enumerate(pl or ()) if isinstance(p, Partial)]
            per_leaf.append(
                [(d, op, _spread(x, 1_000_003 * t + 1009 * i + 17 * d + 1)) for d, op in dims]
            )
        unreduced_per_step.append(per_leaf)

    def sharded_run():
        from torch.distributed.device_mesh import init_device_mesh

        ctx.mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=names)
        dparams = optree.tree_unflatten(
            treedef, [_sharded_leaf(ctx, x, pl, ()) for x, pl in zip(pleaves, ppl)]
        )
        dgrads = [
            optree.tree_unflatten(
                treedef,
                [
                    _sharded_leaf(ctx, x, pl, unreduced)
                    for x, pl, unreduced in zip(leaves, gpl, unreduced_per_step[t])
                ],
            )
            for t, leaves in enumerate(grad_leaves)
        ]
        mesh = Mesh(ctx.mesh, data_axis=data_axis) if explicit_mesh else None
        return _run(tx, dparams, dgrads, mesh, ctx, update_kwargs, "sharded", step)

    args = (
        len(grads_per_step),
        mesh_shape,
        rtol,
        atol,
        equal_nan,
        compare_state,
        ignore_state,
        check_placements,
        check_inputs and step != "donate",
        finite,
    )
    if real:
        got = sharded_run()
        msg = _compare_runs(ref, got, *args)
        msgs: list = [None] * dist.get_world_size()
        dist.all_gather_object(msgs, msg)
        first = next(((r, m) for r, m in enumerate(msgs) if m), None)
        if first is not None:
            raise AssertionError(f"sharded != unsharded (reported by rank {first[0]}): {first[1]}")
        return
    from .sim import simulate

    with simulate(ctx.world):
        got = sharded_run()
    msg = _compare_runs(ref, got, *args)
    if msg:
        raise AssertionError(f"sharded != unsharded: {msg}")
