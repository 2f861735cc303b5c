"""Elementwise transforms: each primitive's math stated once, per leaf; the engine fuses the
primitives a chain composes into one pass per group of leaves.

An elementwise transform is described by a frozen :class:`Elementwise` spec:

* ``leaf(u, p, fields, scalars, key) -> (u, new_fields)``: the math for ONE leaf, in plain
  tensor operations on the update ``u``, the parameter ``p`` (``None`` unless
  ``needs_params``), the transform's params-shaped state leaves ``fields`` (a tuple, in the
  order of :attr:`Elementwise.fields`) and its ``scalars`` (0-dim tensors or Python floats:
  hyper-parameters, bias corrections, a clip factor). ``key`` is the leaf's static key (see
  ``static``), ``None`` by default.
* ``prologue(state, b) -> (scalars, finish)``: once per update, on the whole state: checks it,
  computes the scalars (reading counters, schedules, injected hyper-parameters; a reduction
  over the updates, such as a global norm, through the prepared view ``b``) and returns
  ``finish(new_field_trees) -> new_state``.
* ``fields(state) -> tuple of (tree, what)``: the params-shaped state trees the leaf function
  reads and writes, ``what`` naming them in errors.
* ``static(params) -> list``: per leaf, a key the leaf function may branch on in Python (a
  weight-decay mask): ``None``, a bool or an int (a compiled stage passes them as ints);
  ``static=None``: every leaf's key is ``None``.
* ``reduces``: whether ``prologue`` reads the updates' values (a norm): a fused pass then
  starts at this transform, since the updates it reads must exist first.
* ``reads_sum_squares``: a reducing part whose prologue reads the updates only as their
  per-leaf sums of squares (the 2-norm's terms: ``clip_by_global_norm``): the stage before it
  then sums the updates' squares as it writes them (a generated CPU kernel, in the order of
  the native sums of squares: the same bits), and the prologue finds them in the view
  (``b.sum_squares``), one pass over the updates fewer (where they are not given there, the
  prologue sums them itself).
* ``reads_params_sum_squares``: a ``reads_sum_squares`` part whose prologue reads the
  parameters too only as their per-leaf sums of squares (``scale_by_trust_ratio``'s
  ``||param||``): where the stage before it reads the parameters (a part of it needs them), it
  sums their squares from the blocks it reads (the same bits as the native sums), and the
  prologue finds them in the view (``b.params_sum_squares``): the trust ratio's norms take no
  pass over the parameters of their own (where they are not given, the prologue sums them).
* ``leaf_scalars``: the positions in the prologue's scalars that hold one value PER LEAF (a
  list of 0-dim tensors, one per leaf of ``b.active``, in that order: ``scale_by_trust_ratio``'s
  ratios, from its per-leaf norms); the leaf function finds its own leaf's value there. They
  reach the pass as inputs after the fields (0-dim, read once per leaf by a generated
  kernel), not as shared scalars. A per-leaf value may also be a vector broadcast against
  its leaf (``scale_by_factored_rms``' factors: ``(..., n, 1)``, one per row, and ``(..., 1,
  m)``, one per column; or leaf-shaped): such leaves run their kernel by rows
  (:meth:`.fuse.Kernel.by_rows`: each row a "leaf" of the call, its row's value read once,
  the column values per element); on CUDA one Triton launch over the leaves reads every
  per-leaf value per element through an index per leaf
  (:meth:`.fuse_triton.TritonKernel.by_rows`); elsewhere leaf by leaf in torch, where the
  leaf function's operations broadcast them.
* ``restrict``: ``None``, or ``restrict(params) -> list`` of a bool per leaf: the only leaves
  the part acts on (``masked`` / ``partition`` build such parts: elsewhere the update passes
  through). Its prologue's view then covers those leaves only (``b.active``,
  ``b.sum_squares``), so a reduction is over its own leaves, as the combinator's general path
  computes it, and its per-leaf scalars are given for them (the leaves outside get a
  placeholder their leaf function does not read). A reducing part restricted to leaves no
  earlier part of the current pass has touched reads that pass's inputs and does not start a
  new pass: ``partition`` of chains each starting with a clip is one pass after the norms.
* ``guard``: what the part promises where its last scalar (a flag) is false: ``HOLDS`` (it
  writes its fields as they were: :func:`guarded`), ``ZEROES`` (no fields, zero updates:
  :func:`zeroed_unless`), ``DISCARDS`` (its updates are used by no one: every later part of
  the run holds or zeroes under the same flag; compiled ``multi_steps``' accumulation), or 0
  (no promise). The compiled donated operator reads the flags at run time: it skips a stage
  that leaves every buffer as it was (see :func:`_idle`) and does not write updates no one
  uses (see :func:`_discarded`).
* ``flags``: the run-context keys of the flags a guarded part runs under (:func:`guarded`):
  its reductions' values are used only where they all hold. A compiled stage that sums the
  updates' squares for such a part (``reads_sum_squares``) reads them when it runs and takes
  no sums where one is false (a compiled ``multi_steps`` non-final micro-step's clip).
* ``sums_through``: a context part (``context=True``) whose prologue can give the per-leaf
  sums of squares of its results without a pass over them (``zero_nans``: from the read of
  its inputs it makes anyway, each NaN taken as zero). Where the run asks for them (the run
  context holds :data:`SUM_SQUARES`, ``None``), its prologue puts them there (a vector over
  its view's ``active`` leaves, as ``b.sum_squares``), and a ``reads_sum_squares`` part
  right after it reads them and starts no new pass: ``chain(zero_nans(),
  clip_by_global_norm(1.0), adamw(...))`` is one pass after the sums. The run asks eagerly
  for plain CPU leaves (:func:`host_reads`: the prologue may read values on the host, which
  costs no synchronisation there) and under ``torch.compile`` where the native sums run for
  the leaves (``native.compiled_sums``); elsewhere a pass writes the part's results first,
  as for any reducing part.
* ``starts``: ``starts(b) -> finish``, the collective a reducing part's prologue issues on
  its view ``b``, issued ahead of the prologue (``clip_by_global_norm``'s global norm:
  :func:`~functional_train.clipping.global_norm_start`; ``scale_by_trust_ratio``'s per-leaf
  norms: ``Prepared.leaf_totals_vector_start``). Where two or more parts of one stage have
  one (``partition`` of chains that each start with a clip, or of ``lamb``), the run issues
  them all before their prologues, coalesced (:func:`.collectives.coalesced`: one
  all-reduce for all their norms, one wait), and each prologue takes its own with :func:`issued`
  (:func:`started`, or where the run issued none, its own issued then). A wrapper that
  hands its part's prologue the view it is given (or one derived from it) passes ``starts``
  on.
* ``context``: whether ``prologue`` takes a third argument, ``prologue(state, b, ctx)``:
  the *run context*, a dict shared by the prologues of the parts of one :func:`run` call, in
  the parts' order. A part publishes a value there for the parts after it (under a key object
  private to the transforms that agree on it). This is how a wrapper guards the parts it
  wraps: ``apply_if_finite``'s first part computes the all-finite flag and publishes it; each
  wrapped inner part reads it in its prologue, passes it to its leaf as one more scalar, and
  its leaf selects ``torch.where(ok, new, old)`` per field (see
  :mod:`functional_train.nonfinite`).

A :class:`Fusable` is a sequence of such parts; ``chain`` of fusable transforms is fusable, its
parts the concatenation of theirs. A Fusable with ``zero_updates`` returns zero updates (only
its state changes: ``multi_steps``' non-final micro-step): run with ``apply`` it leaves the
parameters as they are and makes no pass over them.

A :class:`Switch` is registered instead of a Fusable by a transform whose fused form depends on
host-side facts of its state (``multi_steps``: whether the micro-step is the cycle's last, read
from its CPU counter): ``choose(updates, state, params, mesh)`` returns the Fusable of this
call, or ``None`` (the transform then runs by its own ``update``). ``ft.step`` asks it;
``chain`` does not fuse it (it is not a Fusable).

:func:`run` executes a Fusable: the parts from one reducing part to the next form a *stage*, one
pass over every leaf (a generated kernel per group of leaves of one dtype signature, see
:mod:`.fuse`), optionally ending with ``apply_updates`` (``p + u``) for ``ft.step``, in place
over the inputs (donated) or into fresh buffers (pure). Complex leaves are viewed as real pairs
(``torch.view_as_real``) for the whole stage, as ``torch.optim`` treats them. Where results go:
a pure run (``apply="pure"``) writes every stage's results into fresh buffers (the plan's pool,
one kind per stage and result); a donated run (``apply="donate"``) writes them over their
inputs: the last stage's new parameters over the parameters, every stage's new fields over the
old fields, and an intermediate stage's updates over the updates (the gradients, donated too;
under ``torch.compile`` into new buffers: see ``fused_stage_donated``).

The spec is attached to a transform's ``update`` function by :func:`register` and read back by
:func:`spec_of_transform` / :func:`fusable_of`: the typed protocol between transforms and the
engine. Under ``torch.compile`` a stage on CPU tensors is the operator
``functional_train::fused_stage`` (the eager kernels; each part is named by its ``ident``), or
for a donated step ``functional_train::fused_stage_donated``, which writes over the step's
inputs (inductor gives it the inputs themselves) and reads the wrappers' flags when it runs
(see ``guard``);
under a ``torch.func`` transform the parts' leaf functions run leaf by leaf in torch; ranks
simulated by ``LocalTensor`` run the kernels rank by rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..autograd import traced
from ..leaves import CPU, DTYPE, copy_into, on_device
from ..spec import attach_spec, transform_spec
from ..tree import indexed
from . import fuse, native
from . import pool as pools
from .collectives import coalesced
from .dtensor import to_local, wrap_like
from .metadata import Memo, dict_scope
from .operators import register_kernels
from .owners import assume_constant_result
from .pool import LAZY_CLONES, Pool, empties_like, in_one_order, lazy_clones, of_plan
from .scalars import gated, positions_index, scalar_program

__all__ = [
    "Elementwise",
    "Fusable",
    "register",
    "spec_of_transform",
    "fusable_of",
    "Switch",
    "switch_of",
    "chained_switch",
    "by_stages",
    "stage_major",
    "zeros_written",
    "derived_parts",
    "restated",
    "run",
    "issued",
    "started",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Elementwise:
    """One elementwise transform (see the module's docstring)."""

    name: str
    leaf: Callable
    prologue: Callable
    fields: Callable
    n_fields: int
    needs_params: bool = False
    static: Callable | None = None
    reduces: bool = False
    context: bool = False
    guard: int = 0
    leaf_scalars: tuple[int, ...] = ()
    reads_sum_squares: bool = False
    reads_params_sum_squares: bool = False
    restrict: Callable | None = None
    flags: tuple[str, ...] = ()
    sums_through: bool = False
    starts: Callable | None = None

    def __post_init__(self):
        # a number of its own, by which a compiled graph names it (functional_train::fused_stage)
        ident = next(_IDENTS)
        object.__setattr__(self, "ident", ident)
        _PARTS[ident] = self


HOLDS, ZEROES, DISCARDS = 1, 2, 3  # Elementwise.guard
_IDENTS = itertools.count()
_PARTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class Fusable:
    """A sequence of elementwise parts and how the composite state maps onto theirs:
    ``split(state) -> [part state, ...]`` and ``join([new part state, ...]) -> state``;
    ``zero_updates``: the updates are zeros (see the module's docstring)."""

    parts: tuple
    split: Callable
    join: Callable
    zero_updates: bool = False

    @property
    def needs_params(self) -> bool:
        return any(p.needs_params for p in self.parts)


@dataclasses.dataclass(frozen=True, eq=False)
class Switch:
    """A transform's fused form chosen per call from host-side facts of its state:
    ``choose(updates, state, params, mesh) -> Fusable | None`` (see the module's docstring).
    ``choose`` must be cheap and must not issue collectives or read device values.
    ``traced_parts``: the parts of every Fusable it chooses under ``torch.compile``, where
    they are the same objects on every call (known when the transform is built; ``None``
    otherwise): a wrapper that derives parts of its own from them (``multi_steps``' traced
    form) makes those when it is built, as a traced step cannot.
    ``choose_leaves``: optionally, the same choice from the leaves,
    ``choose_leaves(treedef, updates, state, params, mesh)``, ``updates`` and ``params``
    lists flattened by ``treedef`` (``None`` where a combinator's transform does not see a
    leaf): ``masked`` and ``partition``, which hold their leaves flat, call it eagerly rather
    than build each transform's trees for ``choose`` to flatten again.
    ``reads_trees``: ``False`` where ``choose`` reads its state (and mesh) only, never the
    updates or params (``inject_hyperparams``): a combinator then passes ``None`` for them
    rather than build a transform's trees for nothing."""

    choose: Callable
    traced_parts: tuple | None = None
    choose_leaves: Callable | None = None
    reads_trees: bool = True


def register(update_fn: Callable, spec: Elementwise | Fusable | Switch) -> Callable:
    """Attach ``spec`` to a transform's ``update`` function (returns ``update_fn``): the
    ``elementwise`` field of its :class:`~functional_train.spec.TransformSpec`, which travels
    with the function through ``pickle`` (cloudpickle) and ``copy``."""
    if not isinstance(spec, (Elementwise, Fusable, Switch)):
        raise TypeError(f"register: expected an Elementwise, Fusable or Switch spec, got {spec!r}")
    return attach_spec(update_fn, elementwise=spec)


def spec_of_transform(tx) -> Elementwise | Fusable | Switch | None:
    """The spec registered for ``tx.update``, or ``None`` (a transform the engine cannot fuse:
    it runs by its own ``update``)."""
    return transform_spec(tx).elementwise


def fusable_of(tx) -> Fusable | None:
    """``tx``'s spec as a :class:`Fusable` (one part for an :class:`Elementwise`), or ``None``."""
    s = spec_of_transform(tx)
    if isinstance(s, Switch):
        return None
    return single(s) if isinstance(s, Elementwise) else s


def switch_of(tx) -> Switch | None:
    """``tx``'s :class:`Switch`, or ``None``."""
    s = spec_of_transform(tx)
    return s if isinstance(s, Switch) else None


def chained(fusables: Sequence[Fusable]) -> Fusable:
    """The :class:`Fusable` of ``chain`` of transforms with these specs (state: a tuple)."""
    if any(f.zero_updates for f in fusables):
        raise ValueError("a Fusable with zero_updates cannot be chained")
    counts = [len(f.parts) for f in fusables]

    def split(state):
        out = []
        for f, s in zip(fusables, state):
            out.extend(f.split(s))
        return out

    def join(states):
        out, k = [], 0
        for f, n in zip(fusables, counts):
            out.append(f.join(states[k : k + n]))
            k += n
        return tuple(out)

    return Fusable(tuple(p for f in fusables for p in f.parts), split, join)


def stage_major(parts_per: Sequence[tuple]) -> list[tuple[int, int]]:
    """The order :func:`by_stages` runs parts in: ``(i, k)``, part ``k`` of ``parts_per[i]``,
    each tuple's parts cut into runs at every reducing part after its first, the runs
    aligned at the end (every tuple's last run in the last stage, which passes over every
    leaf anyway to apply the updates; a shorter tuple's earlier runs in the stages just
    before it), then stage by stage, each tuple's own order kept."""
    runs: list = []
    for ps in parts_per:
        cut: list = []
        for k, part in enumerate(ps):
            if not cut or (k and part.reduces):
                cut.append([])
            cut[-1].append(k)
        runs.append(cut)
    longest = max([len(cut) for cut in runs]) if runs else 0  # (plain loops: dynamo)
    return [
        (i, k)
        for g in range(longest)
        for i, cut in enumerate(runs)
        if g >= longest - len(cut)
        for k in cut[g - longest + len(cut)]
    ]


def by_stages(fusables: Sequence[Fusable]) -> Fusable:
    """:func:`chained` of Fusables whose parts act on disjoint leaves (``partition``'s, each
    restricted to its label's), its parts in :func:`stage_major` order: the parts that
    commute (they touch other leaves) are moved so that each stage of the chain holds every
    Fusable's corresponding run (aligned at the end), and the chain takes as many passes as
    its longest Fusable, not the sum of theirs (``partition`` of ``multi_steps``: the
    accumulations in one pass, then every inner transform in one; a compiled non-final
    micro-step then skips the second, see :func:`_guards_of`). The state is
    :func:`chained`'s. The caller keeps apart Fusables that share a part object (one
    transform given twice: its parts pass values on when their prologues run)."""
    fus = chained(fusables)
    starts = [0]
    for f in fusables:
        starts.append(starts[-1] + len(f.parts))
    order = [starts[i] + k for i, k in stage_major([f.parts for f in fusables])]
    if order == list(range(len(order))):
        return fus

    def split(state):
        states = fus.split(state)
        return [states[j] for j in order]

    def join(states):
        out: list = [None] * len(order)
        for j, x in zip(order, states):
            out[j] = x
        return fus.join(out)

    return Fusable(tuple(fus.parts[j] for j in order), split, join)


def restated(fus: Fusable, get: Callable, put: Callable) -> Fusable:
    """``fus`` as the spec of a transform whose state holds ``fus``'s (a wrapper's, a named
    chain's): ``get(state)`` gives the state held (raising for a state of another transform),
    ``put(held)`` wraps a new one."""
    return Fusable(
        fus.parts,
        lambda state: fus.split(get(state)),
        lambda states: put(fus.join(states)),
        fus.zero_updates,
    )


def chained_switch(specs: Sequence) -> Switch:
    """The :class:`Switch` of ``chain`` of transforms whose specs are Fusables and Switches
    (at least one): per call, each Switch chooses from its own state (the chain's state, a
    tuple), and the chosen Fusables are chained, zero updates written out
    (:func:`zeros_written`); ``None`` when one chooses ``None``, or zero updates alone."""
    specs = list(specs)

    def choose(updates, state, params, mesh):
        if not isinstance(state, tuple) or len(state) != len(specs):
            return None  # (the chain's own update raises)
        fus = []
        for spec, st in zip(specs, state):
            f = spec.choose(updates, st, params, mesh) if isinstance(spec, Switch) else spec
            if f is None or (f.zero_updates and len(specs) == 1):
                return None
            fus.append(zeros_written(f))
        return chained(fus)

    # (the chained parts under torch.compile, where every Switch's are known)
    traced: tuple | None = ()
    for spec in specs:
        if isinstance(spec, Switch):
            more = spec.traced_parts
            traced = None if more is None or traced is None else traced + more
        elif traced is not None:
            traced += zeros_written(spec).parts
    return Switch(choose, traced)


# --------------------------------------------------------------------------------------------
# execution


class _Stage:
    """The composed per-leaf function of consecutive parts, optionally followed by
    ``apply_updates``; one object per (parts, apply), so that its kernels are cached."""

    __slots__ = ("parts", "apply", "drop_u", "params", "n_per_leaf", "__weakref__")

    def __init__(self, parts: tuple, apply: bool, drop_u: bool = False):
        self.parts = parts
        self.apply = apply
        self.drop_u = drop_u  # the updates are not a result (only the new fields are)
        self.params = apply or any(p.needs_params for p in parts)
        # the inputs after the fields: the parts' per-leaf scalars, in order
        self.n_per_leaf = sum(len(p.leaf_scalars) for p in parts)

    def function(self, counts: tuple, keys: tuple) -> Callable:
        parts, apply, params, drop_u = self.parts, self.apply, self.params, self.drop_u
        first_per_leaf = (2 if params else 1) + sum(part.n_fields for part in parts)

        def f(ins, scalars):
            u = ins[0]
            p = ins[1] if params else None
            k = 2 if params else 1
            r = first_per_leaf
            s = 0
            outs = []
            for part, n, key in zip(parts, counts, keys):
                fields = tuple(ins[k : k + part.n_fields])
                k += part.n_fields
                h = scalars[s : s + n]
                s += n
                if part.leaf_scalars:
                    h = _merged(h, ins[r : r + len(part.leaf_scalars)], part.leaf_scalars)
                    r += len(part.leaf_scalars)
                u, new = part.leaf(u, p if part.needs_params else None, fields, h, key)
                outs.extend(new)
            if apply:
                return (p + u.to(p.dtype), *outs)
            if drop_u:
                return tuple(outs)
            return (u, *outs)

        return f


def _split_scalars(part: Elementwise, scalars) -> tuple[list, list]:
    """A part's scalars as its prologue gives them: ``(shared, per-leaf lists)``."""
    at = part.leaf_scalars
    return [x for i, x in enumerate(scalars) if i not in at], [list(scalars[i]) for i in at]


def _parts_of(parts, scalars, keys=None) -> tuple:
    """:func:`apply_part`'s and :func:`leaf_runner`'s arguments for one part (its scalars, a
    key per leaf) or for consecutive parts (a scalars sequence per part, a tuple of keys per
    leaf): ``(parts, shared scalars, counts, per-leaf scalar lists, keys as tuples)``."""
    if isinstance(parts, Elementwise):
        parts, scalars = (parts,), (scalars,)
        keys = None if keys is None else [(k,) for k in keys]
    shared: list = []
    counts: list = []
    per_leaf: list = []
    for part, sc in zip(parts, scalars, strict=True):
        mine, own = _split_scalars(part, sc)
        shared.extend(mine)
        counts.append(len(mine))
        per_leaf.extend(own)
    return tuple(parts), shared, tuple(counts), per_leaf, keys


def _merged(scalars: tuple, per_leaf: tuple, positions: tuple) -> tuple:
    """A part's scalars with its per-leaf ones (this leaf's) back at their ``positions``."""
    shared, own = iter(scalars), iter(per_leaf)
    return tuple(
        next(own) if i in positions else next(shared) for i in range(len(scalars) + len(per_leaf))
    )


_stages: dict = {}


def _stage_of(parts: tuple, apply: bool, drop_u: bool = False) -> _Stage:
    if torch.compiler.is_compiling():  # (a cache dynamo would guard on: a fresh one)
        return _Stage(parts, apply, drop_u)
    key = (tuple(map(id, parts)), apply, drop_u)
    st = _stages.get(key)
    if st is None or st.parts != parts:
        st = _stages[key] = _Stage(parts, apply, drop_u)
    return st


def _functional() -> bool:
    """Inside ``torch.compile`` or a ``torch.func`` transform, or recording autograd for
    :func:`~functional_train.differentiable`: the stage runs leaf by leaf in torch."""
    return torch.compiler.is_compiling() or traced()


def run(
    spec: Fusable,
    b,
    state: Any,
    params: Any = None,
    *,
    apply: str | None = None,
    params_locals: Sequence | None = None,
    take: Callable | None = None,
):
    """Run ``spec`` on the prepared view ``b`` (its ``params`` tree: ``params``) and ``state``.

    Args:
        apply: ``None``: return ``(updates, new_state)`` like ``update``; ``"pure"`` or
            ``"donate"``: return ``(new parameter locals of b.active, new_state)``, the updates
            added to ``params_locals`` (the parameters' local shards of ``b.active``) into fresh
            buffers or in place (``params_locals`` themselves for ``spec.zero_updates``).
        take: ``take(kind, like) -> fresh buffers`` for pure results and ``update``'s
            (default: the plan's pool, :mod:`.pool`).

    Raises:
        ValueError: a part needs params and none were given; a state from another transform
            (from its prologue); a state leaf of another shape.
    """
    parts = spec.parts
    states = spec.split(state)
    act = b.active
    if take is None and apply is None and not torch.compiler.is_compiling():
        # update's results from the plan's pool too (see .pool: reused once the caller has
        # dropped them, so that fresh results take no page faults)
        take = of_plan(b.plan, "pool", Pool).taking("update:")

    # (an intermediate stage's updates, read by the next stage only, into the plan's scratch)
    scratch = None if take is None else of_plan(b.plan, "pool", Pool).scratch
    u = b.at(b.locals)
    given = None  # the updates' sums of squares from the stage that wrote them
    given_p = None  # (and the parameters', where it read them and the next part asked)
    given_on: frozenset | None = None  # (the positions where they were summed; None: all)
    # (see statics_memo: the step's, where ft.step set one: statics_for_step)
    outer = None if torch.compiler.is_compiling() else _STATICS_MEMO.get()
    statics_memo: dict = {} if outer is None else outer
    # (per part: the positions in act of the leaves it is restricted to, None for every leaf)
    where: list = [None] * len(parts)
    if any(part.restrict is not None for part in parts):
        if params is None:
            name = next(p.name for p in parts if p.restrict is not None)
            raise ValueError(f"{name}: needs params (update(..., params))")
        for k, part in enumerate(parts):
            if part.restrict is not None:
                where[k] = _positions(b, _call_static(part.restrict, params, statics_memo))
    # (the parts that read the sums of squares the part before them gives: no pass between)
    through = _through(parts, where, u) if any(part.sums_through for part in parts) else frozenset()
    if any(w is not None for w in where):
        bounds = _bounds(parts, where, through)
    else:
        # (no parts, an identity's: one stage, which is ``p + u`` where it applies)
        bounds = [
            k for k, part in enumerate(parts) if k == 0 or (part.reduces and k not in through)
        ] + [len(parts)]
        bounds = bounds if parts else [0, 0]
    finishes: list = [None] * len(parts)
    trees_of: list = [None] * len(parts)
    new_fields: list = [None] * len(parts)
    ctx: dict = {}  # the run context (see the module's docstring)
    compiling = torch.compiler.is_compiling()
    drop = spec.zero_updates  # (the updates are zeros: the last stage does not write them)

    def view_of(k: int):
        """Part ``k``'s view of the current updates (but for a ``through`` part's sums)."""
        part = parts[k]
        view = b.with_locals(b.every_leaf(u)) if k > 0 and part.reduces else b
        if k in through:  # (the sums of the updates as the part before gives them)
            view.sum_squares = ctx.pop(SUM_SQUARES, None)
            if view.sum_squares is None:
                raise RuntimeError(
                    f"{parts[k - 1].name}: a sums_through part gave no sums of squares"
                )
        elif k > 0 and part.reduces and part.reads_sum_squares:
            # (None: the prologue sums them itself; so where the stage that wrote the
            # updates summed only some leaves and the part reads others)
            if given_on is None or (where[k] is not None and where[k].of <= given_on):
                view.sum_squares = given
                if part.reads_params_sum_squares:
                    view.params_sum_squares = given_p
        if where[k] is not None:
            view = view.restricted(where[k])
        return view

    for lo, hi in zip(bounds, bounds[1:]):
        scalars: list = []
        counts: list = []
        fields: list = []
        per_leaf: list = []
        keys: list = []
        numbers_on: tuple | None = None  # (compiled: the flags every part's numbers run under)
        # (two or more parts' collectives issued together, before their prologues: starts)
        ahead = _ahead(parts, lo, hi, through, view_of, b.world)
        token = None if ahead is None else _STARTED.set(ahead[1])
        try:
            for k in range(lo, hi):
                part = parts[k]
                view = ahead[0][k] if ahead is not None and k in ahead[0] else view_of(k)
                if part.context:
                    if k + 1 in through:  # (asked for: see Elementwise.sums_through)
                        ctx[SUM_SQUARES] = None
                    sc, finishes[k] = part.prologue(states[k], view, ctx)
                else:
                    sc, finishes[k] = part.prologue(states[k], view)
                if part.leaf_scalars:  # (inputs of the stage, after its fields)
                    sc, own = _split_scalars(part, sc)
                    if where[k] is not None:
                        own = [_spread(x, where[k].positions, u) for x in own]
                    per_leaf.extend(own)
                if compiling and not all(isinstance(x, torch.Tensor) for x in sc):
                    on = part.flags if numbers_on is None else numbers_on
                    numbers_on = tuple(f for f in on if f in part.flags)
                scalars.extend(sc)
                counts.append(len(sc))
                trees_of[k] = part.fields(states[k])
                for tree, what in trees_of[k]:
                    fields.append(b.at(b.state_locals(tree, what)))
                if part.static is not None:
                    if params is None:
                        raise ValueError(f"{part.name}: needs params (update(..., params))")
                    every = _call_static(part.static, params, statics_memo)
                    keys.append(list(every) if len(every) == len(act) else [every[i] for i in act])
                else:
                    keys.append(None)
        finally:
            if token is not None:
                _STARTED.reset(token)
        if ahead is not None:
            for finish in ahead[1].values():  # (any a prologue did not take)
                finish()
        last = hi == len(parts)
        stage = _stage_of(parts[lo:hi], apply is not None and last and not drop, drop and last)
        # (the next stage's reduction: its sums of squares taken as this stage writes them)
        sums: list | None = [] if not last and parts[hi].reads_sum_squares else None
        # (compiled: whether they are used at all, read when the stage runs)
        needed = _needed(parts[hi], ctx) if sums is not None else None
        # (compiled: the stage's numbers, made tensors by a scalar program, used only where
        # a flag every part taking them runs under holds: the program gated by it)
        gate = ctx.get(numbers_on[0]) if numbers_on else None
        p_loc = None
        if stage.apply:
            p_loc = list(params_locals or ())
        elif stage.params:
            if b.params is None:
                name = next(p.name for p in parts[lo:hi] if p.needs_params)
                raise ValueError(f"{name}: needs params (update(..., params))")
            p_loc = [b.params[i] for i in act]
        # (the next part's parameters' sums too, where this stage reads them)
        psums = sums is not None and p_loc is not None and parts[hi].reads_params_sum_squares
        if all(k is None for k in keys):  # (checked once: dynamo traces every loop)
            leaf_keys: list = [None] * len(act)
        else:
            leaf_keys = list(_leaf_keys(keys, len(act)))
        ins = fields + per_leaf
        # (an intermediate stage of restricted parts only: the leaves none of them acts on
        # pass through it as they are, no pass over them; the sums of squares the next part
        # reads are taken where it reads them, zeros elsewhere, which no view reads: given_on)
        run_on = None if last else _acted_on(where[lo:hi], len(act))
        if run_on is not None and sums is not None:
            w = where[hi]
            if w is None or not w.of.issubset(run_on.of):
                run_on = None
        u_in, p_in, keys_in = u, p_loc, leaf_keys
        if run_on is not None:
            on = run_on.positions
            u_in, keys_in = _pick(u, on), _pick(leaf_keys, on)
            p_in = None if p_loc is None else _pick(p_loc, on)
            ins = [_pick(x, on) for x in ins]
        outs = _execute(
            stage,
            tuple(counts),
            u_in,
            p_in,
            ins,
            scalars,
            keys_in,
            apply,
            _stage_take(take, scratch, lo, last or stage.drop_u),
            sums,
            needed,
            psums,
            gate,
        )
        if run_on is not None:
            outs = [_put(x, run_on.positions, base) for x, base in zip(outs, [u, *fields])]
            if sums:
                index = run_on.index_on(sums[0].device)
                sums[:] = [x.new_zeros(len(act)).index_copy_(0, index, x) for x in sums]
        given_on = None if run_on is None else run_on.of
        given = sums[0] if sums else None
        given_p = sums[1] if sums and len(sums) > 1 else None
        r = 0
        if not stage.drop_u:
            u = outs[0]
            r = 1
        for k in range(lo, hi):
            m = parts[k].n_fields
            new_fields[k] = outs[r : r + m]
            r += m
    new_states = []
    for k in range(len(parts)):
        new_trees = [
            b.state_tree(tree, what, new) for (tree, what), new in zip(trees_of[k], new_fields[k])
        ]
        new_states.append(finishes[k](new_trees))
    new_state = spec.join(new_states)
    if drop and apply is not None:
        return list(params_locals or ()), new_state
    if apply is not None:
        return u, new_state
    if drop:
        from ..aliasing import known_zeros_of

        u = known_zeros_of(u)
    return b.rebuild_active(u), new_state


def _ahead(parts: tuple, lo: int, hi: int, through: frozenset, view_of: Callable, world):
    """For the stage ``parts[lo:hi]``: ``None``, or where two or more of its parts have
    ``starts`` (none of them ``through``), ``(views, started)``: those parts' views (by
    position) and their collectives, issued now, coalesced (one all-reduce for all of them,
    see :func:`.collectives.coalesced`), by ``(starts, id(view.active))`` for
    :func:`started`. Not in one process (``world``: the view's, of one rank or none), nor
    under ``torch.compile`` or ``torch.func``."""
    if hi - lo < 2 or _functional() or world.device_mesh is None or world.size == 1:
        return None
    ks = [k for k in range(lo, hi) if parts[k].starts is not None and k not in through]
    if len(ks) < 2:
        return None
    views = {k: view_of(k) for k in ks}
    pending: dict = {}
    with coalesced():
        for k in ks:
            key = (parts[k].starts, id(views[k].active))
            if key not in pending:  # (one per part and view)
                pending[key] = parts[k].starts(views[k])
    return views, pending


_STARTED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "functional_train_started", default=None
)


