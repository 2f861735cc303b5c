"""Property-testing toolkit for sharded gradient transforms.

* :func:`assert_sharded_equivalent`: run a transform unsharded and sharded (simulated ranks in
  one process, or the real ranks of an initialised process group) for several steps and compare
  updates, parameters and states rank by rank, naming the first differing step and leaf.
* Simulation helpers: :func:`simulate` (``N`` ranks in this process through
  ``torch.distributed._local_tensor.LocalTensorMode`` and the ``fake`` process group),
  :func:`per_rank`, :func:`replicated`, :func:`local_tensor`, :func:`on_rank`, :func:`gather`.
* :func:`count_collectives`: how many collectives of which kind a block issues.
* Hypothesis strategies (:mod:`functional_train.testing.strategies`): :func:`mesh_shapes`,
  :func:`placements`, :func:`leaf_placements`, :func:`tree_placements`, :func:`shapes`,
  :func:`tensors`, :func:`gradients`, :func:`gradients_like`, :func:`pytrees`,
  :func:`sharded_cases` / :class:`ShardedCase`. They need ``hypothesis``
  (``pip install functional-train[test]``) and are imported on first use, so this package
  imports without it.

Inside :func:`simulate`, build every input from simulated tensors (:func:`replicated`,
:func:`per_rank`, ``distribute_tensor``): a plain tensor made outside the block and mixed in-place
with simulated ones is updated once per simulated rank.
"""

from .equivalence import assert_sharded_equivalent
from .sim import count_collectives, gather, local_tensor, on_rank, per_rank, replicated, simulate

_STRATEGIES = (
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
)

__all__ = [
    "assert_sharded_equivalent",
    "simulate",
    "per_rank",
    "replicated",
    "local_tensor",
    "on_rank",
    "gather",
    "count_collectives",
    *_STRATEGIES,
]


def __getattr__(name: str):
    """Import the hypothesis strategies lazily (hypothesis is a test extra)."""
    if name in _STRATEGIES or name == "strategies":
        import importlib

        try:
            mod = importlib.import_module(".strategies", __name__)
        except ImportError as e:  # pragma: no cover
            raise ImportError(
                f"functional_train.testing.{name} needs hypothesis: "
                "pip install functional-train[test]"
            ) from e
        return mod if name == "strategies" else getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_STRATEGIES) + ["strategies"])
