"""GradientTransformation and the combinators that compose transforms."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "named_chain",
    "passes_unreduced",
]

PyTree = Any


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> PyTree: ...


class UpdateFn(Protocol):
    def __call__(self, updates: PyTree, state: PyTree, params: Optional[PyTree] = None, *,
                 mesh: Any = None, **extra: Any) -> tuple[PyTree, PyTree]: ...


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


def passes_unreduced(tx: GradientTransformation) -> bool:
    """Whether ``tx`` returns gradients still unreduced over the data axis (identity does).

    Every other transform reduces unreduced gradients before it uses them and returns reduced
    updates, so a combinator passes the *reduced* mesh descriptor to what follows it.
    """
    return bool(getattr(tx.update, "passes_unreduced", False))


def identity() -> GradientTransformation:
    """The transform that returns its updates unchanged (no state, no communication)."""

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        del params, mesh, extra
        return updates, state

    update_fn.passes_unreduced = True  # type: ignore[attr-defined]
    return GradientTransformation(init_fn, update_fn)


def _check_txs(txs, where: str) -> None:
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"{where}: argument {i} must be a GradientTransformation, "
                            f"got {type(tx).__name__}")


def _run_sequence(txs, states, updates, params, mesh, extra):
    new_states = []
    for tx, s in zip(txs, states):
        updates, s = tx.update(updates, s, params, mesh=mesh, **extra)
        new_states.append(s)
        if mesh is not None and not passes_unreduced(tx):
            mesh = mesh.reduced()
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
        if not isinstance(state, tuple) or len(state) != len(transforms) or hasattr(state, "_fields"):
            got = (f"a tuple of {len(state)}" if isinstance(state, tuple) and not hasattr(state, "_fields")
                   else f"a {type(state).__name__}")
            raise ValueError(f"chain: expected a tuple of {len(transforms)} states from chain.init, "
                             f"got {got}")
        updates, new_states = _run_sequence(transforms, state, updates, params, mesh, extra)
        return updates, tuple(new_states)

    update_fn.passes_unreduced = all(passes_unreduced(t) for t in transforms)  # type: ignore[attr-defined]
    return GradientTransformation(init_fn, update_fn)


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
        updates, new_states = _run_sequence(txs, [state[n] for n in names], updates, params,
                                            mesh, extra)
        return updates, dict(zip(names, new_states))

    update_fn.passes_unreduced = all(passes_unreduced(t) for t in txs)  # type: ignore[attr-defined]
    return GradientTransformation(init_fn, update_fn)