def started(starts: Callable, b) -> Callable | None:
    """In a part's prologue: the ``finish`` of the collective the run issued for it ahead
    (``Elementwise.starts``, the part's own ``starts`` function, on a view with ``b``'s
    active leaves), taken once; ``None`` where the run issued none (one part with ``starts``
    in its stage, a prologue called by other code, or under ``torch.compile``): the
    prologue then calls ``starts(b)`` itself."""
    if torch.compiler.is_compiling():
        return None
    pending = _STARTED.get()
    if pending is None:
        return None
    return pending.pop((starts, id(b.active)), None)


def issued(starts: Callable, b) -> Callable:
    """In a part's prologue: the ``finish`` of its collective (``Elementwise.starts``), the
    one the run issued ahead where it did (:func:`started`), else ``starts(b)`` issued now."""
    return started(starts, b) or starts(b)


_STATICS_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "functional_train_statics_memo", default=None
)


def statics_memo() -> dict | None:
    """While a part's ``static`` runs (eagerly), a dict shared by the statics of one
    :func:`run` call (of the whole step where ``ft.step`` set one: :func:`statics_for_step`),
    for values every part computes from the same ``params`` (a ``partition``'s labels: one
    flatten of the params per step, not one per part); keyed by the caller's own object,
    holding the params it saw, so nothing outlives the step. ``None`` otherwise."""
    return _STATICS_MEMO.get()


