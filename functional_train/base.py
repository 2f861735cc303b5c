"""GradientTransformation and the combinators that compose transforms."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from .spec import attach_spec, transform_spec
from .tree import PyTree

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "named_chain",
    "passes_unreduced",
    "declare",
    "check_state",
]


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> PyTree: ...


class UpdateFn(Protocol):
    def __call__(
        self,
        updates: PyTree,
        state: PyTree,
        params: PyTree | None = None,
        *,
        mesh: Any = None,
        **extra: Any,
    ) -> tuple[PyTree, PyTree]: ...


class GradientTransformation(NamedTuple):
    """A pure gradient transformation (optax semantics).

    ``init(params) -> state`` builds the state (a pytree of NamedTuples of tensors).
    ``update(updates, state, params=None, *, mesh=None, **extra) -> (updates, state)`` transforms
    the updates (gradients on the way in) and returns the new state; no argument is modified.
    ``mesh`` is a :class:`functional_train.Mesh` or ``None``; extra keyword arguments are passed
    down by combinators and ignored by transforms that don't use them.
    """

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def check_state(state: Any, cls: type, name: str) -> None:
    """Raise the error of a transform ``name`` given a state that is not its ``cls`` (a state
    from another transform's ``init``).

    Raises:
        ValueError: naming the transform, the state class expected and the one given.
    """
    if not isinstance(state, cls):
        raise ValueError(
            f"{name}: expected the {cls.__name__} from {name}.init, got {type(state).__name__}"
        )


def declare(update_fn, *, unreduced: bool = True, view: bool = False):
    """Declare what an ``update`` function accepts, for the combinators (returns ``update_fn``;
    recorded in its :class:`~functional_train.spec.TransformSpec`).

    Args:
        update_fn: the transform's update function.
        unreduced: it accepts gradients still unreduced over ``Mesh.data_axis`` or ``Partial``
            (it reduces what it needs itself, through :func:`functional_train.sharding.prepare`).
            An undeclared transform is foreign: ``chain``, ``named_chain`` and ``multi_steps``
            reduce unreduced gradients before calling it, so it sees the values it would see in
            one process.
        view: it also accepts the :class:`~functional_train.sharding.Prepared` view a chain
            hands along as ``updates`` (it calls ``prepare`` first, reads values only from
            ``locals`` / ``params``, and returns ``rebuild(...)`` / ``rebuild_active(...)``).
    """
    return attach_spec(
        update_fn, accepts_unreduced=bool(unreduced or view), accepts_view=bool(view)
    )


def accepts_unreduced(tx: GradientTransformation) -> bool:
    """Whether ``tx`` declared that it reduces unreduced gradients itself (see :func:`declare`)."""
    return transform_spec(tx).accepts_unreduced


def accepts_view(tx: GradientTransformation) -> bool:
    """Whether ``tx`` declared that it accepts a chain's prepared view (see :func:`declare`)."""
    return transform_spec(tx).accepts_view


def call_reduced(tx: GradientTransformation, updates, state, params, mesh, extra):
    """``tx.update(...)``, with unreduced gradients reduced first when ``tx`` is foreign (has not
    declared that it accepts them). Returns ``(updates, state, mesh after the call)``."""
    from .engine.view import Prepared, prepare

    if isinstance(updates, Prepared) and not accepts_view(tx):
        updates = updates.tree()
    elif not accepts_unreduced(tx) and not isinstance(updates, Prepared):
        b = prepare(updates, params, mesh, name="chain")
        if not b.plan.trivial:
            updates = b.tree()
        mesh = b.mesh
    updates, state = tx.update(updates, state, params, mesh=mesh, **extra)
    if mesh is not None and not passes_unreduced(tx):
        mesh = mesh.reduced()
    return updates, state, mesh


def passes_unreduced(tx: GradientTransformation) -> bool:
    """Whether ``tx`` returns gradients still unreduced over the data axis (identity does).

    Every other transform reduces unreduced gradients before it uses them and returns reduced
    updates, so a combinator passes the *reduced* mesh descriptor to what follows it.
    """
    return transform_spec(tx).passes_unreduced


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (no state, no communication)."""

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        del params, mesh, extra
        return updates, state

    attach_spec(update_fn, passes_unreduced=True)
    # for the engine: no parts (a chain holding it fuses as the chain without it)
    from .engine import elementwise as E

    E.register(update_fn, E.Fusable((), _no_states, _empty_state))
    return GradientTransformation(init_fn, declare(update_fn, view=True))


def _no_states(state) -> list:
    return []


def _empty_state(states) -> EmptyState:
    return EmptyState()


def _check_txs(txs, where: str) -> None:
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"{where}: argument {i} must be a GradientTransformation, got {type(tx).__name__}"
            )


def run_sequence(txs, states, updates, params, mesh, extra):
    """Run ``txs`` in sequence on local shards: the first transform that accepts a view gets the
    prepared view (unreduced gradients reduced once, local shards taken once), which travels
    from primitive to primitive; DTensors are rebuilt once, for what the caller receives, or
    before a transform that does not accept views. Foreign transforms get reduced trees."""
    from .engine import elementwise as E
    from .engine.view import Prepared, prepare

    given_view = isinstance(updates, Prepared)
    new_states: list = []
    fusables = [E.fusable_of(tx) for tx in txs]
    i = 0
    while i < len(txs):
        j = i
        while j < len(txs) and fusables[j] is not None:
            j += 1
        # consecutive elementwise transforms: one fused pass per stage (identities alone, no
        # parts, pass their updates through as they are, unreduced ones too)
        fus = E.chained(fusables[i:j]) if j - i >= 2 else None
        if fus is not None and fus.parts:
            if not isinstance(updates, Prepared):
                updates = prepare(
                    updates, params, mesh, need_params=fus.needs_params, name="chain", view=True
                )
            elif fus.needs_params and updates.params is None:
                name = next(p.name for p in fus.parts if p.needs_params)
                raise ValueError(f"{name} needs params: call update(updates, state, params)")
            mesh = updates.mesh
            updates, st = E.run(fus, updates, tuple(states[i:j]), params)
            new_states.extend(st)
            i = j
            continue
        tx, s = txs[i], states[i]
        if (
            accepts_view(tx)
            and not passes_unreduced(tx)
            and len(txs) > 1
            and not isinstance(updates, Prepared)
        ):
            updates = prepare(updates, params, mesh, name="chain", view=True)
            mesh = updates.mesh
        updates, s, mesh = call_reduced(tx, updates, s, params, mesh, extra)
        new_states.append(s)
        i += 1
    if isinstance(updates, Prepared) and not given_view:
        updates = updates.tree()
    return updates, new_states


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in sequence; the state is a tuple of their states.

    Unreduced gradients (``Mesh.data_axis``, ``Partial`` placements) are reduced once, by the
    first transform that needs their value; later transforms receive the reduced descriptor.

    Raises:
        TypeError: an argument is not a GradientTransformation.
        ValueError: at update, ``state`` is not a tuple of ``len(transforms)`` states.
    """
    _check_txs(transforms, "chain")

    def init_fn(params):
        return tuple(tx.init(params) for tx in transforms)

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if (
            not isinstance(state, tuple)
            or len(state) != len(transforms)
            or hasattr(state, "_fields")
        ):
            got = (
                f"a tuple of {len(state)}"
                if isinstance(state, tuple) and not hasattr(state, "_fields")
                else f"a {type(state).__name__}"
            )
            raise ValueError(
                f"chain: expected a tuple of {len(transforms)} states from chain.init, got {got}"
            )
        chosen = run_fused(switch, updates, state, params, mesh, "chain")
        if chosen is not None:
            return chosen
        updates, new_states = run_sequence(transforms, state, updates, params, mesh, extra)
        return updates, tuple(new_states)

    attach_spec(
        update_fn,
        passes_unreduced=all(passes_unreduced(t) for t in transforms),
        parts=tuple(transforms),
    )
    switch = _register_chained(update_fn, transforms)
    return GradientTransformation(init_fn, declare(update_fn, view=True))


def run_fused(spec, updates, state, params, mesh, name: str) -> tuple | None:
    """An ``update`` by its fused form, as ``(updates, state)``, as ``ft.step`` runs it
    without the apply: ``spec`` a Fusable (a wrapper around a fusable transform), run as it
    is, or a Switch (a chain holding ``inject_hyperparams``, ``multi_steps`` or a combinator
    or wrapper around one), run by its choice for these inputs; the updates come back as
    they were given (a tree, or the view a chain hands along). ``None`` where ``spec`` is
    ``None`` or a Switch chooses none, and for a Switch given updates as a view (inside a
    wrapper: it chooses on trees) or while the library records for autograd: the caller's
    general path then runs (the transforms one by one, a pass each). Extra arguments are not
    read: a fused form's parts are the library's definitions and the user's ``elementwise``
    ones, which read none (``ft.step``'s fused path does not pass them either)."""
    if spec is None:
        return None
    from .autograd import is_differentiable
    from .engine import elementwise as E
    from .engine.view import Prepared, prepare

    given_view = isinstance(updates, Prepared)
    fus = spec
    if isinstance(spec, E.Switch):
        if given_view or is_differentiable():
            return None
        fus = spec.choose(updates, state, params, mesh)
        if fus is None or (params is None and fus.needs_params):
            return None  # (the general path: the transform that needs params raises)
    b = prepare(updates, params, mesh, need_params=fus.needs_params, name=name, view=True)
    new_updates, new_state = E.run(fus, b, state, params)
    if isinstance(new_updates, Prepared) and not given_view:
        new_updates = new_updates.tree()
    return new_updates, new_state


def _register_chained(update_fn, transforms, names=None) -> Any:
    """Register ``chain``'s fusable spec when every transform in it is fusable (``names``: a
    ``named_chain``'s, whose state is a dict of its transforms' states by name); its Switch
    where some of them choose their fused form per call. Returns the Switch, or ``None``."""
    from .engine import elementwise as E

    fus = [f for f in map(E.fusable_of, transforms) if f is not None]
    if not fus or len(fus) != len(transforms):
        # transforms whose fused form is chosen per call (inject_hyperparams): the chain's
        # too (not multi_steps': its zero updates cannot be chained)
        specs = [E.switch_of(tx) or E.fusable_of(tx) for tx in transforms]
        if transforms and all(x is not None for x in specs):
            sw = E.chained_switch(specs)
            if names is not None:
                sw = _named_switch(sw, names)
            E.register(update_fn, sw)
            return sw
        return None
    inner = E.chained(fus)
    if names is None:
        E.register(update_fn, inner)
        return None
    E.register(update_fn, E.restated(inner, *_named_states(names)))
    return None


def _named_states(names) -> tuple:
    """``(get, put)`` between ``named_chain``'s state (a dict of its transforms' states by
    name) and ``chain``'s (their tuple), for :func:`~.engine.elementwise.restated`."""

    def get(state):
        if not isinstance(state, dict) or list(state) != names:
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"named_chain: expected a state dict with keys {names}, got {got}")
        return tuple(state[n] for n in names)

    def put(states):
        return dict(zip(names, states))

    return get, put


