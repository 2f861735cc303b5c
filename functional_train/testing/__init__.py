"""Testing tools for sharded gradient transforms.

Simulate N ranks in one process with ``torch.distributed._local_tensor.LocalTensorMode`` (the
``fake`` process group), build per-rank values, gather sharded results, and count collectives.
The sharded-vs-unsharded harness built on these lives in :mod:`functional_train.testing.harness`.
"""

from .sim import (count_collectives, gather, local_tensor, on_rank, per_rank, simulate)

__all__ = ["simulate", "per_rank", "local_tensor", "on_rank", "gather", "count_collectives"]