def statics_for_step() -> contextlib.AbstractContextManager:
    """One :func:`statics_memo` dict for a whole eager step (``ft.step``: its Switch's
    choice and its :func:`run`, which both ask a ``partition``'s labels of the same params:
    one flatten of them per step), where none is set already; nothing under
    ``torch.compile`` (:func:`~.metadata.dict_scope`)."""
    return dict_scope(_STATICS_MEMO)


def _call_static(static: Callable, params: Any, memo: dict):
    if torch.compiler.is_compiling():
        return static(params)
    token = _STATICS_MEMO.set(memo)
    try:
        return static(params)
    finally:
        _STATICS_MEMO.reset(token)


_TENSOR = {torch.Tensor}
_NBYTES = operator.attrgetter("nbytes")


def apply_locals(p: list, u: list, plan: Callable[[], Any] | None = None) -> list | None:
    """``p + u`` leaf by leaf (``apply_updates``' arithmetic: the last stage's ``p + u`` of
    :class:`_Stage`) for plain CPU tensors of equal shapes, through the generated kernels: fresh
    results, written with non-temporal stores where large (see :mod:`.fuse`); where ``plan()``
    gives the leaves' plan, from its pool (:mod:`.pool`: buffers the caller has dropped, as a
    pure step's results; new ones take page faults where the allocator has handed freed
    memory back), but for leaves too small to be pooled (asked before the plan, whose lookup
    costs ~30 us at 244 leaves). ``None`` where they do not run here (autograd recording,
    ``torch.compile``, a ``torch.func`` transform, the kernels off, another device or tensor
    type): the caller adds them itself."""
    if (
        not p
        or not fuse.ENABLED
        or _recording()  # (autograd, torch.compile, torch.func)
        or set(map(type, p)) != _TENSOR
        or set(map(type, u)) != _TENSOR
        or not on_device(p, CPU)
        or not on_device(u, CPU)
    ):
        return None
    stage = _stage_of((), True)
    n = len(p)
    take = None
    if plan is not None and sum(map(_NBYTES, p)) >= pools.MIN_MEAN_BYTES * n:
        take = of_plan(plan(), "pool", Pool).taking("apply:")
    return _execute_local(stage, (), list(u), list(p), [], [], [None] * n, "pure", take)[0]


def _stage_take(take, scratch, lo: int, final: bool):
    """The ``take`` of the stage from part ``lo``: :func:`_kinds`; for a stage whose updates
    are read by the next stage only (not ``final``: not the last, and it writes its updates),
    those (kind ``stage0``: the first result) from ``scratch`` where they are contiguous, a
    set reused step after step without use-count checks (nothing outside the step sees
    them; the next stage's reduction and kernel read them before the step returns): a pure
    ``multi_steps`` micro-step that ends the cycle allocates no summed gradients."""
    if take is None:
        return None
    take = _kinds(take, lo)
    if final or scratch is None:
        return take
    scratch = _kinds(scratch, lo)

    def stage_take(kind, like):
        if (kind == "stage0" or kind.startswith("stage0/")) and all(map(_CONTIGUOUS, like)):
            return scratch(kind, like)
        return take(kind, like)

    return stage_take


def _kinds(take, lo):
    """``take`` with the pool's kinds of buffers named per stage (a stage's results must not
    take the buffers of an earlier stage's results of the same run)."""
    if lo == 0:
        return take
    return lambda kind, like: take(f"{kind}@{lo}", like)


