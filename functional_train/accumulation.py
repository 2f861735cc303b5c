"""Gradient accumulation: the functional ``no_sync`` (Colossal-AI seed 002).

``multi_steps`` of a fusable inner transform registers a
:class:`~functional_train.engine.elementwise.Switch` (:func:`_fused_micro_steps`): ``ft.step``
runs a non-final micro-step as one pass ``acc += g`` that leaves the parameters alone, and the
final one as ``u = (acc + g) / k``, the inner's parts and ``p + u`` in one pass (the
accumulators cleared in it; a second pass first when the inner starts with a reduction such as
``clip_by_global_norm``, whose norm needs the mean). Taken for plain tensors, and DTensors
whose gradients need no reduction (FSDP-style; unreduced gradients keep the general path, whose
non-final micro-steps issue no collective), gradients of their accumulators' dtypes, and no
``should_skip_update_fn``; anything else runs the general ``update``. Under ``torch.compile``,
where the counters cannot be read on the host, one fused form serves every micro-step: the
accumulation, the inner's parts guarded by the tensor "this is the cycle's last"
(:func:`~functional_train.engine.elementwise.guarded`: their state kept where it is false)
and the updates zeroed there.
"""

from __future__ import annotations

import array
import functools
import itertools
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import _validate as V
from . import foreach
from .aliasing import forget_shared, known_zeros
from .autograd import detached, host_value, host_values, traced
from .base import GradientTransformation, call_reduced, declare, passes_unreduced, run_fused
from .engine import elementwise as E
from .engine.dtensor import spec_of, to_local, wrap
from .engine.metadata import Memo
from .engine.plan import (
    all_on_data_axis,
    by_layout,
    by_specs,
    describe,
    only_dtensors,
    plan_for,
    present_of,
    same_layout,
    same_layouts,
)
from .engine.scalars import positions_index, scalar_program
from .leaves import DTYPE, SHAPE
from .mesh import Mesh
from .spec import MicroSteps, attach_spec
from .tree import (
    flatten_as,
    indexed,
    leaves_of,
    state_zeros_like,
    tree_flatten,
    tree_paths,
    tree_unflatten,
    tree_zeros_like,
)

__all__ = ["multi_steps", "MultiStepsState", "has_updated"]


