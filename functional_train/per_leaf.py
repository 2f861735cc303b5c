"""``ft.step``'s per-leaf steps: the aliases whose every reduction is over one leaf, run one
leaf at a time, each leaf finished while its buffers are in cache.

``adafactor`` (without ``beta1``), ``came``, ``galore_adamw`` between projector refreshes and
8-bit Adam (``adamw(optim_bits=8)``) compute their statistics, norms and quantisation blocks per
leaf: nothing in a leaf's step depends on another leaf (no global norm). Where no leaf needs
communication (plain tensors, one process), ``ft.step`` runs these chains leaf by leaf -- a
leaf's statistics, update, clipping, moments and ``p + u`` before the next leaf is read, as the
reference implementations' per-parameter loops do -- with the chains' numbers bit for bit:
each step here calls its algorithm module's own definitions (``factored_rms``,
``adafactor_factor``, CAME's ``MOMENTUM`` part, GaLore's projections, the 8-bit kernels) on one
leaf at a time, and the chain's elementwise tail through the engine's kernels
(``elementwise.leaf_runner`` / ``apply_part``). The algorithm modules declare what an alias
computes (``FusedAdafactor``, ``FusedCame``, ``FusedGaLore``, ``FusedAdam8bit``, attached to
the alias's spec); :func:`functional_train.step.step` dispatches to the steps here. Each
returns ``None`` where the chain's own path must run instead (a mesh of more than one rank,
DTensor or complex leaves, gradients of another dtype than their parameters, a state that is
not the chain's: the chain then raises its own error).

References: HF ``transformers.optimization.Adafactor`` and ``came_pytorch.CAME`` (their
per-parameter loops); ``galore_torch.GaLoreAdamW``; bitsandbytes' ``AdamW8bit``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import foreach
from .autograd import requires_grad_like
from .base import EmptyState
from .came import MOMENTUM, FusedCame, ScaleByCameState, confidence_leaves
from .combine import PartitionState
from .engine import elementwise as E
from .engine.pool import MIN_MEAN_BYTES, Pool, Scratch, of_plan
from .engine.scalars import schedule_value
from .engine.view import per_leaf_result, per_leaf_view
from .factored import (
    FusedAdafactor,
    ScaleByFactoredRmsState,
    adafactor_factor,
    adafactor_factors,
    clip_denominators,
    decay_factors,
    factored_ema,
    factored_rms,
    factored_scale,
    leaf_rms,
    new_state_tree,
    rho_at,
)
from .galore import BackProjection, FusedGaLore, GaLoreState
from .quantization import (
    ADAM8BIT_STATE,
    QUANTIZED_FIELDS,
    FusedAdam8bit,
    ScaleByAdam8bitState,
    absmax_shape,
    is_quantized,
    kernel_maps,
)
from .spec import transform_spec
from .transforms import ScaleByScheduleState
from .tree import flatten_as, leaves_of, tree_unflatten

__all__ = ["fused_adafactor_step", "fused_came_step", "fused_galore_step", "fused_adam8bit_step"]


def fused_adafactor_step(
    fused: FusedAdafactor, grads: Any, state: Any, params: Any, mesh: Any, donate: bool
) -> tuple | None:
    """``ft.step`` of ``adafactor`` (without ``beta1``) when no leaf needs communication (plain
    tensors, one process): each leaf is finished while its buffers are in cache, its update
    made, scaled by the clip and parameter-scale factor (the RMS of a local leaf is its global
    RMS) and added to its parameter (in place with ``donate``), before the next leaf is read,
    as HF's per-parameter loop does. The numbers are the chain's, op for op (the same helpers
    on one leaf at a time). Returns ``None`` where the general path must run (a mesh of more
    than one rank, DTensor or complex leaves, gradients of another dtype than their
    parameters, or a state that is not this chain's: the chain then raises its error)."""
    if not (
        isinstance(state, tuple)
        and len(state) == 2
        and isinstance(state[0], ScaleByFactoredRmsState)
        and isinstance(state[1], ScaleByScheduleState if callable(fused.rho) else EmptyState)
    ):
        return None
    fac_state, tail_state = state
    view = per_leaf_view(grads, params, mesh, "adafactor")
    if view is None:
        return None
    b, pl, treedef = view
    act = b.active
    lr = rho_at(fused.rho, tail_state)
    new_p: dict = {}
    if not donate:  # result buffers the caller has dropped are reused (see engine/pool.py)
        new_p = dict(
            zip(act, of_plan(b.plan, "pool", Pool).take("params", [b.params[i] for i in act]))
        )
    small: list = []  # (i, u) of small leaves, finished together at the end
    keep = fused.mask(params) if fused.mask is not None else None

    def finish(i, u):
        if u.numel() * u.element_size() < MIN_MEAN_BYTES:  # few ops for all of them at once
            small.append((i, u.clone()))  # (u may be a scratch view)
            return
        p = b.params[i]
        # adafactor_factors for one local leaf, its RMS in fewer (0-dim) operations
        scaled = fused.min_scale is not None
        rms = leaf_rms([u, p] if scaled else [u], u.numel())
        factor, step = adafactor_factor(
            rms[0], rms[1] if scaled else None, lr, fused.threshold, fused.min_scale, u.dtype
        )
        out = p if donate else new_p[i]
        key = None if keep is None else bool(keep[i])
        run((u, p, factor, decay_factors([step], fused.weight_decay)[0]), (out,), key)

    def tail(us, ps, factors, steps, idx):
        # the tail's own leaf function and apply_updates, in one pass (ft.step's last stage)
        E.apply_part(
            fused.tail,
            us,
            (),
            (factors, decay_factors(steps, fused.weight_decay)),
            out=[ps if donate else [new_p[i] for i in idx]],
            params=ps,
            keys=None if keep is None else [bool(keep[i]) for i in idx],
            apply=True,
        )

    # (the tail and apply_updates on one leaf: its leaf function's kernel, called directly)
    run = E.leaf_runner(fused.tail, (), apply=True)
    scratch = of_plan(b.plan, "scratch", Scratch)
    with torch.no_grad():
        _, new_fac = factored_rms(
            b,
            fac_state,
            "scale_by_factored_rms",
            fused.decay_rate,
            None,
            fused.eps,
            0,
            finish,
            scratch,
            local=True,
        )
        if small:
            idx = [i for i, _ in small]
            us = [u for _, u in small]
            ps = [b.params[i] for i in idx]
            factors, steps = adafactor_factors(b, idx, us, ps, lr, fused.threshold, fused.min_scale)
            tail(us, ps, factors, steps, idx)
    new_tail = ScaleByScheduleState(tail_state.count + 1) if callable(fused.rho) else tail_state
    return per_leaf_result(params, pl, treedef, new_p, (new_fac, new_tail), donate)


def fused_came_step(
    fused: FusedCame, grads: Any, state: Any, params: Any, mesh: Any, donate: bool
) -> tuple | None:
    """``ft.step`` of ``came`` when no leaf needs communication (plain tensors, one process):
    each leaf is finished while it is in cache -- second moment, RMS clip, momentum,
    confidence statistics, then the chain's tail (decay, learning rate) and ``apply_updates``
    (in place with ``donate``) -- before the next is read, as ``came_pytorch``'s per-parameter
    loop does. It runs the chain's definitions: the factored statistics' helpers, the
    momentum part (:func:`momentum_leaf`) and the tail's parts through the engine's kernels,
    one leaf at a time, so the numbers are the chain's ``ft.step``'s bit for bit. Returns
    ``None`` where the general path must run (see
    :func:`functional_train.factored.fused_adafactor_step`; also when the leaves average under
    ``engine.pool.MIN_MEAN_BYTES``, 64 KiB, where the chain's batched operations are faster)."""
    if not (
        isinstance(state, tuple)
        and len(state) == 1 + len(fused.tail)
        and isinstance(state[0], ScaleByCameState)
    ):
        return None
    s = state[0]
    view = per_leaf_view(grads, params, mesh, "came", fused.min_mean_bytes)
    if view is None:
        return None
    b, pl, treedef = view
    tail = E.prologues_of(fused.tail, state[1:], b)
    if tail is None:  # (a state that is not this chain's: the chain raises)
        return None
    tail_scalars, tail_states = tail
    statics = [None if part.static is None else part.static(params) for part in fused.tail]
    act = b.active
    m_all = b.state_locals(s.exp_avg, "ScaleByCameState.exp_avg")
    fac, row_leaves, row_loc, col_leaves, col_loc = confidence_leaves(b, s)
    fset = set(fac)
    beta3 = torch.full((), fused.b3, dtype=torch.float64, device=s.count.device)
    new_p = {}
    if not donate:  # result buffers the caller has dropped are reused (see engine/pool.py)
        pool = of_plan(b.plan, "pool", Pool)
        new_p = dict(zip(act, pool.take("params", [b.params[i] for i in act])))
    scratch = of_plan(b.plan, "scratch", Scratch)
    scratch2 = of_plan(b.plan, "scratch2", Scratch)
    scratch3 = of_plan(b.plan, "scratch3", Scratch)
    new_m, new_row, new_col = {}, {}, {}
    if not donate:
        new_m = dict(zip(act, pool.take("exp_avg", [m_all[i] for i in act])))
    # (the momentum part, the tail's parts and apply_updates: their kernels, called directly)
    momentum = E.leaf_runner(MOMENTUM, (fused.b1, fused.eps2))
    finish_tail = E.leaf_runner(fused.tail, tail_scalars, apply=True)

    def finish(i, u):
        g, p, m_old = b.locals[i], b.params[i], m_all[i]
        x = u if u.dtype == m_old.dtype else u.to(m_old.dtype)
        den = clip_denominators(b, leaf_rms([x], x.numel()), fused.clip_threshold, rms=True)[0]
        m = m_old if donate else new_m[i]
        factored = i in fset
        first = scratch3.view(0, u.shape, m_old.dtype if factored else u.dtype, u.device)
        momentum((u, m_old, den), (first, m), factored)
        new_m[i] = m
        if factored:
            ((r, c, rf, cf),) = factored_ema(
                b,
                [(i, first.to(row_loc[i].dtype), row_loc[i], col_loc[i])],
                beta3,
                local=True,
                split=True,
            )
            new_row[i], new_col[i] = r, c
            # (confidence_update's definition; the factors' product in the scratch slot)
            into = scratch2.view(1, u.shape, rf.dtype, u.device)
            first = factored_scale(m, rf, cf, g.dtype, into=into)
        key = tuple(None if k is None else bool(k[i]) for k in statics)
        finish_tail((first, p), (p if donate else new_p[i],), key)

    with torch.no_grad():
        _, new_fac = factored_rms(
            b,
            ScaleByFactoredRmsState(s.count, s.v_row, s.v_col, s.v),
            "scale_by_factored_rms",
            -0.8,
            fused.b2,
            fused.eps1,
            0,
            finish,
            scratch,
            local=True,
        )
    new_s = ScaleByCameState(
        new_fac.count,
        new_fac.v_row,
        new_fac.v_col,
        new_fac.v,
        b.state_tree(s.exp_avg, "ScaleByCameState.exp_avg", [new_m[i] for i in act]),
        new_state_tree(b, row_leaves, new_row),
        new_state_tree(b, col_leaves, new_col),
    )
    new_state = (new_s, *tail_states())
    return per_leaf_result(params, pl, treedef, new_p, new_state, donate)


def fused_galore_step(
    fused: FusedGaLore, grads: Any, state: Any, params: Any, mesh: Any, donate: bool
) -> tuple | None:
    """``ft.step`` of ``galore_adamw`` between projector refreshes, when no leaf needs
    communication (plain tensors, one process, leaves averaging 64 KiB or more), leaf by leaf
    as galore-torch's per-parameter loop does: each ``"galore"`` leaf's gradient is projected,
    its Adam moments updated (in place with ``donate``, else into pooled buffers; the
    operations of ``scale_by_adam`` on one leaf, so the moments are the chain's bit for bit),
    projected back into a scratch buffer, and the label's tail (learning rate, decay) and
    ``apply_updates`` run on it in one kernel call (their parts' own, as the chain's
    ``ft.step`` runs them: the parameters are the chain's bit for bit) before the next leaf is
    read; the other labels run their chains. Returns ``None`` where the general path must run:
    a refresh step (the SVDs dominate it), a mesh of more than one rank, DTensor, complex or
    small leaves, or a state that is not this transform's (the chain then raises)."""
    if not (isinstance(state, PartitionState) and "galore" in state.inner_states):
        return None
    gst = state.inner_states["galore"]
    if not (
        isinstance(gst, tuple)
        and len(gst) == 1 + len(fused.tail)
        and isinstance(gst[0], GaLoreState)
        and isinstance(gst[0].count, torch.Tensor)
        and int(gst[0].count) % fused.update_proj_gap != 0
    ):
        return None
    view = per_leaf_view(grads, params, mesh, "galore_adamw", fused.min_mean_bytes)
    if view is None:
        return None
    b, pl, treedef = view
    labels = fused.labels_of(params)
    mine = [i for i in b.active if labels[i] == "galore"]
    if not mine or set(state.inner_states) != {"galore", *fused.others}:
        return None
    tail = E.prologues_of(fused.tail, gst[1:], b)
    if tail is None:  # (a state that is not this chain's: the chain raises)
        return None
    tail_scalars, tail_states = tail
    new_p: dict = {}
    if not donate:
        new_p = dict(
            zip(
                b.active,
                of_plan(b.plan, "pool", Pool).take("params", [b.params[i] for i in b.active]),
            )
        )
    scratch = of_plan(b.plan, "scratch", Scratch)
    g_leaves = [b.locals[i] if labels[i] == "galore" else None for i in range(len(pl))]
    p_leaves = [b.params[i] if labels[i] == "galore" else None for i in range(len(pl))]
    # (the tail's parts and apply_updates: their kernel, called directly)
    run = E.leaf_runner(fused.tail, tail_scalars, apply=True)
    no_keys = (None,) * len(fused.tail)

    def finish(i, u):  # the label's tail and apply_updates, in one pass
        p = b.params[i]
        if isinstance(u, BackProjection):
            u = u.into(scratch.view(0, p.shape, u.low.dtype, u.low.device))
        dst = p if donate else new_p[i]
        run((u, p), (dst,), no_keys)

    with torch.no_grad():
        pool = of_plan(b.plan, "pool", Pool)
        per_leaf = transform_spec(fused.galore).per_leaf
        assert per_leaf is not None
        new_galore = per_leaf(
            tree_unflatten(treedef, g_leaves),
            gst[0],
            tree_unflatten(treedef, p_leaves),
            finish,
            scratch,
            (lambda kind, xs: xs) if donate else pool.take,
        )
        # the other labels: their chains, then one add per leaf
        states = {"galore": (new_galore, *tail_states())}
        upd: dict = {}
        for name, tx in fused.others.items():
            keep = [labels[i] == name for i in range(len(pl))]
            new, states[name] = tx.update(
                tree_unflatten(treedef, [b.locals[i] if k else None for i, k in enumerate(keep)]),
                state.inner_states[name],
                tree_unflatten(treedef, [pl[i] if k else None for i, k in enumerate(keep)]),
            )
            for i, (k, x) in enumerate(zip(keep, leaves_of(new))):
                if k and x is not None and b.locals[i] is not None:
                    upd[i] = x
        if upd:
            idx = list(upd)
            if donate:
                foreach.add_([b.params[i] for i in idx], [upd[i] for i in idx])
            else:
                for i, x in zip(
                    idx, foreach.add([b.params[i] for i in idx], [upd[i] for i in idx])
                ):
                    new_p[i] = x
    new_state = PartitionState({k: states[k] for k in state.inner_states})
    return per_leaf_result(params, pl, treedef, new_p, new_state, donate)


def fused_adam8bit_step(
    tx: Any,
    fused: FusedAdam8bit,
    grads: Any,
    state: Any,
    params: Any,
    mesh: Any,
    donate: bool,
    apply: Any,
) -> tuple | None:
    """``ft.step`` of 8-bit Adam / AdamW on plain float32 CPU tensors in one process: each
    quantised leaf whose last dim is a multiple of ``block_size``, or below it (each row one
    block, as the chain's padded block), goes through ONE compiled loop nest
    (:func:`functional_train.engine.kernels.adam8bit`: dequantise, Adam, decay, learning rate,
    block maxima, requantise; in place with ``donate``) instead of the chain's forty-odd
    passes; the other leaves (float moments, other shapes) run the chain
    (``apply(params, updates, donate)`` adds their updates). The codes, block maxima and
    float moments are the chain's bit for bit; the parameters differ by the rounding of one
    square root per element (see :func:`~functional_train.engine.kernels.adam8bit`).
    Returns ``None`` where the chain must run: a mesh of more than one rank, DTensor or
    non-float32 leaves, no such leaf, ``b1 <= 0.5`` (lerp's other formula), the kernels off
    (``FT_COMPILED_KERNELS=0``) or not compilable, a state that is not this chain's."""
    from .engine import kernels
    from .engine.view import per_leaf_view

    if not (
        isinstance(state, tuple)
        and not hasattr(state, "_fields")
        and len(state) > max(fused.adam_index, fused.lr_index)
        and isinstance(state[fused.adam_index], ScaleByAdam8bitState)
    ):
        return None
    if not (fused.b1 > 0.5 and kernels.enabled()):
        return None
    view = per_leaf_view(grads, params, mesh, "adam")
    if view is None:
        return None
    b, pl, treedef = view
    st = state[fused.adam_index]
    B = fused.block_size
    fields = {
        f: flatten_as(getattr(st, f), treedef, f"{ADAM8BIT_STATE}.{f}", "params")
        for c, a, _ in QUANTIZED_FIELDS
        for f in (c, a)
    }

    def block(n: int) -> int | None:
        """The kernel's block for a last dim ``n``: ``B`` when it divides ``n``; ``n`` when
        ``n < B`` (each row is one block, as the chain's padded last block); else none."""
        return B if n % B == 0 else (n if 1 < n < B else None)

    def fits(i):
        u, g, p = b.updates[i], b.locals[i], b.params[i]
        if not (
            is_quantized(u, fused.min_8bit_size)
            and g.dtype == torch.float32
            and g.ndim >= 1
            and block(g.shape[-1]) is not None
            and g.is_contiguous()
            and p.is_contiguous()
            and kernels.usable([g, p])
        ):
            return False
        want = {
            "mu_codes": (tuple(g.shape), torch.uint8),
            "nu_codes": (tuple(g.shape), torch.uint8),
            "mu_absmax": (absmax_shape(g.shape, B), torch.float32),
            "nu_absmax": (absmax_shape(g.shape, B), torch.float32),
        }
        return all(
            type(fields[f][i]) is torch.Tensor
            and fields[f][i].is_contiguous()
            and (tuple(fields[f][i].shape), fields[f][i].dtype) == w
            for f, w in want.items()
        )

    mine = [i for i in b.active if fits(i)]
    if not mine:
        return None
    lr = fused.learning_rate
    if callable(lr):
        lr_state = state[fused.lr_index]
        if not hasattr(lr_state, "count"):
            return None
        lr = schedule_value(lr, lr_state.count)
    keep = fused.mask(params) if fused.mask is not None else None
    decays = [bool(fused.weight_decay) and (keep is None or bool(keep[i])) for i in mine]
    ins = [
        (
            b.params[i],
            b.locals[i],
            *(fields[f][i] for f in ("mu_codes", "mu_absmax", "nu_codes", "nu_absmax")),
        )
        for i in mine
    ]
    if donate:
        outs = [(x[0], x[2], x[3], x[4], x[5]) for x in ins]
    else:  # result buffers the caller has dropped are reused (see engine/pool.py)
        from .engine.pool import Pool, of_plan

        pool = of_plan(b.plan, "pool", Pool)
        outs = list(
            zip(*(pool.take(f"adam8bit.{k}", [x[k] for x in ins]) for k in (0, 2, 3, 4, 5)))
        )
    mset = set(mine)
    rest = [x if k not in mset else None for k, x in enumerate(leaves_of(grads))]
    with torch.no_grad():
        ok = kernels.adam8bit(
            ins,
            outs,
            lr=lr,
            weight_decay=fused.weight_decay,
            b1=fused.b1,
            b2=fused.b2,
            eps=fused.eps,
            count=st.count + 1,
            decoupled=[d and fused.decoupled for d in decays],
            l2=[d and not fused.decoupled for d in decays],
            maximize=fused.maximize,
            blocks=[block(b.locals[i].shape[-1]) for i in mine],
            maps=kernel_maps(b.params[mine[0]].device),
        )
    if not ok:
        return None
    # the other leaves through the chain (its counters advance once, the kernel's leaves'
    # state entries untouched), then the kernel's results in their places
    updates, new_state = tx.update(tree_unflatten(treedef, rest), state, params, mesh=mesh)
    new_params = apply(params, updates, donate)
    if donate:
        return new_params, new_state
    ns = new_state[fused.adam_index]
    new_fields = {}
    for j, f in enumerate(("mu_codes", "mu_absmax", "nu_codes", "nu_absmax"), start=1):
        leaves = flatten_as(getattr(ns, f), treedef, f"{ADAM8BIT_STATE}.{f}", "params")
        for i, o in zip(mine, outs):
            leaves[i] = o[j]
        new_fields[f] = tree_unflatten(treedef, leaves)
    states = list(new_state)
    states[fused.adam_index] = ns._replace(**new_fields)
    p_leaves = leaves_of(new_params)
    for i, o in zip(mine, outs):
        p_leaves[i] = requires_grad_like(o[0], pl[i])
    return tree_unflatten(treedef, p_leaves), tuple(states)
