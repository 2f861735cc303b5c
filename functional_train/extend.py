"""Writing your own elementwise transform, fused with the library's.

The library's elementwise primitives (``scale``, ``scale_by_learning_rate``,
``add_decayed_weights``, ``trace``, ``scale_by_adam``, ``clip_by_global_norm``'s scaling, ...)
state their math once, for one leaf, in plain tensor operations; ``chain`` and ``ft.step`` run
consecutive ones as one pass over the leaves (a C kernel generated from the composed per-leaf
function on CPU; leaf by leaf in torch elsewhere, see :mod:`functional_train.engine.fuse`). A
transform built here joins that pass like the library's own::

    def leaf(u, p, v, *, beta):  # one leaf: update, parameter, one state field
        v = beta * v + (1 - beta) * u * u
        return u / (torch.sqrt(v) + 1e-8), v

    rms = ft.elementwise(leaf, name="rms", fields=("v",), hyperparams={"beta": 0.99})
    tx = ft.chain(ft.clip_by_global_norm(1.0), rms, ft.scale_by_learning_rate(1e-2))

A transform written without the engine (an optax-style ``tree_map`` update) still composes
with everything; it runs by its own ``update`` and breaks the fused pass where it stands.

The full protocol (a state of your own, scalars computed from the state, a reduction over the
updates before the pass, per-leaf static keys such as a mask) is
:class:`functional_train.engine.elementwise.Elementwise` with
:func:`functional_train.base.elementwise_transform`, which is how the library writes its
primitives.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .base import GradientTransformation
from .base import elementwise_transform as transform
from .engine.elementwise import Elementwise
from .engine.scalars import counted, schedule_numbers
from .hyperparams import value_of
from .tree import first_device, state_zeros_like

__all__ = ["elementwise", "ElementwiseState", "Elementwise", "transform"]


class ElementwiseState(NamedTuple):
    """State of :func:`elementwise`: ``count`` (updates so far, 0-dim int64) and ``fields``
    (a tuple of params-shaped trees, in the order of the ``fields`` argument)."""

    count: torch.Tensor  # type: ignore[assignment]  # (the field name optax states use)
    fields: tuple


def elementwise(
    leaf: Callable,
    *,
    name: str = "elementwise",
    fields: Sequence[str] = (),
    hyperparams: Mapping[str, Any] | None = None,
    needs_params: bool = False,
    field_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """A transform from the math of one leaf, fused with the elementwise transforms beside it.

    Args:
        leaf: ``leaf(u, p, *fields, **hyperparams) -> u`` or ``-> (u, *fields)``: the update
            of one leaf (``u``, a tensor of the leaf's local shape), its parameter (``p``,
            ``None`` unless ``needs_params``), its state fields, and the hyper-parameters as
            0-dim float64 tensors or Python floats. Plain elementwise tensor operations only
            (arithmetic, ``sqrt``, ``where``, ``lerp``, ``addcmul``, ``maximum``, comparisons,
            casts); no reductions, no Python branches on tensor values. It must return a new
            value for every field. The update is cast to the gradient's dtype, each field to
            its own.
        name: the transform's name in errors.
        fields: names of the params-shaped state fields (zeros at ``init``).
        hyperparams: ``name -> value``: a number, or ``fn(count) -> number`` evaluated at
            each update on the 0-dim int64 count of previous updates (a schedule, optax
            semantics; plain functions, with the count, are one ``functional_train::scalars``
            call under ``torch.compile``, see :mod:`functional_train.engine.scalars`), or a
            hyperparameter injected by ``inject_hyperparams``.
        needs_params: ``leaf`` reads the parameter (``update`` then requires ``params``).
        field_dtype: dtype of the fields (default ``None``: float32, or the parameter's dtype
            when wider, as the library's moments).

    Returns:
        a ``GradientTransformation`` whose state is :class:`ElementwiseState`.

    Raises:
        TypeError: ``leaf`` is not callable; ``hyperparams`` names that ``leaf`` does not take.
        ValueError: at update, a state from another transform, missing params when
            ``needs_params``; ``leaf`` returning the wrong number of fields.
    """
    if not callable(leaf):
        raise TypeError(f"elementwise: leaf must be callable, got {type(leaf).__name__}")
    names = tuple(fields)
    hp = dict(hyperparams or {})
    try:
        sig = inspect.signature(leaf)
        sig.bind(None, None, *([None] * len(names)), **dict.fromkeys(hp))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"elementwise {name!r}: leaf cannot be called as leaf(u, p, "
            f"{', '.join([*names, *(f'{k}=' for k in hp)])}): {e}"
        ) from None
    keys = tuple(hp)
    n = len(names)
    # (the schedules: evaluated with the count in one scalar program, see engine.scalars)
    sched = tuple(
        k
        for k, v in hp.items()
        if callable(v) and not isinstance(v, torch.Tensor) and not _injected(v)
    )
    numbers = schedule_numbers(hp[k] for k in sched)

    def init_fn(params):
        count = torch.zeros((), dtype=torch.int64, device=first_device(params))
        return ElementwiseState(count, tuple(state_zeros_like(params, field_dtype) for _ in names))

    def prologue(state, b):
        if not isinstance(state, ElementwiseState) or len(state.fields) != n:
            raise ValueError(
                f"{name}: expected the ElementwiseState of {n} fields from its init, got "
                f"{type(state).__name__}"
            )
        count, *scheduled = counted(state.count, [hp[k] for k in sched], numbers)
        at = dict(zip(sched, scheduled))
        values = tuple(at[k] if k in at else value_of(hp[k]) for k in keys)
        return values, lambda trees: ElementwiseState(count, tuple(trees))

    def fields_of(state):
        return tuple(
            (t, f"ElementwiseState.fields[{i}] ({names[i]})") for i, t in enumerate(state.fields)
        )

    def per_leaf(u, p, s, h, key):
        out = leaf(u, p, *s, **dict(zip(keys, h)))
        if n == 0:
            if isinstance(out, tuple):
                if len(out) != 1:
                    raise ValueError(
                        f"{name}: leaf returned {len(out)} values, expected the update"
                    )
                out = out[0]
            return out.to(u.dtype), ()
        if not isinstance(out, tuple) or len(out) != 1 + n:
            got = len(out) if isinstance(out, tuple) else 1
            raise ValueError(
                f"{name}: leaf returned {got} values, expected the update and {n} fields {names}"
            )
        return out[0].to(u.dtype), tuple(x.to(f.dtype) for x, f in zip(out[1:], s))

    spec = Elementwise(name, per_leaf, prologue, fields_of, n, needs_params=needs_params)
    return transform(spec, init_fn)


def _injected(v) -> bool:
    from .hyperparams import is_injected

    return is_injected(v)