_MINI, _SEEN = "multi_steps: MultiStepsState.mini_step", "multi_steps: MultiStepsState.seen"


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
        mini_step: micro-steps since the last inner update, in ``[0, every_k)`` (int64, 0-dim,
            always on the CPU: reading it is the one host read of the library, and it needs no
            device synchronisation).
        gradient_step: number of inner updates so far (int64, 0-dim).
        inner_state: the inner transform's state, untouched by non-final micro-steps.
        acc_grads: running sum of the micro-step gradients, params-shaped, *unreduced* (each
            rank's own contribution; ``Partial`` DTensor gradients keep their placements);
            zeros again when a cycle ends.
        seen: one flag per leaf of the flattened params tree (``None`` leaves included): 1 if
            the leaf had a gradient in the current cycle, else 0 (a tuple of 0-dim int64 CPU
            tensors, read on the host like ``mini_step``): a ``None``
            gradient is a zero contribution to a leaf that has one, and a leaf without any
            gradient in the cycle gets a ``None`` gradient in the inner update.
        skip_state: what ``should_skip_update_fn`` returned last (its info dict of tensors;
            ``{}`` without one).
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: Any
    acc_grads: Any
    seen: tuple
    skip_state: Any = {}


def multi_steps(
    inner: GradientTransformation,
    every_k: int,
    *,
    acc_dtype: torch.dtype | None = None,
    should_skip_update_fn: Callable | None = None,
) -> GradientTransformation:
    """Accumulate gradients over ``every_k`` micro-steps, then apply ``inner`` once (optax
    ``MultiSteps`` semantics).

    Micro-steps ``1 .. every_k-1`` add the gradient to a local accumulator and return zero updates
    (placements of the parameters); they run no inner compute and issue **no collective**, even
    when gradients are unreduced over ``Mesh.data_axis`` or ``Partial`` (the functional
    ``booster.no_sync``). Micro-step ``every_k`` feeds the mean of the ``every_k`` gradients to
    ``inner``, which reduces it once. So ``multi_steps(adam, k)`` over ``k`` micro-batches of size
    ``b`` equals ``adam`` over the batch of ``k*b`` for a mean loss.

    ``None`` gradients: a ``None`` gradient is a zero contribution (as an unused parameter's
    gradient is under DDP's ``no_sync``): a leaf with a gradient on some micro-step of a cycle
    gets the mean over all ``every_k`` micro-steps on the final one, even when its gradient is
    ``None`` there; a leaf with no gradient in the whole cycle gets a ``None`` gradient in the
    inner update (frozen, untouched). The accumulators are cleared at the end of every cycle.

    Args:
        inner: the transform to apply every ``every_k`` micro-steps.
        every_k: >= 1.
        acc_dtype: accumulator dtype (default ``None``: float32, or the params' dtype when wider).
        should_skip_update_fn: optax's ``MultiSteps`` argument: ``fn(updates, gradient_step,
            params, mesh=...) -> (should_skip 0-dim bool tensor, info dict of tensors)``, e.g.
            :func:`~functional_train.skip_not_finite` or
            :func:`~functional_train.skip_large_updates`. A skipped micro-step returns zero
            updates and changes nothing but ``skip_state`` (no accumulation, no inner step).
            The flag is read on the host (a device synchronisation on accelerators), and the
            function's own collectives run on every micro-step (for the two above one scalar
            all-reduce, plus, under a data axis, the reduction of the gradients it inspects).

    State: :class:`MultiStepsState`. Use :func:`has_updated` to tell real steps apart.

    Raises:
        ValueError: ``every_k < 1``; at update, a state from another transform, gradients whose
            tree differs from ``params``, or a leaf whose gradient changes its layout (plain /
            DTensor, placements) within a cycle.
        TypeError: at update, a gradient that is not floating point or complex (naming the
            leaf; give integer and bool parameters a ``None`` gradient).
        TypeError: ``inner`` is not a GradientTransformation.
    """
    every_k = V.integer("every_k", every_k, where="multi_steps", low=1)
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"multi_steps: inner must be a GradientTransformation, got {type(inner).__name__}"
        )

    inner_spec = E.fusable_of(inner) or E.switch_of(inner)
    switch = (
        _fused_micro_steps(inner_spec, every_k)
        if inner_spec is not None and should_skip_update_fn is None
        else None
    )

    def init_fn(params):
        gradient_step = torch.zeros((), dtype=torch.int64, device="cpu")
        skip_state: Any = {}
        if should_skip_update_fn is not None:  # its info's structure, zeroed (as optax)
            _, info = should_skip_update_fn(tree_zeros_like(params), gradient_step, params)
            skip_state = optree.tree_map(torch.zeros_like, info)
        return MultiStepsState(
            mini_step=torch.zeros((), dtype=torch.int64, device="cpu"),
            gradient_step=gradient_step,
            inner_state=inner.init(params),
            acc_grads=state_zeros_like(params, acc_dtype),
            seen=_BLOCKS.make(0, len(leaves_of(params))),
            skip_state=skip_state,
        )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, MultiStepsState):
            raise ValueError(
                f"multi_steps: expected a MultiStepsState from multi_steps.init, "
                f"got {type(state).__name__}"
            )
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(
                f"multi_steps: mesh must be a functional_train.Mesh or None, "
                f"got {type(mesh).__name__}"
            )
        chosen = run_fused(switch, updates, state, params, mesh, "multi_steps")
        if chosen is not None:  # the accumulation and the inner transform fused
            g, treedef = tree_flatten(updates)
            return _in_dtypes_of(chosen[0], treedef, g), chosen[1]
        skip_state = state.skip_state
        if should_skip_update_fn is not None:
            skip, skip_state = should_skip_update_fn(
                updates, state.gradient_step, params, mesh=mesh
            )
            if bool(skip):  # the micro-step is dropped: zero updates, nothing accumulated
                return (_zeros_for(updates, params), state._replace(skip_state=skip_state))
        g, treedef = tree_flatten(updates)  # (the paths only where an error names one)
        g = detached(g)  # no graph into the accumulators (see functional_train.autograd)
        acc = flatten_as(state.acc_grads, treedef, "MultiStepsState.acc_grads", "the updates")
        if params is not None:  # the result is unused: the call validates params' structure
            flatten_as(params, treedef, "params", "the updates")
        for i, x, a in indexed(g, acc):
            if x is not None and a is not None and tuple(x.shape) != tuple(a.shape):
                raise ValueError(
                    f"multi_steps: update leaf '{tree_paths(updates)[i]}' has shape "
                    f"{tuple(x.shape)}, expected {tuple(a.shape)}"
                )
        k = int(host_value(state.mini_step, _MINI))  # CPU counter: a host read without device
        # synchronisation
        seen = [int(v) for v in seen_values(state.seen)]  # CPU flags: no sync either
        if len(seen) != len(g):
            raise ValueError(
                f"multi_steps: MultiStepsState.seen has {len(seen)} flags for "
                f"{len(g)} leaves; the state comes from another tree"
            )
        active, fresh = [], []  # leaves with a gradient now; of those, the first in the cycle
        for i, x in indexed(g):
            if x is None or acc[i] is None:
                continue
            if not (x.dtype.is_floating_point or x.dtype.is_complex):
                raise TypeError(
                    f"multi_steps: update leaf '{tree_paths(updates)[i]}' has "
                    f"dtype {x.dtype}; "
                    f"gradients must be floating point (give integer or bool "
                    f"parameters a None gradient)"
                )
            if seen[i] and spec_of(x) is not spec_of(acc[i]) and spec_of(x) != spec_of(acc[i]):
                raise ValueError(
                    f"multi_steps: update leaf '{tree_paths(updates)[i]}' has the layout "
                    f"{describe(x)} on this micro-step but {describe(acc[i])} on an earlier "
                    f"one of the cycle; the gradients of one cycle must keep one layout"
                )
            active.append(i)
            if not seen[i]:
                fresh.append(i)
        new_seen = list(seen)
        for i in fresh:
            new_seen[i] = 1
        new_acc = list(acc)
        specs = {}
        # a leaf's first gradient of the cycle: the accumulator takes its placements (Partial
        # stays Partial); later ones add to it
        for i in fresh:
            x = to_local(g[i])
            new_acc[i] = x.to(to_local(acc[i]).dtype, copy=True)
            specs[i] = spec_of(g[i])
        added = [i for i in active if seen[i]]
        if added:
            al = [to_local(acc[i]) for i in added]
            summed = foreach.add(al, [to_local(g[i]).to(a.dtype) for i, a in zip(added, al)])
            for i, x in zip(added, summed):
                new_acc[i] = x
                specs[i] = spec_of(acc[i])
        for i in active:
            new_acc[i] = wrap(new_acc[i], specs[i])
        if k + 1 < every_k:
            return _zeros_for(updates, params), MultiStepsState(
                state.mini_step + 1,
                state.gradient_step,
                state.inner_state,
                tree_unflatten(treedef, new_acc),
                tuple(
                    _flag(1) if not s and n else f for f, s, n in zip(state.seen, seen, new_seen)
                ),
                skip_state,
            )
        # the final micro-step: every leaf with a gradient in the cycle gets the mean, a
        # None gradient now counting as zero; the accumulators are cleared
        cycle = [i for i, f in indexed(new_seen) if f and acc[i] is not None]
        summed = [to_local(new_acc[i]) for i in cycle]
        specs = [spec_of(new_acc[i]) for i in cycle]
        active = cycle
        mean = foreach.div(summed, float(every_k)) if summed else []
        grads = list(g)
        for i, m, spec in zip(active, mean, specs):
            grads[i] = wrap(m, spec)
            new_acc[i] = wrap(torch.zeros_like(m), spec)
        # a foreign inner transform gets the reduced mean (call_reduced)
        new_updates, inner_state, _ = call_reduced(
            inner, tree_unflatten(treedef, grads), state.inner_state, params, mesh, extra
        )
        new_updates = _in_dtypes_of(new_updates, treedef, g)
        return new_updates, MultiStepsState(
            torch.zeros_like(state.mini_step),
            state.gradient_step + 1,
            inner_state,
            tree_unflatten(treedef, new_acc),
            tuple(_flag(0) if v else f for f, v in zip(state.seen, new_seen)),
            skip_state,
        )

    # what comes out is what inner returns: still unreduced if inner passes unreduced values on
    attach_spec(
        update_fn,
        passes_unreduced=passes_unreduced(inner),
        micro_steps=(
            MicroSteps(inner, every_k, acc_dtype) if should_skip_update_fn is None else None
        ),
    )
    if switch is not None:
        E.register(update_fn, switch)
    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