class _Where:
    """The leaves a restricted part acts on (see ``Elementwise.restrict``), as positions in
    the view's ``active`` list (a list, and a set for :func:`_bounds`)."""

    __slots__ = ("positions", "of", "index", "_active")

    def __init__(self, positions: list):
        self.positions = positions
        self.of = frozenset(positions)
        self.index: torch.Tensor | None = None  # (for sums of squares, made once)
        self._active: tuple = (None, None)  # (a view's active list, its entries here)

    def of_active(self, active: list) -> list:
        """The entries of ``active`` (a view's active leaves) at :attr:`positions`: one list
        object per ``active`` list object (eagerly; a plan's, made once per layout)."""
        if torch.compiler.is_compiling():
            return [active[j] for j in self.positions]
        last, mine = self._active
        if last is not active:
            mine = [active[j] for j in self.positions]
            self._active = (active, mine)
        return mine

    def index_on(self, device) -> torch.Tensor:
        """:attr:`positions` as an index tensor on ``device`` (made once per device in a
        row)."""
        if self.index is None or self.index.device != torch.device(device):
            self.index = torch.tensor(self.positions, dtype=torch.long, device=device)
        return self.index

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The entries of ``x`` (a vector: one value per active leaf, such as their sums of
        squares) at :attr:`positions`; under ``torch.compile`` one scalar program (no
        constant index tensor for inductor to copy and select with)."""
        if torch.compiler.is_compiling():
            return _rows(x, ",".join(map(str, self.positions)))[0]
        return x.index_select(0, self.index_on(x.device))


@scalar_program
def _rows(x: torch.Tensor, positions: str) -> tuple:
    """:meth:`_Where.rows` under ``torch.compile`` (``positions``: comma-separated)."""
    return (x.index_select(0, positions_index(positions, x.device)),)


def _positions(b, on: Sequence) -> _Where | None:
    """``on`` (a bool per leaf of the tree, or per active leaf) as a :class:`_Where` over
    ``b.active``; ``None`` where it holds every active leaf. Remembered per plan and list
    object (a combinator's mask or labels are resolved once per layout)."""
    memo = None if torch.compiler.is_compiling() else b.plan.memo
    if memo is not None:
        key = ("restrict", id(on))
        hit = memo.get(key)
        if hit is not None and hit[0] is on:
            return hit[1]
    act = b.active
    flags = on if len(on) == len(act) else [on[i] for i in act]
    positions = [j for j, f in indexed(flags) if f]
    out = None if len(positions) == len(act) else _Where(positions)
    if memo is not None:
        memo[key] = (on, out)  # (holding on: its id is not reused while the entry lives)
    return out


@assume_constant_result  # (static keys: dynamo calls it once, untraced)
def _leaf_keys(keys: list, n: int) -> tuple:
    """Per leaf (``n`` of them), the tuple of the parts' static keys (a part's ``None``: each
    leaf's ``None``): one C loop eagerly (this runs for every stage of every step)."""
    return tuple(zip(*(itertools.repeat(None, n) if k is None else k for k in keys)))


def _bounds(parts: tuple, where: list, through: frozenset = frozenset()) -> list:
    """Where the stages of ``parts`` start (and ``len(parts)``): at every reducing part, but
    for one restricted to leaves no earlier part of the current stage acts on (its
    prologue reads the stage's inputs there, which are its own inputs), and for one in
    ``through`` (:func:`_through`: it reads the sums of squares the part before it gives)."""
    reduces = tuple(part.reduces for part in parts)
    return list(_bounds_of(reduces, tuple(None if w is None else w.of for w in where), through))


@assume_constant_result  # (static: dynamo calls it once, untraced, where
def _bounds_of(reduces: tuple, of: tuple, through: frozenset) -> tuple:  # its set loops
    """:func:`_bounds` of the parts' ``reduces`` flags and leaf sets (``None``: every leaf)."""
    bounds = [0]  # (ran as Python: 42,000 traced bytecodes for a partition of 122 leaves)
    touched: frozenset | None = frozenset()  # (None: every leaf)
    for k, w in enumerate(of):
        if (
            k
            and reduces[k]
            and k not in through
            and (touched is None or w is None or not touched.isdisjoint(w))
        ):
            bounds.append(k)
            touched = frozenset()
        touched = None if touched is None or w is None else touched | w
    return (*bounds, len(of))


# the run context's key for Elementwise.sums_through (a string, as context_key's, which it
# cannot equal: theirs end in ":<n>"; dynamo compares dict keys by value)
SUM_SQUARES = "sum_squares"


def host_reads(u: list) -> bool:
    """Whether a prologue may read values of the updates ``u`` (the active locals) on the
    host for free: eagerly (not compiling, no ``torch.func`` transform, no autograd
    recording), every leaf a plain CPU tensor (no device synchronisation; not ranks
    simulated by ``LocalTensor``). C loops."""
    return (
        not _recording()
        and bool(u)
        and set(map(type, u)) == {torch.Tensor}
        and all(map(_IS_CPU, u))
    )


_IS_CPU = operator.attrgetter("is_cpu")


def _through(parts: tuple, where: list, u: list) -> frozenset:
    """The positions of the ``reads_sum_squares`` parts that follow a ``sums_through`` part
    (neither restricted) and read the sums it gives (see ``Elementwise.sums_through``):
    none unless :func:`host_reads`, or, under ``torch.compile``, the native sums run for the
    leaves (``native.compiled_sums``: a prologue gives them from its one native read)."""
    ks = [
        k
        for k in range(1, len(parts))
        if parts[k].reads_sum_squares
        and parts[k - 1].sums_through
        and where[k] is None
        and where[k - 1] is None
    ]
    if not ks:
        return frozenset()
    if torch.compiler.is_compiling():
        return frozenset(ks) if native.compiled_sums(u) else frozenset()
    return frozenset(ks) if host_reads(u) else frozenset()


def _acted_on(where: list, n: int) -> _Where | None:
    """The leaves some part of a stage acts on (positions in ``act``, a :class:`_Where`), where
    every part is restricted (``where``: theirs) and together they leave some of the ``n``
    leaves out; ``None`` otherwise. Eagerly remembered per stage's :class:`_Where` objects
    (made once per layout), with the index tensor the sums of squares are put back by."""
    if not where or any(w is None for w in where):
        return None
    compiling = torch.compiler.is_compiling()
    key = (*where, n)
    hit = None if compiling else _ACTED.get(key, False)
    if hit is False:
        on: frozenset = frozenset().union(*(w.of for w in where))
        hit = _Where(sorted(on)) if len(on) < n else None
        if not compiling:
            if len(_ACTED) >= 256:
                _ACTED.clear()
            _ACTED[key] = hit
    return hit


_ACTED: dict = {}


def _pick(values: list, positions: list) -> list:
    return [values[j] for j in positions]


def _put(new: list, positions: list, base: list) -> list:
    """``base`` (one value per active leaf) with ``new`` at ``positions``."""
    out = list(base)
    for j, x in zip(positions, new):
        out[j] = x
    return out


def _spread(values: list, positions: list, u: list) -> list:
    """A restricted part's per-leaf scalars (one per leaf of its view) as one per active
    leaf: the others get a placeholder (the first value, or a 0-dim zero: one value, as a
    kernel reads it), not read."""
    fill = values[0] if values else (u[0].new_zeros(()) if u else None)
    if isinstance(fill, torch.Tensor) and fill.numel() != 1:  # (a vector: one of its leaf's)
        fill = fill.new_zeros(())
    out = [fill] * len(u)
    for j, x in zip(positions, values):
        out[j] = x
    return out


def _execute(
    stage,
    counts,
    u,
    p,
    fields,
    scalars,
    keys,
    apply,
    take,
    sums=None,
    needed=None,
    psums=False,
    gate=None,
):
    """The stage on lists of leaves: ``[updates or new params, *new fields]`` (lists; without
    the first for ``stage.drop_u``). ``apply="donate"``: the results over their inputs.
    ``sums``: an empty list, to which the updates' per-leaf sums of squares (a float64
    vector) are appended where the kernel calls that wrote them took every leaf's (a call
    per group of leaves: by dtypes, static key, absent state leaves; gathered in leaf order;
    see ``Elementwise.reads_sum_squares``), and always by a compiled stage (the operator sums
    them itself where its kernel did not; zeros where ``needed``, a 0-dim bool tensor read
    when it runs, is false); nothing is appended otherwise. ``psums``: then the parameters'
    ``p`` sums of squares too, a second vector, where the kernel took them as it read them
    (see ``Elementwise.reads_params_sum_squares``), and always by a compiled stage.
    ``gate``: compiled, a 0-dim bool tensor where the stage's Python numbers among
    ``scalars`` are read only where it is true (see :func:`~.scalars.gated`).

    Ranks simulated in one process (``torch.distributed._local_tensor.LocalTensor``: a tensor
    holding one tensor per rank) run rank by rank on their own tensors, through the same
    kernels a real rank runs, so that a simulated run gives a real one's numbers."""
    if torch.compiler.is_compiling() and _opaque(u, p, fields, scalars):
        return _compiled(
            stage, counts, u, p, fields, scalars, keys, apply, sums, needed, psums, gate
        )
    ranks = _simulated_ranks(u, p, fields, scalars)
    if ranks is not None:
        return _per_rank(ranks, stage, counts, u, p, fields, scalars, keys, apply)
    return _execute_local(stage, counts, u, p, fields, scalars, keys, apply, take, sums, psums)


# ---------------------------------------------------------------------------------------------
# under torch.compile: the stage as one operator, opaque to inductor
#
# A compiled ``ft.step`` / ``update`` calls ``functional_train::fused_stage`` for each stage on
# CPU tensors: the graph computes the scalars (clip factor, bias corrections, a scheduled or
# injected learning rate: graph values, so changing them does not recompile) and the operator
# runs the generated kernel on the real tensors -- the eager step's numbers and speed, and
# nothing for inductor to generate (its code for ~10 primitives per leaf over 122 leaves took
# 60-90 s to compile). A donated step's stage is ``functional_train::fused_stage_donated``,
# which mutates its inputs (the pure operator's results copied back cost 2.4x the eager
# donated step). Elsewhere (CUDA) the stage's plain operations are traced, leaf by leaf, for
# inductor.


# Whether a compiled donated step's stages that write their updates write them into new
# buffers, the gradients read only (see ``fused_stage_donated``): set by a compiled
# ``TorchOptimizer.step`` (:func:`read_only_updates`), whose copies of its new state into
# the held tensors meet the inductor fault described there; elsewhere over the gradients
# (new buffers cost a compiled ``multi_steps`` cycle on the benchmark tree 9%, and
# ``chain(clip, lamb)`` 13%: allocated every step).
_READ_ONLY_UPDATES = [False]


def read_only_updates(flag: bool) -> bool:
    """Under ``torch.compile``, from now on whether a donated step's stages that write their
    updates leave the gradients as they are and write them into new buffers (``False``, the
    default: over the gradients, as the eager donated step does). Returns the previous value
    (to set back). Read while dynamo traces: a constant of the graph."""
    previous = _READ_ONLY_UPDATES[0]
    _READ_ONLY_UPDATES[0] = flag
    return previous


def _opaque(u, p, fields, scalars) -> bool:
    """Whether a compiled stage runs as the operator: eager-capable CPU tensors, kernels on,
    nothing recorded for autograd."""
    if not fuse.ENABLED or not u:
        return False
    from ..autograd import is_differentiable

    if is_differentiable():
        return False
    # (the first leaf of each list stands for it: ft.step asks for CPU float32 / float64
    # leaves, and a per-leaf check costs dynamo's tracing time for every leaf)
    for lst in (u, p or (), *fields):
        # (an absent state leaf, None: masked / partition)
        x = next((y for y in lst if y is not None), None)
        if x is not None and (x.device.type != "cpu" or x.requires_grad or x.is_complex()):
            return False
    return not any(isinstance(x, torch.Tensor) and x.requires_grad for x in scalars)


# a leaf's static key in the operator's integer encoding: None and the bools by sentinels (a
# key may be any int besides)
_NONE_KEY, _FALSE_KEY, _TRUE_KEY = -(2**62), -(2**62) + 1, -(2**62) + 2
_DECODE = {_NONE_KEY: None, _FALSE_KEY: False, _TRUE_KEY: True}


def _encode_key(k) -> int:
    if k is None:
        return _NONE_KEY
    if isinstance(k, bool):
        return _TRUE_KEY if k else _FALSE_KEY
    if isinstance(k, int) and k not in _DECODE:
        return int(k)
    raise TypeError(f"a compiled stage takes static keys None, bool or int, got {k!r}")


@assume_constant_result  # (a function of static keys: dynamo calls it
def _encoded_keys(keys: tuple, n: int, m: int) -> str:  # once, untraced, a constant)
    """Every leaf's static keys, leaf by leaf, part by part, in the operator's encoding:
    their numbers (:func:`_encode_key`) as text, comma-separated. Text, not a list of ints:
    the dispatcher converts each element of a list argument on every call, to its boxed
    values and back to Python's for the operator's kernel (a 122-leaf stage of 9 parts,
    1,098 numbers: about 0.1 ms a call), and a string once."""
    return _ints_text(
        tuple(
            _encode_key(None if keys[j] is None else keys[j][i]) for j in range(n) for i in range(m)
        )
    )


@assume_constant_result  # (ints known while dynamo traces: a constant of the graph)
def _ints_text(ints: tuple) -> str:
    """``ints`` as the stage operators take a list of them (the keys, the absent leaves'
    positions): comma-separated text (see :func:`_encoded_keys`); read back by
    :func:`_ints_of`."""
    return ",".join(map(str, ints))


_INTS: dict = {}


def _ints_of(text: str) -> list:
    """The ints :func:`_ints_text` wrote, remembered per text (the same constant every call
    of a graph)."""
    hit = _INTS.get(text)
    if hit is None:
        if len(_INTS) >= 64:
            _INTS.clear()
        hit = _INTS[text] = [int(x) for x in text.split(",")] if text else []
    return hit


def _needed(part: Elementwise, ctx: dict):
    """Under ``torch.compile``, whether the values of ``part``'s reductions are used at all:
    the flags it runs under (``Elementwise.flags``), and-ed, a 0-dim bool tensor; ``None``
    (used) eagerly and for an unguarded part."""
    if not part.flags or not torch.compiler.is_compiling():
        return None
    out = None
    for k in part.flags:
        f = ctx.get(k)
        if f is not None:
            out = f if out is None else out & f
    return out


def _compiled(
    stage,
    counts,
    u,
    p,
    fields,
    scalars,
    keys,
    apply,
    sums=None,
    needed=None,
    psums=False,
    gate=None,
):
    n = len(u)
    flat = list(u) + (list(p) if p is not None else []) + [x for f in fields for x in f]
    numbers = [x for x in scalars if not isinstance(x, torch.Tensor)]
    sc = list(scalars)
    if numbers:  # (as 0-dim float64 tensors, made by an operator: see .scalars)
        made = iter(gated(gate, _as_tensors, u[0], *numbers))
        sc = [x if isinstance(x, torch.Tensor) else next(made) for x in scalars]
    m = len(stage.parts)
    enc = "" if all(k is None for k in keys) else _encoded_keys(tuple(keys), n, m)
    # (the operator also returns the updates' sums of squares, and with psums the
    # parameters' after them: layout[4] vectors)
    want = 0 if sums is None else 1 + bool(psums and p is not None)
    layout = [
        int(stage.apply),
        int(stage.drop_u),
        int(p is not None),
        len(fields),
        want,
        *counts,
    ]
    idents = [part.ident for part in stage.parts]
    ins, dst = _inputs(stage, u, p, fields)
    if apply == "donate" and _all_in_place(
        tuple(idents),
        tuple(layout),
        enc,
        tuple(map(_dtypes_or_none, ins)),
        tuple(x.dtype for x in sc),
    ):
        # every result over the input it replaces, by the operator itself: no copies
        # (a mutated list takes no None: the present tensors, and where the absent state
        # leaves stand, which the operator puts back as None)
        # (the updates read only where asked, see read_only_updates; then a stage that writes
        # them writes them into new buffers)
        read_only = _READ_ONLY_UPDATES[0]
        rest = flat[n:] if read_only else flat
        absent = [i for i, x in enumerate(rest) if x is None]
        present = [x for x in rest if x is not None] if absent else rest
        writes_u = read_only and dst and dst[0] == 0
        u_out = [torch.empty_like(x) for x in u] if writes_u else []
        ro = list(u) if read_only else []
        holes = _ints_text(tuple(absent)) if absent else ""
        taken = _stage_op_donated(idents, layout, enc, ro, present, u_out, holes, sc, needed)
        if want:
            sums.extend(_split_sums(taken, n))
        outs = [list(ins[d]) for d in dst]
        if u_out:
            outs[0] = u_out
        return outs
    res = _stage_op(idents, layout, enc, flat, sc, needed)
    if want:
        sums.extend(_split_sums(res[-1], n))
        res = res[:-1]
    if len(res) == n * len(dst):
        outs = [list(res[r * n : (r + 1) * n]) for r in range(len(dst))]
    else:  # (no results for absent state leaves: each stays absent)
        got = iter(res)
        outs = [[None if x is None else next(got) for x in ins[d]] for d in dst]
    if apply == "donate":
        for r, d in enumerate(dst):
            for x, y in zip(ins[d], outs[r]):
                if x is not None and x.dtype == y.dtype:
                    copy_into(x, y)  # the results over their inputs, as the eager donated step
    return outs


@scalar_program
def _as_tensors(like: torch.Tensor, *numbers) -> tuple:
    """``numbers`` as 0-dim float64 tensors on ``like``'s device."""
    return tuple(torch.tensor(float(x), dtype=torch.float64, device=like.device) for x in numbers)


@assume_constant_result
def _all_in_place(parts: tuple, layout: tuple, enc: str, in_dtypes: tuple, sc_dtypes: tuple):
    """Whether every result of the stage has the dtype of the input it replaces when donated
    (then ``functional_train::fused_stage_donated`` writes them all in place), from
    :func:`_result_dtypes` on 1-element meta tensors (the scalars 0-dim, as in the step: a
    0-dim scalar does not promote a leaf's dtype). Called by dynamo while it traces, on the
    dtypes (constants): no graph operation."""
    first_per_leaf = len(in_dtypes) - sum(len(_PARTS[i].leaf_scalars) for i in parts)
    metas = [
        [
            None
            if d is None
            else torch.empty((1,) if r < first_per_leaf else (), dtype=d, device="meta")
            for d in lst
        ]
        for r, lst in enumerate(in_dtypes)
    ]
    stage, counts, keys, u, p, fields = _unflat(
        list(parts), list(layout), enc, [x for lst in metas for x in lst]
    )
    scalars = [torch.empty((), dtype=d, device="meta") for d in sc_dtypes]
    ins, dst = _inputs(stage, u, p, fields)
    for j, res in enumerate(_result_dtypes(stage, counts, keys, u, p, fields, scalars)):
        for r, dtype in enumerate(res):
            d = ins[dst[r]][j]
            if d is not None and dtype is not None and dtype != d.dtype:
                return False
    return True


def _plain(flat: list) -> list:
    """A stage operator's inputs as plain tensors: inductor hands a compiled
    ``TorchOptimizer.step`` the optimizer's ``nn.Parameter`` objects themselves (the graph's
    ``p.detach()`` is a no-op to it), which the generated kernels do not take (they run on plain
    tensors without autograd): each such input detached (the same memory, so a donated stage
    still writes the parameter). A C loop over the types where every input is plain."""
    if set(map(type, flat)) <= _PLAIN_TYPES:
        return flat
    return [x if x is None or type(x) is torch.Tensor else x.detach() for x in flat]


_PLAIN_TYPES = {torch.Tensor, type(None)}


def _unflat(parts, layout, enc, flat):
    apply, drop_u, has_p, n_fields = layout[:4]
    counts = tuple(layout[5:])
    stage = _stage_of(tuple(_PARTS[i] for i in parts), bool(apply), bool(drop_u))
    n = len(flat) // (1 + has_p + n_fields)
    m = len(parts)
    keys = [None] * n if not enc else _decoded(enc, n, m)  # (no keys: the common case)
    u = flat[:n]
    p = flat[n : 2 * n] if has_p else None
    base = n * (1 + has_p)
    fields = [flat[base + f * n : base + (f + 1) * n] for f in range(n_fields)]
    return stage, counts, keys, u, p, fields


_DECODED: dict = {}


def _decoded(text: str, n: int, m: int) -> list:
    """The leaves' static keys from a compiled stage's encoding (:func:`_encoded_keys`: the
    numbers of :func:`_encode_key`, part by part, leaf after leaf), remembered per encoding
    (the same every call of a graph)."""
    key = (n, m, text)
    hit = _DECODED.get(key)
    if hit is None:
        if len(_DECODED) >= 64:
            _DECODED.clear()
        enc = _ints_of(text)
        hit = _DECODED[key] = [
            None
            if all(e == _NONE_KEY for e in enc[j * m : (j + 1) * m])
            else tuple(_DECODE.get(e, e) for e in enc[j * m : (j + 1) * m])
            for j in range(n)
        ]
    return hit  # (the remembered list itself: its readers do not change it, and _guards_of
    # remembers its answers by it)


@torch.library.custom_op("functional_train::fused_stage", mutates_args=())
def _stage_op(
    parts: list[int],
    layout: list[int],
    keys: str,
    flat: list[torch.Tensor | None],
    scalars: list[torch.Tensor],
    needed: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The results (result after result, leaf after leaf) of the stage of the elementwise
    ``parts`` (their ``ident``) on its inputs ``flat`` (updates, parameters if any, fields;
    leaf after leaf; an absent state leaf is ``None`` and has no result: the list leaves it
    out), eagerly. It reads the wrappers' flags when it runs, as ``fused_stage_donated`` does: a
    stage that leaves every buffer as it was (:func:`_idle`) returns lazy clones of them
    (copy-on-write, :func:`.pool.lazy_clones`: no pass), and updates no one uses
    (:func:`_discarded`) are not computed (their results are buffers of the right shape and
    dtype, as they are). ``layout``: ``(apply, drop_u, has_p, n_fields, sums, *counts)``;
    ``keys``: the leaves' static keys, part by part, leaf after leaf, as text
    (:func:`_encoded_keys`; empty where every key is ``None``). With ``sums`` the last
    result is the new updates' per-leaf sums of squares (a float64 vector: :func:`_op_sums`,
    ``needed`` as there); ``sums`` 2: the parameters' after them (twice as long)."""
    enc = keys
    stage, counts, keys, u, p, fields = _unflat(parts, layout, keys, _plain(flat))
    # results from a pool of the operator's own, by stage (see .pool: a buffer is reused only
    # when nothing else holds it), so that a compiled step's results take no page faults
    take = _op_pool.take

    def kinds(kind, like):
        return take(f"op{id(stage)}:{kind}", like)

    # (what the flags say, read when the operator runs, as the donated operator reads them:
    # a stage that leaves every buffer as it was gives lazy clones of them, copy-on-write,
    # no pass; a stage whose updates no one uses does not compute them)
    want = bool(layout[4])
    ps = p if layout[4] == 2 else None  # (the parameters' sums too)
    idle = LAZY_CLONES and _idle(stage, counts, scalars, keys)
    unused = LAZY_CLONES and not idle and _discarded(stage, counts, scalars, keys)
    if (idle or unused) and not _same_dtypes(parts, layout, enc, stage, u, p, fields, scalars):
        idle = unused = False
    if idle:
        ins, dst = _inputs(stage, u, p, fields)
        held = _held([x for d in dst for x in ins[d] if x is not None])
        return [*held, _op_sums(needed, u, None, len(u), ps)] if want else held
    j = (
        _held_from(stage, counts, scalars, keys)
        if LAZY_CLONES and not unused and not want
        else None
    )
    run = (
        _run_prefix(stage, counts, keys, u, p, fields, scalars, j, None, kinds)
        if j is not None and _same_dtypes(parts, layout, enc, stage, u, p, fields, scalars)
        else None
    )
    if run is not None:
        # (the first j parts' fields computed; the parameters and the other fields, as they
        # are, lazy clones)
        written, _, n_written = run
        ins, dst = _inputs(stage, u, p, fields)
        first_field = 1 + (p is not None)
        kept = [d for d in dst if not first_field <= d < first_field + n_written]
        as_they_are = iter(_held([x for d in kept for x in ins[d]]))
        outs = [
            written[d - first_field]
            if first_field <= d < first_field + n_written
            else [next(as_they_are) for _ in ins[d]]
            for d in dst
        ]
        return _fresh_results(outs, flat)
    if unused:
        stage = _stage_of(stage.parts, False, True)
    taken: list | None = [] if want and not unused else None
    with torch.no_grad():
        outs = _execute_local(
            stage, counts, u, p, fields, list(scalars), keys, None, kinds, taken, ps is not None
        )
    if want:
        sums = _op_sums(needed, None if unused else outs[0], taken, len(u), ps)
    if unused:  # (the updates' buffers, as they are: read by no one)
        outs = [kinds("discarded", u), *outs]
    results = _fresh_results(outs, flat)
    if want:
        results.append(sums)
    return results


def _fresh_results(outs: list, flat: list) -> list:
    """A stage operator's results, result after result, leaf after leaf (``outs``: a list
    per result), as the operator may return them."""
    # (an operator's result may be neither an input nor another result: a leaf function's
    # update that is its new state, as trace's, run in torch, is copied; and it is
    # contiguous, as the fake results are: a result made like a transposed update, as Muon's
    # for a tall matrix, is copied)
    results = list(itertools.chain.from_iterable(outs))
    if any(map(operator.is_, results, itertools.repeat(None))):
        # (absent state leaves, a partition's restricted parts' outside their leaves: no
        # result, as an absent leaf's result is None exactly where its input is)
        results = [x for x in results if x is not None]
    ids = set(map(id, results))
    if (  # (the common case, by whole-list C loops: contiguous new tensors, each once)
        len(ids) != len(results)
        or not ids.isdisjoint(map(id, flat))
        or not all(map(_contiguous, results))
    ):
        seen = {id(x) for x in flat if x is not None}
        fresh = []
        for x in results:
            if id(x) in seen or not x.is_contiguous():
                fresh.append(x.clone(memory_format=torch.contiguous_format))
            else:
                seen.add(id(x))
                fresh.append(x)
        results = fresh
    return results


def _op_sums(needed, updates, taken, n: int, params=None) -> torch.Tensor:
    """The per-leaf sums of squares a compiled stage returns (``layout[4]``): those its kernel
    took as it wrote the updates (``taken``), else the native sums of ``updates`` (the same
    bits), or zeros (no pass) where nobody reads them: ``needed`` false (read now), or the
    updates not computed (``None``). With ``params`` (``layout[4]`` 2), the parameters' after
    them, as its kernel took them as it read them, else the native sums."""
    want = 1 if params is None else 2
    if taken and len(taken) == want:
        return taken[0] if want == 1 else torch.cat(taken)
    if updates is None or (needed is not None and not bool(needed)):
        return torch.zeros(n * want, dtype=torch.float64)
    from .native import sums_of_squares

    got = list(taken or ()) or [sums_of_squares(updates)]
    if params is not None:
        got.append(sums_of_squares(params))
    return got[0] if want == 1 else torch.cat(got)


_op_pool = Pool()


def _held(xs: list) -> list:
    """The results of an idle stage of ``functional_train::fused_stage`` for the inputs
    ``xs`` it leaves as they were (tensors): their lazy clones (no copy until either side is
    written), a contiguous copy of a strided one."""
    cs = lazy_clones(xs) if all(map(_contiguous, xs)) else None  # (the common case: one batch)
    if cs is not None:
        return cs
    # (the contiguous tensors still cloned in one batch)
    at = [i for i, x in enumerate(xs) if x.is_contiguous()]
    cs = lazy_clones([xs[i] for i in at]) or [xs[i].clone() for i in at]
    out: list = [None if x.is_contiguous() else x.contiguous() for x in xs]
    for i, c in zip(at, cs):
        out[i] = c
    return out


_contiguous = torch.Tensor.is_contiguous


_SAME_DTYPES: dict = {}


def _dtypes_or_none(xs: list) -> tuple:
    """The dtypes of ``xs``, ``None`` for an absent leaf (eagerly a C loop where none is
    absent; dynamo does not trace ``attrgetter``)."""
    if torch.compiler.is_compiling() or any(map(operator.is_, xs, itertools.repeat(None))):
        return tuple(None if x is None else x.dtype for x in xs)
    return tuple(map(DTYPE, xs))


def _same_dtypes(parts, layout, enc, stage, u, p, fields, scalars) -> bool:
    """Whether every result of the stage has the dtype of the input it replaces (then a
    result left as it was may be its input's lazy clone, and unused updates a buffer of the
    updates' dtype), remembered per signature."""
    ins, _ = _inputs(stage, u, p, fields)
    key = (
        tuple(parts),
        tuple(layout),
        enc,
        tuple(map(_dtypes_or_none, ins)),
        tuple(x.dtype for x in scalars),
    )
    hit = _SAME_DTYPES.get(key)
    if hit is None:
        if len(_SAME_DTYPES) >= 256:
            _SAME_DTYPES.clear()
        hit = _SAME_DTYPES[key] = _all_in_place(*key)
    return hit


@torch.library.custom_op("functional_train::fused_stage_donated", mutates_args=("flat", "u_out"))
def _stage_op_donated(
    parts: list[int],
    layout: list[int],
    keys: str,
    u: list[torch.Tensor],
    flat: list[torch.Tensor],
    u_out: list[torch.Tensor],
    absent: str,
    scalars: list[torch.Tensor],
    needed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``functional_train::fused_stage`` for a donated step whose results all have the dtypes
    of the inputs they replace (see :func:`_inputs`): each written over its input, as the
    eager donated step writes it. Under ``torch.compile`` inductor runs it on the step's
    inputs themselves (no copies). ``flat``: the updates (the gradients at the first stage),
    the parameters (if any) and the state fields' leaves, without the absent ones
    (``absent``: their positions there, as text, :func:`_ints_text`; the operator puts
    ``None`` back). With :func:`read_only_updates`, the updates are ``u`` instead, read only
    (``flat`` without them), and a stage that writes updates (one that does not apply them)
    writes them into ``u_out``, new buffers of their layout (``u`` and ``u_out`` are empty
    otherwise).
    (Inductor, torch 2.13: where a custom operator wrote a graph input in place, an
    elementwise value the graph computed from that input before the write and then copied
    into another input, as a compiled ``TorchOptimizer.step`` copies its new state back, was
    recomputed after the write, from the new contents: Adafactor's and CAME's unfactored
    second moments, computed from the gradients, came out wrong when this operator wrote its
    updates over them.) Returns the new updates' sums of squares as ``fused_stage`` does
    where ``layout`` asks for them (and the parameters' after them), else an empty float64
    vector."""
    stage, counts, keys, u, p, fields = _unflat(
        parts, layout, keys, list(u) + _present(_plain(flat), absent)
    )
    want = bool(layout[4])
    ps = p if layout[4] == 2 else None
    if _idle(stage, counts, scalars, keys):  # (a stage that applies, or writes no updates)
        return _op_sums(needed, u, None, len(u), ps) if want else _NO_SUMS.new_empty(0)
    j = None if want else _held_from(stage, counts, scalars, keys)
    run = (
        None
        if j is None
        else _run_prefix(stage, counts, keys, u, p, fields, scalars, j, "donate", None)
    )
    if run is not None:  # (the first j parts' fields over their inputs; the rest as they are)
        outs, (ins, dst), _ = run
        _written(outs, ins, dst)
        return _NO_SUMS.new_empty(0)
    unused = _discarded(stage, counts, scalars, keys)
    if unused:  # (its fields only: the updates over nothing)
        stage = _stage_of(stage.parts, False, True)
    taken: list | None = [] if want and not unused else None
    with torch.no_grad():
        outs = _execute_local(
            stage,
            counts,
            u,
            p,
            fields,
            list(scalars),
            keys,
            "donate",
            None,
            taken,
            ps is not None,
            u_out or None,
        )
    sums = (
        _op_sums(needed, None if unused else outs[0], taken, len(u), ps)
        if want
        else _NO_SUMS.new_empty(0)
    )
    ins, dst = _inputs(stage, u, p, fields)
    if u_out and not unused:
        ins[0] = u_out
    _written(outs, ins, dst)
    return sums


def _written(outs: list, ins: list, dst: list) -> None:
    """A donated stage operator's results ``outs`` over the inputs they replace
    (``ins[dst[r]]``), where they are not already (the eager step's fallback, leaf by leaf in
    torch, makes fresh results; the kernels write in place: a C loop finds each such list
    done)."""
    for r, lst in enumerate(outs):
        if all(map(operator.is_, lst, ins[dst[r]])):
            continue
        for i, x in enumerate(lst):
            d = ins[dst[r]][i]
            if x is not None and x is not d:
                d.copy_(x)


_NO_SUMS = torch.empty(0, dtype=torch.float64)


@_stage_op_donated.register_fake
def _(parts, layout, keys, u, flat, u_out, absent, scalars, needed=None):
    if not layout[4]:
        return torch.empty(0, dtype=torch.float64)
    n = len(u) or (len(flat) + len(_ints_of(absent))) // (1 + layout[2] + layout[3])
    return torch.empty(n * layout[4], dtype=torch.float64)


# (the operators' own kernels, registered over custom_op's: see .operators)
register_kernels(_stage_op)
register_kernels(_stage_op_donated, mutated=(4, 5))


def _idle(stage, counts, scalars, keys) -> bool:
    """Whether a donated stage leaves every buffer it writes as it was, read from its flags
    (see :attr:`Elementwise.guard`): each part guarded and its flag false, and the stage's
    updates not written (only fields) or zero where they meet the parameters (``p + 0``,
    which leaves ``p`` as the eager step does, whose skipped micro-step makes no pass over
    it). A compiled ``multi_steps`` non-final micro-step's inner stage, a non-finite step's of
    ``apply_if_finite``. Reads the flags' values: at run time, inside the operator. With
    restricted parts (``keys``: the leaves' static keys), the parts acting on some leaf, and
    each leaf's last such part zeroing (:func:`_guards_of`)."""
    if not (stage.apply or stage.drop_u) or not stage.parts:
        return False
    flags = _guards_of(stage, counts, keys)[0]
    return flags is not None and not any(bool(scalars[i]) for i in flags)


def _held_from(stage, counts, scalars, keys) -> int | None:
    """Where a stage that is not idle (:func:`_idle`) leaves every buffer after its first
    ``j`` parts as it was, that ``j``, read from the flags as :func:`_idle` reads them: the
    parts from ``j`` on each guarded (``HOLDS`` or ``ZEROES``) with its flag false, and the
    last zeroing the updates where they meet the parameters (or the stage writing no
    updates). Its first ``j`` parts' updates are then used by no one, and only their fields
    are written: a compiled ``multi_steps`` non-final micro-step of a chain without a
    reduction (its accumulation and the inner transform in one stage) makes its one pass
    over the gradients and the accumulators, not over the parameters and the inner state
    too. ``None`` otherwise, and for a stage holding restricted parts (``masked`` /
    ``partition``'s, whose guards hold per leaf)."""
    parts = stage.parts
    if not (stage.apply or stage.drop_u) or len(parts) < 2:
        return None
    if not stage.drop_u and parts[-1].guard != ZEROES:
        return None
    if any(part.restrict is not None for part in parts):
        return None
    ends = list(itertools.accumulate(counts))
    j = len(parts)
    while j > 1:
        part = parts[j - 1]
        if part.guard not in (HOLDS, ZEROES) or not counts[j - 1] or bool(scalars[ends[j - 1] - 1]):
            break
        j -= 1
    return None if j == len(parts) else j


def _run_prefix(stage, counts, keys, u, p, fields, scalars, j: int, apply, take):
    """The first ``j`` parts of ``stage`` writing their fields only (see :func:`_held_from`;
    ``apply`` and ``take`` as :func:`_execute_local`'s): ``(their results, (their inputs,
    the inputs the results replace), the number of the stage's state fields they write)``,
    or ``None`` where one of their state leaves is absent (the stage then runs whole)."""
    parts = stage.parts[:j]
    sub = _stage_of(parts, False, True)
    n_fields = sum(part.n_fields for part in parts)
    n_all = sum(part.n_fields for part in stage.parts)
    n_per_leaf = sum(len(part.leaf_scalars) for part in parts)
    sub_fields = fields[:n_fields] + fields[n_all : n_all + n_per_leaf]
    if any(x is None for lst in sub_fields for x in lst):
        return None
    sub_p = p if sub.params else None
    with torch.no_grad():
        outs = _execute_local(
            sub,
            counts[:j],
            u,
            sub_p,
            sub_fields,
            list(scalars[: sum(counts[:j])]),
            [None if k is None else k[:j] for k in keys],
            apply,
            take,
        )
    return outs, _inputs(sub, u, sub_p, sub_fields), n_fields


def _discarded(stage, counts, scalars, keys) -> bool:
    """Whether a stage's updates are used by no one (a part of it ``DISCARDS`` them, its flag
    false, and no later part of the stage makes them zeros, which are used: ``zeroed_unless``
    ending a run that returns its updates) while the stage would write them (see
    :attr:`Elementwise.guard`). With restricted parts, so on every leaf (see
    :func:`_guards_of`)."""
    if stage.apply or stage.drop_u:
        return False
    choices = _guards_of(stage, counts, keys)[1]
    if choices is None:
        return False
    false = {i for c in choices for i in c if not bool(scalars[i])}
    return all(not false.isdisjoint(c) for c in choices)


def _guards_of(stage, counts, keys) -> tuple:
    """What :func:`_idle` and :func:`_discarded` read for a stage: ``(idle, discarded)``,
    per leaf where the stage holds restricted parts (``masked`` / ``partition``'s: a part
    acts on the leaves where its key is neither ``False`` nor ``None``, an unrestricted one
    on every leaf; outside its leaves it passes the updates through, so its guard holds
    there for nothing), else the same for every leaf.
    ``idle``: the scalar positions of the flags that must all be false for the stage to be
    idle (every part acting on some leaf guarded, and each leaf's last such part zeroing
    unless the stage writes no updates), or ``None`` where it never is (a leaf no part
    acts on: its updates, passed through, are not known zero). ``discarded``: per kind of
    leaf, the flag positions of the ``DISCARDS`` parts acting on it after which no part
    acting on it zeroes (one false flag in each discards the stage's updates), or ``None``.
    Remembered per stage and keys (the same list for a compiled graph's every call), or
    per stage and ``counts`` where no part is restricted (then the keys do not matter: an
    eager stage's are often a new list each call)."""
    if not any(part.restrict is not None for part in stage.parts):
        keys = _ONE_LEAF.get(counts)
        if keys is None:
            keys = _ONE_LEAF[counts] = [None]  # (a list per counts: the memo's key below)
    hit = _GUARDS.get((id(stage), id(keys)))
    if hit is not None and hit[0] is stage and hit[1] is keys:
        return hit[2]
    flag_at, k = [], 0
    for n in counts:
        k += n
        flag_at.append(k - 1 if n else None)
    parts = stage.parts
    acting: set = set()
    idle_ok = True
    choices: set = set()
    for leaf_keys in keys:
        on = [
            i
            for i, part in enumerate(parts)
            if part.restrict is None
            or (leaf_keys is not None and leaf_keys[i] is not None and leaf_keys[i] is not False)
        ]
        acting.update(on)
        if not on or not (stage.drop_u or parts[on[-1]].guard == ZEROES):
            idle_ok = False
        cand, zeroed = [], False
        for i in reversed(on):
            if parts[i].guard == ZEROES:
                zeroed = True
            elif parts[i].guard == DISCARDS and not zeroed and flag_at[i] is not None:
                cand.append(flag_at[i])
        choices.add(frozenset(cand))
    if any(parts[i].guard not in (HOLDS, ZEROES) or flag_at[i] is None for i in acting):
        idle_ok = False
    idle = sorted(flag_at[i] for i in acting) if idle_ok and acting else None
    discarded = None if not choices or frozenset() in choices else list(choices)
    if len(_GUARDS) >= 64:
        _GUARDS.clear()
    _GUARDS[(id(stage), id(keys))] = (stage, keys, (idle, discarded))
    return idle, discarded


_GUARDS: dict = {}
_ONE_LEAF: dict = {}  # (counts -> the keys an unrestricted stage's rule is read with)


def _present(flat: list, absent: str) -> list:
    """The inputs of ``fused_stage_donated``: ``flat`` with ``None`` at the positions
    ``absent`` (text, :func:`_ints_text`): one gather by an index remembered per text
    and length (a ``None`` after ``flat``'s items stands for each absent one)."""
    if not absent:
        return flat
    n = len(flat)
    hit = _GATHERS.get((absent, n))
    if hit is None:
        holes = set(_ints_of(absent))
        taken = iter(range(n))
        if len(_GATHERS) >= 64:
            _GATHERS.clear()
        hit = _GATHERS[(absent, n)] = [
            n if i in holes else next(taken) for i in range(n + len(holes))
        ]
    return list(map([*flat, None].__getitem__, hit))


_GATHERS: dict = {}


@_stage_op.register_fake
def _(parts, layout, keys, flat, scalars, needed=None):
    parts, layout = ([int(x) for x in xs] for xs in (parts, layout))
    stage, counts, keys, u, p, fields = _unflat(parts, layout, keys, flat)
    out = _fake_results(stage, counts, keys, u, p, fields, scalars)
    if layout[4]:
        out.append(torch.empty(len(u) * layout[4], dtype=torch.float64))
    return out


def _result_dtypes(stage, counts, keys, u, p, fields, scalars) -> list:
    """Per leaf, the dtypes of the stage's results (``None`` for an absent state leaf's), from
    one run of the stage per dtype signature and key (tracing it on every leaf took 2.5 s of
    a 122-leaf compile)."""
    dtypes_of: dict = {}
    per_leaf = []
    with torch.no_grad():
        for j in range(len(u)):
            ins = tuple([u[j]] + ([p[j]] if p is not None else []) + [f[j] for f in fields])
            sig = (tuple(None if x is None else x.dtype for x in ins), keys[j])
            hit = dtypes_of.get(sig)
            if hit is None:
                # (a 0-dim leaf as one element, as the kernels take it: with 0-dim float64
                # scalars torch's promotion would give a 0-dim leaf's results float64; the
                # per-leaf scalars after the fields stay 0-dim, as the kernels read them)
                first = len(ins) - stage.n_per_leaf
                ins = tuple(
                    x if x is None or r >= first or x.dim() else x.reshape(1)
                    for r, x in enumerate(ins)
                )
                res = _function(stage, counts, keys[j])(ins, tuple(scalars))
                hit = dtypes_of[sig] = tuple(None if x is None else x.dtype for x in res)
            per_leaf.append(hit)
    return per_leaf


def _fake_results(stage, counts, keys, u, p, fields, scalars):
    """The stage's results as empty tensors of their shapes and dtypes (result after result,
    leaf after leaf; an absent state leaf has none)."""
    per_leaf = _result_dtypes(stage, counts, keys, u, p, fields, scalars)
    out: list = []
    for r in range(len(per_leaf[0]) if per_leaf else 0):
        out.extend(
            torch.empty(u[j].shape, dtype=d[r], device=u[j].device)
            for j, d in enumerate(per_leaf)
            if d[r] is not None
        )
    return out


def _local_tensor_type():
    try:
        from torch.distributed._local_tensor import LocalTensor
    except ImportError:  # pragma: no cover
        return None
    return LocalTensor


def _simulated_ranks(u, p, fields, scalars):
    LocalTensor = _local_tensor_type()
    if LocalTensor is None:
        return None
    compiling = torch.compiler.is_compiling()
    for lst in (u, p or (), *fields, scalars):
        if compiling or LocalTensor in set(map(type, lst)):  # (eagerly: whole lists)
            for x in lst:
                if type(x) is LocalTensor:
                    return sorted(x._local_tensors)
    return None


def _per_rank(ranks, stage, counts, u, p, fields, scalars, keys, apply):
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    LocalTensor = _local_tensor_type()

    def on(x, r):
        return x._local_tensors[r] if type(x) is LocalTensor else x

    results = []
    with maybe_disable_local_tensor_mode():
        for r in ranks:
            results.append(
                _execute_local(
                    stage,
                    counts,
                    [on(x, r) for x in u],
                    None if p is None else [on(x, r) for x in p],
                    [[on(x, r) for x in f] for f in fields],
                    [on(x, r) for x in scalars],
                    keys,
                    apply,
                    None,
                )
            )
        return [
            [
                None
                if results[0][k][j] is None
                else LocalTensor({r: res[k][j] for r, res in zip(ranks, results)})
                for j in range(len(u))
            ]
            for k in range(len(results[0]))
        ]


def _inputs(stage, u, p, fields) -> tuple[list, list]:
    """A stage's input lists ``[u, p (if any), *fields]`` (``fields``: the state fields, then
    the per-leaf scalars) and, per result, the input it overwrites when donated: the
    parameters (or, for a stage that does not apply, the updates), then the state fields."""
    ins = [u] + ([p] if p is not None else []) + list(fields)
    first_field = 1 + (p is not None)
    dst = [] if stage.drop_u else [1 if stage.apply else 0]
    dst += range(first_field, first_field + len(fields) - stage.n_per_leaf)
    return ins, dst


def _execute_local(
    stage, counts, u, p, fields, scalars, keys, apply, take, sums=None, psums=False, u_out=None
):
    """:func:`_execute` on this process's tensors. ``u_out``: with ``apply="donate"``, the
    buffers a stage that writes updates writes them into (``None``: over ``u``)."""
    n = len(u)
    n_out = len(fields) - stage.n_per_leaf + (0 if stage.drop_u else 1)
    if n == 0:
        return [[] for _ in range(n_out)]
    ins, dst = _inputs(stage, u, p, fields)
    plain = (
        fuse.ENABLED
        and not _recording()
        and not any(isinstance(x, torch.Tensor) and x.requires_grad for x in scalars)
    )

    def checked(ins):
        # (per-leaf values that are vectors broadcast against their leaves: _broadcast_groups)
        spread = (
            plain and stage.n_per_leaf and not _single_values(ins[len(ins) - stage.n_per_leaf :])
        )
        return spread, (_uniform(ins, keys) if plain and not spread else None)

    spread, uniform = checked(ins)
    # (whole-list C loops eagerly; a list under torch.compile, whose dynamo does not trace
    # a map of a method; the whole-list checks' one dtype of the updates where they passed)
    if uniform is not None and not uniform[0].is_complex:
        cx = False
    elif torch.compiler.is_compiling():
        cx = any([x.is_complex() for x in u])
    else:
        cx = any(map(_IS_COMPLEX, u))
    if cx:
        ins = [
            [torch.view_as_real(x) if x is not None and x.is_complex() else x for x in lst]
            for lst in ins
        ]
        spread, uniform = checked(ins)
    outs: list = [[None] * n for _ in range(n_out)]
    # groups of leaves with one dtype signature, key and set of absent state leaves (a
    # ``None`` field: a leaf outside a ``masked`` / ``partition`` transform's leaves, which
    # its part passes through), for one kernel call each
    groups: dict = {}
    if spread:
        _broadcast_groups(ins, keys, stage.n_per_leaf, plain, groups)
    elif uniform is not None:  # (the common case, checked by whole lists: one group)
        groups[(True, uniform, keys[0], ())] = list(range(n))
    elif plain and not torch.compiler.is_compiling():
        # (a masked / partitioned chain: groups by key and absent leaves first, then each
        # group's lists checked whole, leaf by leaf only where that fails)
        for (key, absent), idx in _by_key(ins, keys).items():
            present = [lst for k, lst in enumerate(ins) if k not in absent]
            whole = len(idx) == n
            dtypes = _dtypes_of([lst if whole else [lst[j] for j in idx] for lst in present])
            if dtypes is not None:
                groups[(True, dtypes, key, absent)] = idx
            else:
                _leaf_groups(ins, keys, idx, plain, groups)
    else:
        _leaf_groups(ins, keys, range(n), plain, groups)
    if cx or stage.drop_u or torch.compiler.is_compiling():
        sums = None
    # (sums of squares of the updates: where every group's kernel took them, as it wrote its
    # leaves: per group, its leaves and its sums; None once a group has taken none)
    taken: list | None = None if sums is None else []
    scs: dict = {}  # the scalars as each device's kernels read them
    for g, ((fast, dtypes, key, absent), idx) in enumerate(groups.items()):
        fn = _function(stage, counts, key)
        if fast:
            dev = ins[0][idx[0]].device
            sc = scs.get(dev, False)
            if sc is False:
                sc = scs[dev] = fuse.scalar_pointers(scalars, dev)
            if sc is not None:
                g_fn, g_ins, g_outs, g_dst = fn, ins, outs, dst
                if absent:  # the kernel of the present inputs and results
                    g_fn, in_keep, out_keep = _without(fn, absent, len(ins), dst)
                    g_ins = [ins[i] for i in in_keep]
                    g_outs = [outs[r] for r in out_keep]
                    g_dst = [in_keep.index(dst[r]) for r in out_keep]
                kernel = None
                rows = fast if isinstance(fast, tuple) else None  # (kinds by input: by rows)
                strided = fast is STRIDED
                summing = taken is not None and rows is None and not strided
                if summing and psums and stage.params:
                    # (the parameters', ins[1], as it reads them: see _inputs)
                    kernel = fuse.kernel_for(
                        g_fn, dtypes, sc[1], stage.n_per_leaf, dev.type, sumsq=True, sum_in=1
                    )
                if summing and kernel is None:
                    kernel = fuse.kernel_for(
                        g_fn, dtypes, sc[1], stage.n_per_leaf, dev.type, sumsq=True
                    )
                got: list = []
                if kernel is None:
                    vectors = () if rows is None else _vectors(rows, stage.n_per_leaf)
                    kernel = fuse.kernel_for(
                        g_fn, dtypes, sc[1], stage.n_per_leaf, dev.type, vectors=vectors
                    )
                if kernel is not None and _run_kernel(
                    kernel,
                    g_ins,
                    idx,
                    g_outs,
                    sc[0],
                    apply,
                    _group_kinds(take, g),
                    g_dst,
                    dtypes,
                    got,
                    rows,
                    strided,
                    u_out,
                ):
                    if taken is not None:
                        taken = taken + [(idx, got)] if got else None
                    continue
        taken = None  # (leaf by leaf in torch: no sums)
        with torch.enable_grad() if _recording() else torch.no_grad():
            for j in idx:
                res = fn(tuple(lst[j] for lst in ins), tuple(scalars))
                for r in range(n_out):
                    outs[r][j] = res[r]
        if apply == "donate":  # the results into the donated buffers
            for j in idx:
                for r in range(n_out):
                    d = ins[dst[r]][j] if dst[r] or u_out is None else u_out[j]
                    if d is not None and outs[r][j] is not d and outs[r][j].dtype == d.dtype:
                        d.copy_(outs[r][j])
                        outs[r][j] = d
    if taken and sums is not None:
        sums.extend(_gathered(taken, n))
    if cx:
        outs = [
            [
                torch.view_as_complex(x)
                if x is not None and u[j].is_complex() and not x.is_complex()
                else x
                for j, x in enumerate(lst)
            ]
            for lst in outs
        ]
    return outs


def _split_sums(v: torch.Tensor, n: int) -> list:
    """The per-leaf sums of squares of ``n`` leaves that a kernel or a stage operator returns
    as one float64 vector: the updates', then the parameters' where it summed them too
    (``len(v) // n`` vectors of ``n``)."""
    return [v] if len(v) == n else list(v.split(n))


def _gathered(taken: list, n: int) -> list:
    """The per-leaf sums of squares that the kernel calls of a stage's groups took (``taken``:
    per group, its leaves' positions and its vectors: the updates', then the parameters'
    where it summed them), as vectors over all ``n`` leaves in order; the parameters' only
    where every group took them."""
    k = min(len(got) for _, got in taken)
    if len(taken) == 1:  # (one group: every leaf, in order)
        return taken[0][1][:k]
    full = [torch.empty(n, dtype=torch.float64) for _ in range(k)]
    for idx, got in taken:
        at = torch.tensor(idx, dtype=torch.int64)
        for x, v in zip(full, got):
            x.index_copy_(0, at, v)
    return full


def _leaf_groups(ins: list, keys: list, idx, plain: bool, groups: dict) -> None:
    """The leaves ``idx`` into ``groups``, leaf by leaf: by whether a kernel runs them (plain
    tensors without autograd on a device where kernels run, contiguous, or all in the
    update's memory order: :data:`STRIDED`), their dtypes, key and absent inputs."""
    for j in idx:
        leaf_ins = [lst[j] for lst in ins]
        absent = tuple(k for k, x in enumerate(leaf_ins) if x is None)
        if absent:
            leaf_ins = [x for x in leaf_ins if x is not None]
        dev = leaf_ins[0].device if plain and _kernel_device(leaf_ins[0]) else None
        fast: bool | str = dev is not None and all(
            type(x) is torch.Tensor and x.device == dev and not x.requires_grad for x in leaf_ins
        )
        if fast and not all(x.is_contiguous() for x in leaf_ins):
            fast = STRIDED if _in_one_order(leaf_ins) else False
        sig = (fast, tuple(x.dtype for x in leaf_ins) if fast else None, keys[j], absent)
        groups.setdefault(sig, []).append(j)
    # (the leaves in another memory order join the contiguous ones of their signature: a kernel
    # reads every leaf's memory in order either way, and the strided group's results are made
    # leaf by leaf in each one's order: one call, on CUDA one launch, where there were two)
    for sig in [sig for sig in groups if sig[0] is STRIDED]:
        contiguous = (True, *sig[1:])
        if contiguous in groups:
            groups[sig] = sorted(groups.pop(contiguous) + groups[sig])


# a group of leaves whose tensors are not contiguous but each leaf's share one memory order
# (``channels_last`` convolution weights, their gradients and states): a kernel reads and writes
# every leaf's memory in order, which is the same element of each of them; results made in
# that order (``torch.empty_like``)
STRIDED = "strided"


def _in_one_order(xs: list) -> bool:
    """Whether the leaf's tensors ``xs`` (the update first) all lie in the update's memory
    order, without gaps or overlaps (:func:`.pool.in_one_order`), so that element ``k`` of each
    one's memory is the same element of the leaf; a single value (the per-leaf scalars) counts
    as in order."""
    u = xs[0]
    if not in_one_order(u):
        return False
    shape, stride = u.shape, u.stride()
    return all(x.numel() <= 1 or (x.shape == shape and x.stride() == stride) for x in xs[1:])


def _single_values(lists: list) -> bool:
    """Whether every per-leaf value of these lists is one value (0-dim or one element; a
    C loop per list), as a kernel called on whole leaves reads them."""
    try:
        return all(set(map(_NUMEL, lst)) == {1} for lst in lists)
    except TypeError:  # (not a tensor: leaf by leaf, where the leaf function reads it)
        return False


_NUMEL = torch.Tensor.numel


def _operand_kind(x, shape) -> str | None:
    """How a per-leaf value ``x`` broadcasts against its leaf of ``shape``: ``"s"`` one value
    (0-dim or one element), ``"v"`` leaf-shaped, ``"r"`` one per row (``(..., n, 1)``),
    ``"c"`` one per column (``(..., 1, m)``); ``None`` otherwise (absent, or another shape)."""
    if x is None:
        return None
    if x.numel() == 1:
        return "s"
    got, want = tuple(x.shape), tuple(shape)
    if got == want:
        return "v"
    if len(want) >= 2 and got == want[:-1] + (1,):
        return "r"
    if len(want) >= 2 and got == want[:-2] + (1, want[-1]):
        return "c"
    return None


def _vectors(kinds: tuple, n_per_leaf: int) -> tuple:
    """For a kernel run :meth:`~.fuse.Kernel.by_rows`: which per-leaf inputs it reads per
    element (per column, or leaf-shaped)."""
    return tuple(k in ("c", "v") for k in kinds[len(kinds) - n_per_leaf :])


def _broadcast_groups(ins: list, keys: list, n_per_leaf: int, plain: bool, groups: dict) -> None:
    """The leaves into ``groups`` for a stage whose per-leaf values include vectors (the
    factored second moment's row and column factors, :func:`_single_values` false): a leaf
    whose values are all single values as :func:`_leaf_groups` groups it; one with a vector
    value, in plain contiguous tensors on one device where kernels run, by its inputs' kinds
    (``_operand_kind``), run by rows (:meth:`.fuse.Kernel.by_rows`: a value per row is a
    per-leaf value of each row, a value per column a leaf-shaped input of each row; on CUDA
    :meth:`.fuse_triton.TritonKernel.by_rows`, each per-leaf input read per element through an
    index per leaf); anything else leaf by leaf in torch."""
    first = len(ins) - n_per_leaf
    single = []
    for j, leaf in enumerate(ins[0]):
        kinds = tuple(_operand_kind(lst[j], leaf.shape) for lst in ins[first:])
        if all(k == "s" for k in kinds):
            single.append(j)
            continue
        # (an absent state leaf, None: a restricted part's outside its leaves, left out of
        # the kernel's inputs as the other groups leave it)
        absent = tuple(k for k in range(first) if ins[k][j] is None)
        leaf_ins = [lst[j] for k, lst in enumerate(ins) if k not in absent]
        dev = leaf.device
        fast = (
            plain
            and None not in kinds
            and _kernel_device(leaf)
            and all(
                type(x) is torch.Tensor
                and x.device == dev
                and x.is_contiguous()
                and not x.requires_grad
                for x in leaf_ins
            )
        )
        sig: tuple = (
            (("v",) * (first - len(absent)) + kinds, tuple(x.dtype for x in leaf_ins), keys[j])
            if fast
            else (False, None, keys[j])
        )
        groups.setdefault((*sig, absent), []).append(j)
    if single:
        _leaf_groups(ins, keys, single, plain, groups)


def _by_key(ins: list, keys: list) -> dict:
    """``{(key, absent inputs): leaf indices}``: the leaves grouped by their static key and by
    which of their inputs are ``None`` (a state leaf outside a ``masked`` / ``partition``
    part's leaves), by C loops over whole lists where they can."""
    none = itertools.repeat(None)
    holes = [k for k, lst in enumerate(ins) if any(map(operator.is_, lst, none))]
    sigs = list(zip(keys, *(map(operator.is_, ins[k], none) for k in holes)))
    if len(set(sigs)) == 1:  # (one group: a C loop decides it)
        sg = sigs[0]
        return {(sg[0], tuple(k for k, a in zip(holes, sg[1:]) if a)): list(range(len(sigs)))}
    by: dict = {}
    for j, sg in enumerate(sigs):
        hit = by.get(sg)
        if hit is None:
            by[sg] = [j]
        else:
            hit.append(j)
    return {(sg[0], tuple(k for k, a in zip(holes, sg[1:]) if a)): idx for sg, idx in by.items()}


def _kernel_device(x) -> bool:
    """Whether generated kernels run on ``x``'s device: CPU (C), CUDA with Triton."""
    if x.is_cpu:
        return True
    from . import fuse_triton

    return fuse_triton.available(x.device)


def _uniform(ins: list, keys: list):
    """The dtypes of the inputs' lists when every leaf can run in one kernel call (plain
    contiguous tensors without autograd on one device where kernels run, one dtype per list,
    one key), else ``None``: whole-list checks in C loops (this runs for every stage of every
    step)."""
    if len(keys) > 1 and keys.count(keys[0]) != len(keys):  # (a C loop of ==, as a != loop)
        return None
    return _dtypes_of(ins)


def _dtypes_of(ins: list):
    """The dtypes of the inputs' lists when every leaf can run in one kernel call whatever
    its key (:func:`_uniform`'s checks but the key's), else ``None``."""
    many = len(ins[0]) > 1
    if many:
        hit = _DTYPES_BY_METADATA.get(len(ins), ins)
        if hit is not None:
            return hit
    x0 = ins[0][0]
    if type(x0) is not torch.Tensor or not _kernel_device(x0):
        return None
    cpu = x0.is_cpu
    dev = x0.device
    if not many:  # (one leaf: per-leaf steps call this once per leaf)
        dtypes = []
        for lst in ins:
            x = lst[0]
            if type(x) is not torch.Tensor or x.requires_grad:
                return None
            if not (x.is_cpu if cpu else x.device == dev) or not x.is_contiguous():
                return None
            dtypes.append(x.dtype)
        return tuple(dtypes)
    # (every list's types first: a later list holding an absent leaf, None, fails the call
    # before the earlier lists' other checks are made)
    if any(set(map(type, lst)) != _TENSOR for lst in ins):
        return None
    dtypes = []
    for lst in ins:
        ds = set(map(DTYPE, lst))
        if (
            len(ds) != 1
            or not all(map(_CONTIGUOUS, lst))
            or not on_device(lst, dev)
            or any(map(_REQUIRES_GRAD, lst))
        ):
            return None
        dtypes.append(ds.pop())
    out = tuple(dtypes)
    _DTYPES_BY_METADATA.put(len(ins), ins, out)
    return out


# (the answers of _dtypes_of for lists with these exact metadata: one C++ check per list
# where the checks above read five attributes of every tensor; see .metadata)
_DTYPES_BY_METADATA = Memo(per_key=8)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_COMPLEX = torch.Tensor.is_complex


def _without(fn, absent: tuple, n_in: int, dst: list):
    """``fn`` on the inputs not in ``absent`` (their positions get ``None``), returning the
    results whose donated input is present (a part passes an absent state leaf through, as
    ``None``): ``(function, inputs kept, results kept)``, cached."""
    key = (fn, absent)
    hit = _without_cache.get(key)
    if hit is not None:
        return hit
    in_keep = [i for i in range(n_in) if i not in absent]
    out_keep = [r for r, d in enumerate(dst) if d not in absent]
    dropped = [r for r, d in enumerate(dst) if d in absent]

    def f(ins, scalars):
        full: list = [None] * n_in
        for i, x in zip(in_keep, ins):
            full[i] = x
        res = fn(tuple(full), scalars)
        if any(res[r] is not None for r in dropped):
            raise ValueError("a part wrote a state leaf that is absent (None) for this leaf")
        return tuple(res[r] for r in out_keep)

    hit = _without_cache[key] = (f, in_keep, out_keep)
    return hit


_without_cache: dict = {}


def _group_kinds(take, g):
    """``take`` with the pool's kinds named per group of leaves (the groups' results are held
    together)."""
    if take is None or g == 0:
        return take
    return lambda kind, like: take(f"{kind}/{g}", like)


def _recording() -> bool:
    from ..autograd import is_differentiable

    return is_differentiable() or _functional()


_fn_cache: dict = {}


def _function(stage, counts, key):
    if key is None:
        key = (None,) * len(stage.parts)
    if torch.compiler.is_compiling():
        return stage.function(counts, key)
    k = (id(stage), counts, tuple((type(x), x) for x in key))  # (False and 0 hash alike)
    hit = _fn_cache.get(k)
    if hit is None or hit[0] is not stage:
        hit = _fn_cache[k] = (stage, stage.function(counts, key))
    return hit[1]


def _run_kernel(
    kernel,
    ins,
    idx,
    outs,
    sc,
    apply,
    take,
    dst,
    dtypes,
    sums=None,
    rows=None,
    strided=False,
    u_out=None,
) -> bool:
    """One kernel call on the leaves ``idx``; ``False`` where its results cannot be written
    as asked. ``dtypes``: the group's, one per input list (every leaf of the group has it).
    A kernel that sums its updates' squares
    (``kernel.sumsq``) appends their sums to ``sums``, then those of the input it sums too
    (``kernel.sum_in``). ``rows``: the inputs' kinds, for a call
    by rows (:meth:`.fuse.Kernel.by_rows`). ``strided``: leaves in one memory order that is
    not contiguous (:data:`STRIDED`): fresh results are made in it. ``u_out``: where a donated
    call's updates go (every leaf's buffer; ``None``: over the updates). Under a dispatch
    mode its results are made outside it, plain (:func:`.native.outside_dispatch_modes`)."""
    outside = native.outside_dispatch_modes()
    if outside is not None:
        with outside:
            return _run_kernel(
                kernel, ins, idx, outs, sc, apply, take, dst, dtypes, sums, rows, strided, u_out
            )
    whole = len(idx) == len(ins[0])  # (every leaf: the common case, lists as they are)
    cols = [list(lst) for lst in ins] if whole else [[lst[j] for j in idx] for lst in ins]
    n_out = len(outs)
    made = None
    if apply != "donate" and not strided and type(kernel) is fuse.ForeachKernel:
        # (a sum into new tensors torch's foreach operation makes: no buffers taken first)
        made = kernel.results(cols)
    if made is not None:
        res = made
    elif apply == "donate":
        # each result over its input (the updates into ``u_out`` where given); one of another
        # dtype (a stage whose updates widen: bfloat16 gradients into float32 sums) into
        # fresh buffers
        res = [
            [_fresh(x, d) for x in cols[0]]
            if dtypes[dst[r]] != d
            else cols[dst[r]]
            if dst[r] or u_out is None
            else (list(u_out) if whole else [u_out[j] for j in idx])
            for r, d in enumerate(kernel.out_dtypes)
        ]
    elif strided:  # (in the leaves' memory order: the pool's, where the dtype is theirs)
        res = [
            take(f"stage{r}", cols[0])
            if take is not None and dtypes[0] == d
            else [_fresh(x, d) for x in cols[0]]
            for r, d in enumerate(kernel.out_dtypes)
        ]
    else:
        res = []
        for r, d in enumerate(kernel.out_dtypes):
            # (the updates stand for the results' shapes where their dtype is the result's)
            like = (
                cols[0]
                if dtypes[0] == d
                else [torch.empty((), dtype=d, device=x.device).expand(x.shape) for x in cols[0]]
            )
            res.append(take(f"stage{r}", like) if take is not None else empties_like(like))
    # (fresh results: streamed where large; a caller's buffers that are the inputs (apply_part)
    # are not: streaming is right there too, the block is read before it is written, but slower)
    fresh = apply != "donate" and not any(x[0] is y[0] for x in res for y in cols)
    squares = torch.empty(len(idx) * kernel.n_sums, dtype=torch.float64) if kernel.sumsq else None
    if made is not None:
        pass  # (written already)
    elif rows is not None:
        if kernel.by_rows(cols, res, sc, rows, fresh=fresh) is False:  # (as below)
            return False
    elif squares is None:
        if kernel(cols, res, sc, fresh=fresh) is False:  # (a Triton kernel that did not compile)
            return False
    else:
        kernel(cols, res, sc, fresh=fresh, sums=squares)
        if sums is not None:
            sums.extend(_split_sums(squares, len(idx)))
    for r in range(n_out):
        if whole:
            outs[r][:] = res[r]
        else:
            for j, x in zip(idx, res[r]):
                outs[r][j] = x
    return True


def _fresh(like, dtype=None):
    """A new tensor of ``like``'s shape and memory order (contiguous unless ``like`` is a
    permutation of a contiguous layout), of ``dtype`` (default ``like``'s)."""
    return torch.empty_like(like, dtype=like.dtype if dtype is None else dtype)


def apply_part(
    part: Elementwise | tuple,
    u: list,
    fields: Sequence,
    scalars: Sequence,
    out=None,
    *,
    params: Sequence | None = None,
    keys: Sequence | None = None,
    apply: bool = False,
):
    """``part`` on the leaves ``u`` (a list of updates) and ``fields`` (per state field, a list
    of leaves), ``scalars`` as its prologue gives them (a per-leaf one, at a position of
    ``part.leaf_scalars``: a list over ``u``), through the kernels the engine runs for it: the
    results ``[u, *fields]`` (lists); with ``apply``, ``[params + u, *fields]`` (the part and
    ``apply_updates`` in one pass, as the last stage of ``ft.step``). ``out``: per result, a
    list of buffers to write into (``None`` entries: fresh; a buffer may be the input it
    replaces: the parameters' for ``apply``), or ``None``. ``params``: the parameters of ``u``
    (a part that ``needs_params``, or ``apply``); ``keys``: the leaves' static keys (``None``:
    ``None`` each). ``part`` may be a tuple of consecutive parts, one stage: ``scalars`` then
    holds each part's, ``fields`` theirs in order and ``keys`` a tuple per leaf. For
    algorithms that run a primitive's math inside their own update (8-bit Adam between its
    dequantisation and requantisation, per-leaf steps that finish each leaf in cache)."""
    parts, scalars, counts, per_leaf, keys = _parts_of(part, scalars, keys)
    stage = _stage_of(parts, apply)
    n = len(u)
    fields = [list(f) for f in fields]
    take = None
    mode = None
    first = params if apply else u
    if out is not None and all(
        b is x for bufs, ins in zip(out, [first, *fields]) for b, x in zip(bufs, ins)
    ):
        mode = "donate"  # every result over its input, as a donated step writes them
    elif out is not None:

        def take(kind, like):
            if "/" in kind:  # (a second group of leaves: fresh, copied below)
                return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in like]
            bufs = out[int(kind[len("stage") :])]
            return [
                b
                if b is not None
                and b.dtype == x.dtype
                and b.shape == x.shape
                and b.device == x.device
                and b.is_contiguous()
                else torch.empty(x.shape, dtype=x.dtype, device=x.device)
                for b, x in zip(bufs, like)
            ]

    p = list(params) if params is not None and stage.params else None
    res = _execute(
        stage,
        counts,
        list(u),
        p,
        fields + per_leaf,
        scalars,
        [None] * n if keys is None else list(keys),
        mode,
        take,
    )
    if out is None:
        return res
    final = []
    for lst, bufs in zip(res, out):
        row = []
        for x, b in zip(lst, bufs):
            if b is not None and x is not b and x.dtype == b.dtype and x.shape == b.shape:
                b.copy_(x)
                x = b
            row.append(x)
        final.append(row)
    return final


def leaf_runner(part: Elementwise | tuple, scalars: Sequence, *, apply: bool = False) -> Callable:
    """For a per-leaf step that finishes each leaf in cache: ``run(ins, dst, key=None)``,
    ``part`` (then ``apply_updates`` with ``apply``) on ONE leaf, written into ``dst``.
    ``ins`` are the leaf's inputs in the stage's order (the update, the parameter where the
    stage reads it, the fields, the per-leaf scalars: 0-dim tensors), ``dst`` a buffer per
    result (the new parameter or update, the new fields; a buffer may be its input),
    ``scalars`` the part's shared scalars, fixed for the runner (for a tuple of consecutive
    parts, as :func:`apply_part` takes them: a sequence per part, ``key`` a tuple over the
    parts). ``run`` calls the stage's generated kernel directly, without the per-call work of
    the general path (about 30 us a call); where the kernel cannot take the leaf (a tensor
    that is not a plain contiguous CPU tensor, a dtype the generator does not write, a result
    of another dtype or shape) or none runs here at all (autograd recording,
    ``torch.compile``, a ``torch.func`` transform, the kernels off, a scalar the kernels
    cannot read) it runs :func:`apply_part` on the leaf: the same definitions either way."""
    one = isinstance(part, Elementwise)
    parts: tuple = (part,) if isinstance(part, Elementwise) else part
    per_part = (scalars,) if one else scalars
    stage = _stage_of(parts, apply)
    n_fields = sum(p.n_fields for p in parts)

    def general(ins: Sequence, dst: Sequence, key=None) -> None:
        k = 2 if stage.params else 1
        own = iter(ins[k + n_fields :])  # (the per-leaf scalars, part by part)
        merged = [
            _merged(tuple(shared), tuple([next(own)] for _ in p.leaf_scalars), p.leaf_scalars)
            for p, shared in zip(parts, per_part)
        ]
        apply_part(
            part,
            [ins[0]],
            [[x] for x in ins[k : k + n_fields]],
            merged[0] if one else merged,
            out=[[d] for d in dst],
            params=[ins[1]] if stage.params else None,
            keys=None if key is None else [key],
            apply=apply,
        )

    sc = None
    if fuse.ENABLED and not _recording():
        sc = fuse.scalar_pointers([x for mine in per_part for x in mine])
    if sc is None:
        return general
    counts = tuple(len(x) for x in per_part)
    kernels: dict = {}

    def run(ins: Sequence, dst: Sequence, key=None) -> None:
        # (plain contiguous CPU tensors without autograd, as a C kernel call takes them; the
        # per-leaf steps' leaves elsewhere run in torch)
        if not ins[0].is_cpu or _uniform([[x] for x in (*ins, *dst)], [None]) is None:
            return general(ins, dst, key)
        sig = (key, tuple(x.dtype for x in ins))
        kernel = kernels.get(sig, _NO_KERNEL)
        if kernel is _NO_KERNEL:
            fn = _function(stage, counts, None if key is None else (key,) if one else key)
            kernel = kernels[sig] = fuse.kernel_for(fn, sig[1], sc[1], stage.n_per_leaf)
        shape = ins[0].shape
        if kernel is None or any(
            d.dtype != t or d.shape != shape for d, t in zip(dst, kernel.out_dtypes)
        ):
            return general(ins, dst, key)
        fresh = not any(d is x for d in dst for x in ins)
        kernel([[x] for x in ins], [[d] for d in dst], sc[0], fresh=fresh)
        return None

    return run


_NO_KERNEL = object()


def context_key(name: str) -> str:
    """A key of the run context of its own (a string: dynamo compares dict keys by value),
    for a wrapper that publishes a value there for the parts it wraps."""
    return f"{name}:{next(_CONTEXT_KEYS)}"


_CONTEXT_KEYS = itertools.count()


def call_prologue(part: Elementwise, state, b, ctx):
    """``part``'s prologue, with the run context where it takes one."""
    if part.context:
        return part.prologue(state, b, ctx)
    return part.prologue(state, b)


def prologues_of(parts: Sequence, states: Sequence, b) -> tuple[list, Callable] | None:
    """For a per-leaf step that runs a chain's parts itself (its tail, through
    :func:`leaf_runner`): the parts' prologues on their ``states`` and the batch ``b`` --
    ``(scalars per part, new_states)``, ``new_states()`` the parts' new states (a tuple, in
    order), as the chain's step finishes them. ``None`` where a prologue raises ``ValueError``
    (a state that is not the part's): the per-leaf step then declines, and the chain's own
    step raises the error."""
    try:
        prologues = [part.prologue(x, b) for part, x in zip(parts, states, strict=True)]
    except ValueError:
        return None
    return [sc for sc, _ in prologues], lambda: tuple(done(()) for _, done in prologues)


def select_state(ok: torch.Tensor, new, old, fields):
    """``torch.where(ok, new, old)`` on the leaves of a part's new state that are not its new
    field leaves (``fields``: the trees its leaf function wrote, already selected there):
    counters, norms, 0-dim tensors (DTensors on their local shards)."""

    def written(x) -> bool:  # (a field tree: taken whole, not descended into)
        return any(x is t for t in fields)

    pairs: list = []  # (the leaves to select, their local tensors: one operator for all)

    def pair(n, o):
        if isinstance(n, torch.Tensor) and n is not o:
            pairs.append((to_local(n), to_local(o)))
        return n

    optree.tree_map(pair, new, old, is_leaf=written, none_is_leaf=True)
    if not pairs:
        return new
    picked = iter(_select(ok.to(pairs[0][0].device), *(x for p in pairs for x in p)))

    def pick(n, o):
        if not isinstance(n, torch.Tensor) or n is o:
            return n
        return wrap_like(next(picked), n)

    return optree.tree_map(pick, new, old, is_leaf=written, none_is_leaf=True)


@scalar_program
def _select(ok: torch.Tensor, *pairs: torch.Tensor) -> tuple:
    """``torch.where(ok, new, old)`` for each ``new, old`` of ``pairs``."""
    return tuple(torch.where(ok, pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))


def guarded(part: Elementwise, key: str, wrapper: str) -> Elementwise:
    """``part`` under a flag another part of the run published in the run context under
    ``key`` (a 0-dim bool tensor, one more scalar of the leaf): its new fields are
    ``torch.where(ok, new, old)`` and its other new state is selected likewise
    (:func:`select_state`), so that where the flag is false the part leaves its state as it
    was. ``apply_if_finite`` guards its inner parts by the all-finite flag, ``multi_steps``
    (compiled) by whether the micro-step is the cycle's last; ``wrapper`` names it."""

    def prologue(state, b, ctx):
        ok = ctx[key]
        # (its reductions' values are used only where the flag holds: b.needed; so are its
        # scalar programs' results, gated by it under torch.compile)
        sc, fin = gated(ok, call_prologue, part, state, b.needed_if(ok) if part.reduces else b, ctx)
        return (*sc, ok), lambda trees: select_state(ok, gated(ok, fin, trees), state, trees)

    def leaf(u, p, s, h, k):
        ok = h[-1] != 0
        u, new = part.leaf(u, p, s, h[:-1], k)
        # (a field absent at this leaf, None: a restricted part's leaf outside its leaves)
        return u, tuple(n if o is None else torch.where(ok, n, o) for n, o in zip(new, s))

    return Elementwise(
        f"{wrapper}({part.name})",
        leaf,
        prologue,
        part.fields,
        part.n_fields,
        needs_params=part.needs_params,
        static=part.static,
        reduces=part.reduces,
        context=True,
        guard=HOLDS,
        leaf_scalars=part.leaf_scalars,
        reads_sum_squares=part.reads_sum_squares,
        reads_params_sum_squares=part.reads_params_sum_squares,
        restrict=part.restrict,
        flags=(key, *part.flags),
        sums_through=part.sums_through,
        starts=part.starts,
    )


def zeroed_unless(key: str, wrapper: str) -> Elementwise:
    """The last part of a wrapper whose parts run under a flag in the run context (see
    :func:`guarded`): the updates where the flag under ``key`` is true, zeros elsewhere
    (``apply_if_finite``: a non-finite step's; ``multi_steps``, compiled: a non-final
    micro-step's)."""

    def prologue(state, b, ctx):
        return (ctx[key],), lambda trees: None

    def leaf(u, p, s, h, k):
        return torch.where(h[0] != 0, u, torch.zeros_like(u)), ()

    return Elementwise(wrapper, leaf, prologue, no_fields, 0, context=True, guard=ZEROES)


def no_fields(state) -> tuple:
    """``fields`` of a part whose state holds no params-shaped tree."""
    return ()


def _zeros_leaf(u, p, s, h, k):
    """The update: zeros (a chosen Fusable's ``zero_updates``, written out)."""
    return torch.zeros_like(u), ()


def _zeros_prologue(state, b):
    return (), lambda trees: None


_ZEROS = Elementwise("zero updates", _zeros_leaf, _zeros_prologue, no_fields, 0)


def zeros_written(fus: Fusable) -> Fusable:
    """``fus`` where its updates are zeros (``zero_updates``: ``multi_steps``' non-final
    micro-step) as a Fusable that writes them: its parts, then one whose update is zeros
    (``torch.zeros_like``), so that it composes with others (in a chain, restricted to some
    leaves by ``partition`` / ``masked``: the leaves beside it take other updates, and every
    parameter gets ``p + u``). ``fus`` itself otherwise. One object per ``fus``."""
    if not fus.zero_updates:
        return fus
    hit = fus.__dict__.get("_zeros_written")
    if hit is None:
        n = len(fus.parts)
        hit = Fusable(
            (*fus.parts, _ZEROS),
            lambda state: [*fus.split(state), None],
            lambda states: fus.join(states[:n]),
        )
        object.__setattr__(fus, "_zeros_written", hit)  # (frozen: a memo, not a field)
    return hit


_DERIVED_SIZE = 64  # (parts tuples remembered per derivation)


def derived_parts(make: Callable[[tuple], tuple]) -> Callable[[tuple], tuple]:
    """``make(parts)``, remembered per ``parts`` tuple (bounded): the parts a combinator
    derives from its transform's (restricted to some leaves, guarded by a flag) made once,
    since the engine's caches of stages and kernels key on the part objects, and a Switch's
    choice (``inject_hyperparams``') is a new Fusable per call over the same parts."""
    memo: dict = {}

    def derived(parts: tuple) -> tuple:
        hit = memo.get(parts)
        if hit is None:
            if len(memo) >= _DERIVED_SIZE:
                memo.clear()
            hit = memo[parts] = make(parts)
        return hit

    return derived


def single(spec: Elementwise) -> Fusable:
    """The :class:`Fusable` of one part."""
    return Fusable((spec,), _one, _first)


def _one(state):
    return [state]


def _first(states):
    return states[0]
