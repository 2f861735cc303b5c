"""The sharding engine, one concern per module:

* :mod:`.dtensor` -- DTensor specs, local views and rewrapping (DTensor's private API, fenced);
* :mod:`.layout` -- mesh roles per leaf (:class:`World`), shard regions;
* :mod:`.collectives` -- every collective the library issues, batched;
* :mod:`.plan` -- the per-layout plan, cached;
* :mod:`.view` -- the prepared local view a chain passes between primitives, and ``prepare``;
* :mod:`.pool` -- pooled result buffers of the pure step on CPU;
* :mod:`.kernels` -- the pure step's compiled out-of-place optimizer kernels (CPU);
* :mod:`.whole` -- whole leaves gathered onto every rank (GaLore's SVD);
* :mod:`.owners` -- a whole-tensor function run once per leaf at an owner rank, all-to-alls
  (Muon's Newton-Schulz).

The public extension surface for writing sharding-aware transforms is
:mod:`functional_train.sharding`.
"""