def _fused_micro_steps(inner_spec: E.Fusable | E.Switch, every_k: int) -> E.Switch:
    """``multi_steps(inner, every_k)``'s :class:`~functional_train.engine.elementwise.Switch`
    for ``ft.step``: per call, the Fusable of a non-final micro-step (``acc += g``, zero
    updates) or of the final one (``(acc + g) / every_k``, then ``inner``'s parts; the
    accumulators cleared), in two variants each: every leaf with a gradient adds to its
    accumulator, or every such leaf starts its cycle now (its accumulator takes ``g``, as the
    general path copies it). ``None`` (the general ``update``) for what these do not cover.
    Where ``inner``'s fused form is itself chosen per call (``inner_spec`` a Switch: a chain
    holding ``inject_hyperparams``), the final micro-step's is chosen then (eagerly; under
    ``torch.compile`` the general path)."""
    kf = float(every_k)
    inner_switch = inner_spec if isinstance(inner_spec, E.Switch) else None
    inner_fus = inner_spec if isinstance(inner_spec, E.Fusable) else None

    def check(state, b):
        if not isinstance(state, MultiStepsState):
            raise ValueError(
                f"multi_steps: expected a MultiStepsState from multi_steps.init, "
                f"got {type(state).__name__}"
            )

    def fields(state):
        return ((state.acc_grads, "MultiStepsState.acc_grads"),)

    def non_final_prologue_of(fresh: bool):
        """A non-final micro-step's prologue where every leaf with a gradient starts its
        cycle (``fresh``: its flag 0, set to 1) or every one adds (its flag 1 already): the
        choice ``choose`` made from the flags, so the new flags need no second read of them
        (the leaves without a gradient keep theirs)."""

        def non_final_prologue(state, b):
            check(state, b)
            return (), functools.partial(non_final_finish, state, set(b.active) if fresh else None)

        return non_final_prologue

    def non_final_finish(state, active, trees):
        n = len(state.seen)
        if active is None:  # (every leaf with a gradient seen already: the same flags)
            seen = state.seen
        elif len(active) == n:
            seen = _BLOCKS.make(1, n)
        else:  # (a masked / partition's transform: its leaves' flags, the others' kept)
            seen = _BLOCKS.with_ones(state.seen, active)
        return MultiStepsState(
            state.mini_step + 1,
            state.gradient_step,
            state.inner_state,
            trees[0],
            seen,
            state.skip_state,
        )

    def final_prologue(state, b):
        check(state, b)

        def finish(trees):
            return MultiStepsState(
                torch.zeros_like(state.mini_step),
                state.gradient_step + 1,
                state.inner_state,  # (replaced by the inner's new state in join)
                trees[0],
                # (every flag 0 after the cycle's last micro-step: those set, and those of
                # leaves without a gradient all cycle, which hold 0)
                _BLOCKS.make(0, len(state.seen)),
                state.skip_state,
            )

        return (), finish

    def summed(u, s):
        """``acc + g``, in the accumulator's dtype (every variant's accumulation)."""
        return s[0] + u.to(s[0].dtype)

    def add(u, p, s, h, k):
        """``acc + g`` (the update passes, unused)."""
        return u, (summed(u, s),)

    def start(u, p, s, h, k):
        """``g`` (a copy; the accumulator was zeros)."""
        return u, (u.to(s[0].dtype, copy=True),)

    def mean_add(u, p, s, h, k):
        """``(acc + g) / every_k``; the accumulator cleared."""
        return summed(u, s) / kf, (torch.zeros_like(s[0]),)

    def mean_start(u, p, s, h, k):
        """``g / every_k`` (``every_k == 1``, or every leaf's first gradient of the cycle)."""
        return u.to(s[0].dtype, copy=True) / kf, (torch.zeros_like(s[0]),)

    def part(leaf, prologue):
        return E.Elementwise("multi_steps", leaf, prologue, fields, 1)

    def one(state):
        return [state]

    def first(states):
        return states[0]

    def final_variants(inner_fus: E.Fusable) -> dict:
        """The final micro-step's Fusables over ``inner_fus``, by ``fresh``."""

        def split(state):
            return [state, *inner_fus.split(state.inner_state)]

        def join(states):
            return states[0]._replace(inner_state=inner_fus.join(states[1:]))

        return {
            fresh: E.Fusable((first, *inner_fus.parts), split, join)
            for fresh, first in ((False, mean_add_part), (True, mean_start_part))
        }

    # under torch.compile the counters cannot be read on the host: one Fusable for every
    # micro-step, the flag "this is the cycle's last" a tensor in the run context, the inner
    # parts guarded by it (their state kept where it is false, as apply_if_finite keeps it
    # for a non-finite step) and the updates zeroed where it is false
    key = E.context_key("multi_steps")

    def traced_prologue(state, b, ctx):
        check(state, b)
        active = set(b.active)
        # (an active leaf's flag: 0 after the cycle's last micro-step, else 1, computed once;
        # a flag of its own per leaf: three graph operations per leaf took inductor ~3 s.
        # Each flag a view of one buffer: inductor merges copies of one value into one
        # output, the flags would come back as one tensor, and dynamo, guarding against
        # duplicate inputs, would compile the next call again)
        # (an inactive leaf is one the transform does not hold, outside a masked /
        # partition's leaves (see _leaves_held): its flag stays 0, made with the others: handed
        # back as it was, a pure step would copy it, an operator per flag)
        dtypes = {f.dtype for f in state.seen}
        one_dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        on = "" if len(active) == len(state.seen) else ",".join(map(str, sorted(active)))
        final, first, mini_step, gradient_step, flags = _cycle(
            state.mini_step,
            state.gradient_step,
            every_k,
            len(active) if one_dtype is None else len(state.seen),
            one_dtype,
            "" if one_dtype is None else on,
        )
        ctx[key] = final

        def finish(trees):
            if one_dtype is not None:  # (one dtype: one op, not one a leaf)
                seen = tuple(flags.unbind())
            else:
                fresh = iter(flags.unbind())
                seen = tuple(
                    [
                        next(fresh).to(f.dtype) if i in active else f
                        for i, f in enumerate(state.seen)
                    ]
                )
            return MultiStepsState(
                mini_step,
                gradient_step,
                state.inner_state,  # (replaced by the inner's new state in join)
                trees[0],
                seen,
                state.skip_state,
            )

        # (the flag the part is guarded by last: see Elementwise.guard)
        return (first, final), finish

    def traced_add(u, p, s, h, k):
        """``acc + g``, or on the cycle's first micro-step ``g`` (the copy the eager first
        micro-step makes; the accumulators are zeros then, and the fused kernel, specialised
        per value of the flag, does not read them), its mean the update (kept where the
        micro-step is the cycle's last); the accumulator cleared there."""
        acc = torch.where(h[0] != 0, u.to(s[0].dtype), summed(u, s))
        return acc / kf, (torch.where(h[1] != 0, torch.zeros_like(acc), acc),)

    # (its updates used only where the flag holds: the parts after it are guarded by it)
    traced_first = E.Elementwise(
        "multi_steps", traced_add, traced_prologue, fields, 1, context=True, guard=E.DISCARDS
    )
    traced_last = E.zeroed_unless(key, "multi_steps")

    def traced_parts(inner_parts: tuple) -> tuple:
        return (
            traced_first,
            *(E.guarded(q, key, "multi_steps") for q in inner_parts),
            traced_last,
        )

    def traced_form(inner_fus: E.Fusable, parts: tuple) -> E.Fusable:
        return E.Fusable(
            parts,
            lambda state: [state, *inner_fus.split(state.inner_state), None],
            lambda states: states[0]._replace(inner_state=inner_fus.join(states[1:-1])),
        )

    traced_variant = (
        None if inner_fus is None else traced_form(inner_fus, traced_parts(inner_fus.parts))
    )
    # (an inner Switch's choice under torch.compile is a new Fusable per call over the parts
    # it declares, its traced_parts: the parts derived from them are made here, as a traced
    # step cannot make parts, whose registry holds weak references)
    switch_parts = None
    if inner_switch is not None and inner_switch.traced_parts is not None:
        switch_parts = traced_parts(inner_switch.traced_parts)
    has_traced = traced_variant is not None or switch_parts is not None

    def traced_choice(updates, state, params, mesh) -> E.Fusable | None:
        """The traced form: over the inner transform's fused form, or over its Switch's
        choice where the Switch declares its parts under ``torch.compile``
        (``inject_hyperparams``' where it reads no value on the host)."""
        if traced_variant is not None or switch_parts is None:
            return traced_variant
        f = inner_switch.choose(updates, state.inner_state, params, mesh)
        if f is None or f.zero_updates or len(f.parts) + 2 != len(switch_parts):
            return None
        return traced_form(f, switch_parts)

    mean_add_part = part(mean_add, final_prologue)
    mean_start_part = part(mean_start, final_prologue)
    variants = {
        (False, fresh): E.Fusable(
            (part(leaf, non_final_prologue_of(fresh)),), one, first, zero_updates=True
        )
        for fresh, leaf in ((False, add), (True, start))
    }
    if inner_fus is not None:
        variants.update({(True, f): v for f, v in final_variants(inner_fus).items()})

    def variant(final: bool, fresh: bool, state, trees: Callable[[], tuple], mesh):
        if not final or inner_switch is None:
            return variants[(final, fresh)]
        updates, params = trees()
        f = inner_switch.choose(updates, state.inner_state, params, mesh)
        if f is None:
            return None
        # (an inner choice of zero updates, a partition of multi_steps' non-final
        # micro-steps: written out, as a chain of it writes them)
        return final_variants(E.zeros_written(f))[fresh]

    def choose(updates, state, params, mesh):
        compiling = torch.compiler.is_compiling()
        if (
            params is None
            or not isinstance(state, MultiStepsState)
            or (traced() and not compiling)  # (a torch.func transform: the general path)
            or (compiling and not has_traced)
        ):
            return None
        if compiling and mesh is None:  # (no treedef: dynamo traces optree's flattening)
            g, acc, pl = leaves_of(updates), leaves_of(state.acc_grads), leaves_of(params)
            if not len(g) == len(acc) == len(pl) == len(state.seen):
                return None
            held = _leaves_held(g, acc, pl)
            # (no leaf held: a partition's group without leaves, stepped by the traced form
            # too, whose counter is a tensor; the general path would read it on the host,
            # and the graph would be specialised on the cycle's position: a recompile)
            if held is None or (held[0] and not _alike(*held)):
                return None
            return traced_choice(updates, state, params, mesh)
        g, treedef = tree_flatten(updates)
        pl = (
            (lambda: _leaves_or_none(params, treedef))
            if mesh is None
            else _leaves_or_none(params, treedef)
        )
        return chosen(treedef, g, state, pl, lambda: (updates, params), mesh, compiling)

    def choose_leaves(treedef, g: list, state, pl: list, mesh):
        """``choose`` on the leaves (see ``Switch.choose_leaves``; eagerly only)."""
        if not isinstance(state, MultiStepsState) or traced():
            return None
        return chosen(
            treedef,
            g,
            state,
            pl,
            lambda: (tree_unflatten(treedef, g), tree_unflatten(treedef, pl)),
            mesh,
            False,
        )

    def chosen(treedef, g: list, state, pl, trees: Callable[[], tuple], mesh, compiling: bool):
        """The choice from the leaves: ``pl`` the params' leaves (``None`` where they are not
        flattened by ``treedef``: the general path raises), or where ``mesh`` is ``None`` a
        function giving them (read only where the dtypes differ); ``trees()``: the updates'
        and params' trees, for an inner Switch or the traced form (``compiling``)."""
        try:
            acc = flatten_as(state.acc_grads, treedef, "MultiStepsState.acc_grads", "the updates")
        except ValueError:
            return None  # (the general path raises)
        if len(state.seen) != len(g) or (mesh is not None and pl is None):
            return None
        if mesh is not None and not gradients_reduced(treedef, g, pl, mesh):
            return None  # (unreduced gradients: accumulated as they are, reduced once)
        if compiling:  # (no host read: every leaf alike, the cycle's position a tensor)
            held = _leaves_held(g, acc, pl)
            if held is None or not _alike(*held):
                return None
            updates, params = trees()
            return traced_choice(updates, state, params, mesh)
        # the CPU counter and flags: host reads without a device synchronisation (the state
        # keeps them on the CPU whatever the parameters' device, so this holds on CUDA too)
        seen = seen_values(state.seen)  # (a block's: one tolist; else .item() per flag)
        final = int(state.mini_step) + 1 >= every_k
        if len(set(seen)) == 1 and _alike(g, acc, pl):
            return variant(final, not seen[0], state, trees, mesh)
        both = _both_present(g, acc)  # (a masked / partition's transform: None elsewhere)
        if both is not None:
            # (each gradient of its accumulator's dtype, as the loop below asks: the
            # combinator's update returns the fused form's updates as they are)
            on, g_on, acc_on = both
            v = set(itertools.compress(seen, on))
            if len(v) == 1 and _alike(g_on, acc_on):
                return variant(final, not v.pop(), state, trees, mesh)
        fresh = None
        for i, (x, a) in enumerate(zip(g, acc)):
            if x is None or a is None:
                if final and seen[i] and a is not None:
                    return None  # a leaf of the cycle without a gradient now
                continue
            if (
                type(x) is not type(a)
                or type(x) not in (torch.Tensor, DTensor)
                or x.dtype != a.dtype
                or not x.dtype.is_floating_point
                or x.shape != a.shape
                or (type(x) is DTensor and not same_layout(spec_of(x), spec_of(a)))
            ):
                return None
            f = not seen[i]
            if fresh is None:
                fresh = f
            elif fresh != f:
                return None  # some leaves start their cycle, others add: the general path
        if fresh is None:
            return None
        return variant(final, fresh, state, trees, mesh)

    # (what it chooses under torch.compile: the traced form, over these parts)
    return E.Switch(
        choose,
        traced_variant.parts if traced_variant is not None else switch_parts,
        choose_leaves,
    )


