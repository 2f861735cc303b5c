"""Testing tools for sharded gradient transforms.

Simulate N ranks in one process with ``torch.distributed._local_tensor.LocalTensorMode`` (the
``fake`` process group), build per-rank values, gather sharded results, and count collectives.
Inside :func:`simulate`, build every input from simulated tensors (:func:`replicated`,
:func:`per_rank`, ``distribute_tensor``): a plain tensor made outside the block and mixed in-place
with simulated ones is updated once per simulated rank.
"""

from .sim import (count_collectives, gather, local_tensor, on_rank, per_rank, replicated,
                  simulate)

__all__ = ["simulate", "per_rank", "replicated", "local_tensor", "on_rank", "gather",
           "count_collectives"]
