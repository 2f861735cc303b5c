"""Shared pytest configuration: hypothesis profiles, and the ``x64`` fixture (jax in float64).

Profiles (select with the ``HYPOTHESIS_PROFILE`` environment variable):

* ``ci`` (the default): few examples, deterministic (``derandomize``), no deadline, so the whole
  suite stays fast and reproducible on a small CPU machine;
* ``dev``: many more examples, random seeds, for local bug hunting
  (``HYPOTHESIS_PROFILE=dev python -m pytest tests/test_sharded_equivalence.py``).
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def x64():
    """jax in float64 for one test (optax references compared in float64)."""
    import jax  # optax and jax are test dependencies (pyproject's "test" extra)

    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


@pytest.fixture
def no_fake_process_group():
    """Tear down the ``fake`` process group that ``functional_train.testing.simulate`` leaves
    initialised, for tests that run torch.distributed.checkpoint in this one process (DCP would
    plan for the simulated ranks)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()
    yield