def _in_dtypes_of(updates: Any, treedef: Any, g: list) -> Any:
    """``updates`` in the gradients' (``g``, flat) dtypes: the inner transform saw the
    accumulators' (float32 for bfloat16 gradients); every micro-step returns updates in the
    gradients' dtypes."""
    out = flatten_as(updates, treedef, "multi_steps' inner updates", "the updates")
    if not torch.compiler.is_compiling():  # (dynamo does not trace attrgetter)
        try:  # (every leaf a tensor, the common case: C loops, where the pairs' Python loop
            # below took ~5% of an update + apply_updates micro-step's host time, 244 leaves)
            if list(map(DTYPE, out)) == list(map(DTYPE, g)):
                return updates
        except AttributeError:  # (a None leaf)
            pass
    if not any(o is not None and x is not None and o.dtype != x.dtype for o, x in zip(out, g)):
        return updates
    return tree_unflatten(
        treedef,
        [
            o if o is None or x is None or o.dtype == x.dtype else o.to(x.dtype)
            for o, x in zip(out, g)
        ],
    )


def _leaves_held(g: list, acc: list, pl: list) -> tuple[list, list, list] | None:
    """The leaves the traced form steps (``torch.compile``, where the counters and flags
    cannot be read on the host): those with a gradient, an accumulator and a parameter,
    as three lists; the leaves with none of the three (outside a ``masked`` /
    ``partition``'s leaves: the combinator gives its transform ``None`` there) left out.
    ``None`` where a leaf has some but not all three (a leaf without a gradient now may have
    one earlier in the cycle, which only the general path tells)."""
    if all(x is not None for x in g):  # (checked once: dynamo traces every loop)
        return g, acc, pl
    present = [[x is not None, a is not None, p is not None] for x, a, p in zip(g, acc, pl)]
    if any(any(h) and not all(h) for h in present):
        return None
    on = [h[0] for h in present]
    g, acc, pl = ([v for v, o in zip(xs, on) if o] for xs in (g, acc, pl))
    return g, acc, pl


