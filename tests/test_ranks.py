"""The session's kept gloo ranks (``tests/_ranks.py``): jobs see their rank, world and a real
process group; a job that fails on one rank reports that rank's traceback and what it printed,
and the next job gets fresh ranks."""

import pytest
import torch
import torch.distributed as dist

from _ranks import RankError

pytestmark = pytest.mark.slow  # starts processes


def _sum_of_ranks(rank, world, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, world, float(t)


def _fails_on_rank_1(rank, world):
    if rank == 1:
        print("rank 1 was here")
        raise ValueError("rank 1 gives up")
    dist.barrier()  # the others wait in a collective for the failed rank


def test_jobs_failures_and_fresh_ranks(ranks):
    assert ranks.run(2, "test_ranks:_sum_of_ranks", 10) == [(0, 2, 21.0), (1, 2, 21.0)]
    with pytest.raises(RankError, match=r"(?s)failed on rank 1 of 2.*rank 1 gives up.*was here"):
        ranks.run(2, "test_ranks:_fails_on_rank_1", timeout=60)
    assert ranks.run(2, "test_ranks:_sum_of_ranks", 0) == [(0, 2, 1.0), (1, 2, 1.0)]