def _named_switch(sw, names):
    """A chain's Switch for ``named_chain``'s state (a dict of its transforms' states)."""
    from .engine import elementwise as E

    get, put = _named_states(names)

    def choose(updates, state, params, mesh):
        if not isinstance(state, dict) or list(state) != names:
            return None  # (named_chain's own update raises)
        fus = sw.choose(updates, get(state), params, mesh)
        return None if fus is None else E.restated(fus, get, put)

    return E.Switch(choose)


def elementwise_transform(spec, init_fn: InitFn) -> GradientTransformation:
    """The ``GradientTransformation`` of an elementwise ``spec`` (an
    :class:`~functional_train.engine.elementwise.Elementwise`): ``init_fn`` builds its state,
    ``update`` prepares the view and runs the spec (one fused pass); ``spec`` is registered so
    that ``chain`` and ``ft.step`` fuse it with its neighbours."""
    from .engine import elementwise as E
    from .engine.view import prepare

    fusable = E.single(spec)

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        del extra
        b = prepare(updates, params, mesh, need_params=spec.needs_params, name=spec.name)
        return E.run(fusable, b, state, params)

    E.register(update_fn, spec)
    return GradientTransformation(init_fn, declare(update_fn, view=True))


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, with a name per transform; the state is a dict ``name -> state``.

    Raises:
        TypeError: an argument is not a ``(str, GradientTransformation)`` pair.
        ValueError: duplicate names; at update, a state whose keys are not the names.
    """
    names = []
    for i, item in enumerate(transforms):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"named_chain: argument {i} must be a (name, transform) pair")
        names.append(item[0])
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: duplicate names in {names}")
    txs = [t for _, t in transforms]
    _check_txs(txs, "named_chain")

    def init_fn(params):
        return {n: t.init(params) for n, t in transforms}

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, dict) or list(state) != names:
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"named_chain: expected a state dict with keys {names}, got {got}")
        chosen = run_fused(switch, updates, state, params, mesh, "named_chain")
        if chosen is not None:
            return chosen
        updates, new_states = run_sequence(
            txs, [state[n] for n in names], updates, params, mesh, extra
        )
        return updates, dict(zip(names, new_states))

    attach_spec(update_fn, passes_unreduced=all(passes_unreduced(t) for t in txs))
    switch = _register_chained(update_fn, txs, names)
    return GradientTransformation(init_fn, declare(update_fn, view=True))