def _both_present(g: list, acc: list) -> tuple[tuple, list, list] | None:
    """``(on, gradients, accumulators)``: per leaf whether it has a gradient, and the
    present ones (:func:`~.engine.plan.present_of`), where every leaf has both a gradient
    and an accumulator or neither (the leaves outside a ``masked`` / ``partition``'s
    transform's), and some leaf neither; else ``None``. Whole-list C loops."""
    on, g_on = present_of(g)
    if all(on):
        return None
    on_acc, acc_on = present_of(acc)
    return None if on != on_acc else (on, g_on, acc_on)


def _leaves_or_none(params: Any, treedef: Any) -> list | None:
    """``params`` flattened as the gradients (``treedef``), or ``None`` where it is not."""
    try:
        return flatten_as(params, treedef, "params", "the updates")
    except ValueError:
        return None


def _alike(g: list, acc: list, pl: list | Callable | None = None) -> bool:
    """Every gradient a plain tensor (or every one a DTensor) of a floating dtype and of its
    accumulator's shape (and layout), by whole-list checks (leaf by leaf under
    ``torch.compile``: dynamo does not trace ``attrgetter``). Its dtype is its accumulator's,
    or (bfloat16 gradients into float32 accumulators) its parameter's: ``ft.step`` then
    rounds the update to it in ``p + u.to(p.dtype)``, as the general path returns updates in
    the gradients' dtypes (``pl``: the parameters' leaves in the gradients' order, or a
    function giving them, called only where the dtypes differ; without them the dtypes must
    be the accumulators')."""
    if only_dtensors(g, acc):  # (decided by their spec objects: remembered per them)
        same, differ = by_specs("multi_steps alike", (g, acc), lambda: _alike_checks(g, acc))
    else:
        hit = _ALIKE_BY_METADATA.get(None, (g, acc))
        if hit is None:
            hit = _alike_checks(g, acc)
            _ALIKE_BY_METADATA.put(None, (g, acc), hit)
        same, differ = hit
    if same and differ:
        if callable(pl):
            pl = pl()
        if pl is None:
            return False
        same = all(x.dtype == a.dtype or x.dtype == p.dtype for x, a, p in zip(g, acc, pl))
    return same


