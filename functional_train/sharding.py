"""The public extension surface for writing sharding-aware transforms.

A transform written against this module works on local shards and stays exact on any layout the
library supports:

* :func:`prepare` flattens and validates ``updates`` (and ``params``), reduces unreduced
  gradients once (the data-axis mean, ``Partial`` placements; one bucketed all-reduce per kind)
  and returns a :class:`Prepared` view: ``locals`` (the local shards), ``params`` (the params'
  local shards), ``active`` (indices of the non-``None`` leaves), and batched global reductions
  -- ``leaf_totals`` (per-leaf sums over the global tensors, ONE all-reduce for every leaf),
  ``leaf_sums`` (per-leaf statistics such as row or column sums, ONE all-reduce per dtype),
  ``global_sum`` / ``global_max`` (one scalar all-reduce). ``rebuild_active(new_locals)``
  returns the result in the layout of the updates.
* :func:`declare` tells combinators what a transform accepts. A transform that is not declared
  is treated as foreign: ``chain``, ``named_chain`` and ``multi_steps`` reduce unreduced
  gradients before it, so a plain ``tree_map`` transform composes correctly under a data axis.
  ``declare(update_fn, unreduced=True)`` says the transform reduces what it needs itself (it
  calls :func:`prepare`); ``view=True`` additionally says it accepts the :class:`Prepared` view
  a chain hands along (it calls :func:`prepare` first, reads values only from ``locals`` /
  ``params``, and returns ``rebuild(...)`` / ``rebuild_active(...)``), so the chain rewraps
  DTensors once for the whole chain instead of once per primitive.

The engine behind it lives in :mod:`functional_train.engine` (specs, mesh roles, collectives,
the per-layout plan, the view).
"""

from __future__ import annotations

from typing import Any

from .base import declare
from .engine.collectives import all_reduce_buckets, per_rank
from .engine.dtensor import Spec, spec_of, to_local, wrap
from .engine.layout import World, shard_region
from .engine.plan import plan_for
from .engine.view import Prepared, leaf_paths, prepare

__all__ = [
    "prepare",
    "Prepared",
    "declare",
    "Spec",
    "spec_of",
    "to_local",
    "wrap",
    "World",
    "all_reduce_buckets",
    "per_rank",
    "shard_region",
    "leaf_paths",
]


def materialize(grads: list, params, paths, mesh, world=None) -> list:
    """Reduce unreduced gradient leaves into their parameters' placements (see
    :meth:`functional_train.engine.plan.Plan.materialize`); ``paths`` and ``world`` are
    accepted for compatibility and derived from the layout."""
    del paths, world
    import optree

    slots: Any = [None] * len(grads)
    treedef = optree.tree_structure(slots, none_is_leaf=True)
    return plan_for(
        treedef, list(grads), None if params is None else list(params), mesh
    ).materialize(list(grads), None if params is None else list(params))
