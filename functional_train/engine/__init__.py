"""The sharding engine (DESIGN.md section 3a), one concern per module:

* :mod:`.dtensor` -- DTensor specs, local views and rewrapping (DTensor's private API, fenced);
* :mod:`.layout` -- mesh roles per leaf (:class:`World`), shard regions;
* :mod:`.collectives` -- every collective the library issues, batched;
* :mod:`.plan` -- the per-layout plan, cached;
* :mod:`.view` -- the prepared local view a chain passes between primitives, and ``prepare``;
* :mod:`.pool` -- pooled result buffers of the pure step on CPU;
* :mod:`.kernels` -- the pure step's compiled out-of-place optimizer kernels (CPU).

The public extension surface for writing sharding-aware transforms is
:mod:`functional_train.sharding`.
"""