# (_alike_checks' answers for plain tensors with these exact metadata: one C++ check per list
# where it reads three attributes of every tensor; see .engine.metadata)
_ALIKE_BY_METADATA = Memo()


def _alike_checks(g: list, acc: list) -> tuple[bool, bool]:
    """``(same, differ)`` for :func:`_alike`: ``same``, the checks of every leaf but its
    dtype's against its parameter's; ``differ``, some gradient's dtype is not its
    accumulator's (then the parameters decide)."""
    compiling = torch.compiler.is_compiling()
    kinds = {type(x) for x in g} if compiling else set(map(type, g))
    if len(kinds) != 1 or not kinds <= {torch.Tensor, DTensor}:
        return False, False
    if ({type(a) for a in acc} if compiling else set(map(type, acc))) != kinds:
        return False, False
    if compiling:
        same = all(
            [
                x.shape == a.shape and x.dtype.is_floating_point and a.dtype.is_floating_point
                for x, a in zip(g, acc)
            ]
        )
        differ = same and [x.dtype for x in g] != [a.dtype for a in acc]
    else:  # (C loops: this runs for every micro-step)
        g_dtypes, acc_dtypes = list(map(DTYPE, g)), list(map(DTYPE, acc))
        same = all(d.is_floating_point for d in {*g_dtypes, *acc_dtypes}) and list(
            map(SHAPE, g)
        ) == list(map(SHAPE, acc))
        differ = same and g_dtypes != acc_dtypes
    same = same and (kinds == {torch.Tensor} or same_layouts(g, acc))
    return same, same and differ


def gradients_reduced(treedef, g: list, pl: list, mesh: Mesh) -> bool:
    """Whether the gradients need no reduction and no presence agreement (the view of a
    micro-step then issues no collective): DTensors in their parameters' placements, with
    ``mesh.data_axis`` reduced already (FSDP-style parameters placed over it) or absent.
    Remembered per layout (:func:`~.engine.plan.by_layout`: it asks nothing else)."""
    return by_layout(
        ("multi_steps reduced", treedef, mesh),
        (g, pl),
        lambda: _reduced_now(treedef, g, pl, mesh),
    )


def _reduced_now(treedef, g: list, pl: list, mesh: Mesh) -> bool:
    if mesh.pending_data_reduction and not all_on_data_axis(pl, mesh.data_axis):
        return False
    plan = plan_for(treedef, g, pl, mesh)
    return not (plan.data_rounds or plan.partial_rounds or plan.relayout)


def _zeros_for(updates, params):
    """Zero updates in the parameters' layout (the updates' layout without params) and the
    updates' dtype; ``None`` stays ``None``."""

    def zero(u, r):
        if u is None or r is None:
            return None
        return wrap(known_zeros(to_local(r), to_local(u).dtype), spec_of(r))

    return optree.tree_map(zero, updates, updates if params is None else params, none_is_leaf=True)


def _flag(v: int) -> torch.Tensor:
    # (scalar_tensor: a third of torch.tensor's host time, for a flag per leaf)
    return torch.scalar_tensor(v, dtype=torch.int64, device="cpu")


def _flags(v: int, n: int):
    """An iterator of ``n`` flags holding ``v``: 0-dim int64 CPU tensors, each its own element
    of one buffer (one allocation per step where a flag each cost about 1.2 us; distinct
    memory, so loading a checkpoint into them in place keeps them apart)."""
    return iter(_FlagBlocks.new(v, n)[0])


class _FlagBlocks:
    """``MultiStepsState.seen`` as the library writes it where every leaf's flag is new: a
    block, one int64 CPU buffer of ``n`` elements whose flags are its 0-dim views (distinct
    memory, as :func:`_flags` makes them), remembered by the tuple that holds them, so that

    - reading a remembered tuple's flags is one ``tolist`` of its buffer, which holds what
      the views hold (a checkpoint loaded into the state in place included), where reading
      them one ``.item()`` at a time took 0.2 to 0.9 us a flag, every micro-step (a
      ``multi_steps`` cycle of 4 calls read 5 x 122 flags on the benchmark tree);
    - a new block reuses a remembered one that nothing outside this registry holds any more:
      no reference to its tuple, to a flag or to the buffer, and no other tensor on its
      memory (CPython's reference counts and the storage's use count, compared with those
      of a block just made: :meth:`_counts`): one ``fill_`` where ``unbind`` made ``n`` views
      (170 to 270 us for 122 flags), twice a cycle.

    Eagerly on plain CPU tensors only (:func:`plain_mode`; elsewhere plain flags); at most
    :attr:`LIMIT` blocks are remembered (beyond, new blocks are not)."""

    LIMIT = 64

    def __reduce__(self):
        # (pickled by name, the module's one registry: the transforms' functions that read it
        # are pickled by value, by cloudpickle, for TorchOptimizer and precompiled_step's
        # fingerprint, which must not carry this process's blocks)
        return "_BLOCKS"

    def __init__(self):
        self._blocks: dict[int, tuple] = {}  # id(tuple of flags) -> (that tuple, its buffer)
        self._lock = threading.Lock()
        self._free = tuple(self._counts(self.new(0, 2)))  # (a block nothing else holds)

    @staticmethod
    def new(v: int | list, n: int) -> tuple:
        """``(n flags holding v, their buffer)``: the views of one int64 CPU buffer (``v``
        a list: the flags' values, one each)."""
        if isinstance(v, list):
            base = torch.tensor(v, dtype=torch.int64)
        else:
            base = torch.full((n,), v, dtype=torch.int64)
        return base.unbind(), base

    @staticmethod
    def _counts(entry: tuple) -> Iterator:
        """The references to a block's tuple, buffer and flags (the flags' distinct counts)
        and its memory's users beyond its ``n + 1`` tensors, one after the other (a comparison
        with a free block's ends at the first that differs: a held block's tuple, as a rule)."""
        flags, base = entry
        yield sys.getrefcount(flags)
        yield sys.getrefcount(base)
        yield torch._C._storage_Use_Count(base.untyped_storage()._cdata) - len(flags)
        yield frozenset(map(sys.getrefcount, flags))

    def _is_free(self, entry: tuple) -> bool:
        return all(map(operator.eq, self._counts(entry), self._free))

    def make(self, v: int | list, n: int) -> tuple:
        """``n`` flags holding ``v`` (a list: their values, one each), a tuple; a remembered
        block's where one is free."""
        if not plain_mode() or n == 0:
            return self.new(v, n)[0]
        with self._lock:  # (threads: from the check that nothing holds a block to its return)
            for entry in list(self._blocks.values()):
                if len(entry[0]) == n and self._is_free(entry):
                    if isinstance(v, list):  # (by an array: torch.tensor parses a list's
                        # elements one by one, 19 us for 242 flags where this takes 5)
                        entry[1].copy_(torch.frombuffer(array.array("q", v), dtype=torch.int64))
                    else:
                        entry[1].fill_(v)
                    forget_shared(entry[0])  # (records of its last life: see .aliasing)
                    return entry[0]
            entry = self.new(v, n)
            base = entry[1]  # (not under `with torch.device(...)` or `torch.inference_mode()`)
            if type(base) is not torch.Tensor or not base.is_cpu or base.is_inference():
                return entry[0]
            if len(self._blocks) >= self.LIMIT:  # (the free ones forgotten)
                for key, held in list(self._blocks.items()):
                    if self._is_free(held):
                        del self._blocks[key]
            if len(self._blocks) < self.LIMIT:
                self._blocks[id(entry[0])] = entry
            return entry[0]

    def with_ones(self, flags: tuple, at: set) -> tuple:
        """New flags: ``flags``' values, 1 at the positions ``at``. A block where ``flags``
        are one (their values read with one ``tolist``); else the flags not at ``at`` kept as
        they are."""
        values = self.values(flags) if plain_mode() else None
        if values is None:
            return tuple(
                next(ones) if i in at else f
                for ones in [_flags(1, len(flags))]
                for i, f in enumerate(flags)
            )
        for i in at:
            values[i] = 1
        return self.make(values, len(values))

    def values(self, flags: tuple) -> list | None:
        """The values of ``flags`` where they are a remembered block's (else ``None``)."""
        entry = self._blocks.get(id(flags))
        if entry is None or entry[0] is not flags:
            return None
        return entry[1].tolist()


_BLOCKS = _FlagBlocks()


def plain_mode() -> bool:
    """Eager, outside ``torch.func`` transforms and ``TorchDispatchMode``s (fake tensors,
    ``LocalTensorMode``): where :class:`_FlagBlocks` may make, reuse and read its blocks."""
    return not (torch.compiler.is_compiling() or traced() or is_in_torch_dispatch_mode())


def seen_values(seen: tuple) -> list:
    """The host values of ``MultiStepsState.seen`` (ints; one ``tolist`` for a block made by
    :func:`new_flags` or the fused micro-steps, else ``.item()`` per flag)."""
    if plain_mode():
        values = _BLOCKS.values(seen)
        if values is not None:
            return values
    return host_values(seen, _SEEN)


def new_flags(values: list) -> tuple:
    """``MultiStepsState.seen`` holding ``values`` (one int per leaf): a block, read by
    :func:`seen_values` with one ``tolist`` (see :class:`_FlagBlocks`)."""
    return _BLOCKS.make(values, len(values))


def has_updated(state: Any) -> torch.Tensor:
    """Whether the last update of a :func:`multi_steps` transform was a real (inner) step.

    ``state`` is a :class:`MultiStepsState` or any tree holding exactly one. Returns a 0-dim bool
    tensor.

    Raises:
        ValueError: no MultiStepsState in ``state``.
    """
    found = _find(state)
    if found is None:
        raise ValueError("has_updated: no MultiStepsState in the given state")
    return torch.logical_and(found.mini_step == 0, found.gradient_step > 0)


def _find(node: Any) -> MultiStepsState | None:
    if isinstance(node, MultiStepsState):
        return node
    children = (
        node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    )
    for c in children:
        r = _find(c)
        if r is not None:
            return r
    return None


@scalar_program
def _cycle(
    mini_step: torch.Tensor, gradient_step: torch.Tensor, every_k: int, n: int, dtype, on: str
) -> tuple:
    """A traced micro-step's flags ``final`` (it ends the cycle) and ``first`` (it starts it),
    0-dim bool tensors; the new ``mini_step`` and ``gradient_step``; and the ``n`` new flags
    as one vector (0 after the cycle's last micro-step, else 1; in ``dtype``, or
    ``mini_step``'s where ``None``): every one, or where ``on`` (comma-separated positions)
    names some, those, the others 0."""
    final = mini_step + 1 >= every_k
    zero, one = torch.zeros_like(mini_step), torch.ones_like(mini_step)
    cleared = torch.where(final, zero, one)
    cleared = cleared if dtype is None else cleared.to(dtype)
    if on:
        flags = cleared.new_zeros(n)
        flags[positions_index(on, flags.device)] = cleared
    else:  # (expand + clone: one copy; repeat of a 0-dim tensor takes ~0.1 ms)
        flags = cleared.expand(n).clone()
    return (
        final,
        mini_step == 0,  # (every accumulator holds zeros: see traced_add)
        torch.where(final, zero, mini_step + one),
        gradient_step + final.to(gradient_step.dtype),
        flags,
    )
