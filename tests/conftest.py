"""Shared pytest configuration: the two tiers, hypothesis profiles, and the ``x64`` fixture (jax
in float64).

Tiers: ``python -m pytest -q`` runs every test not marked ``slow`` (single-process properties,
reference tests, simulated-rank sharded tests: a few minutes on 2 cores); ``--full`` adds the
``slow`` ones (tests that start processes, compile a step with ``torch.compile``, or run the
main job or the notebook; and two dtypes of the Triton writer's check), as ``.ci/run`` does.
An explicit ``-m`` expression selects by itself (``-m slow``: only those).

Profiles (select with the ``HYPOTHESIS_PROFILE`` environment variable):

* ``ci`` (``--full``'s, as ``.ci/run`` runs it): few examples (10), deterministic
  (``derandomize``), no deadline, so the whole suite stays fast and reproducible on a small CPU
  machine;
* ``quick`` (the default tier's, without ``--full``): ``ci`` with half its examples (5), so
  that the developer's run stays within its few minutes on 2 cores (the sweep's sharded
  properties then draw one example per transform, and their explicit one);
* ``dev``: many more examples, random seeds, for local bug hunting
  (``HYPOTHESIS_PROFILE=dev python -m pytest tests/test_sharded_equivalence.py``).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# pytest-xdist: the workers share the cores. Torch's intra-op threads spin while they wait, so
# two workers of 2 threads each on 2 cores slowed an SVD-heavy test from 7 s to 50 s: each
# worker gets its share of the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(
        max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (processes, inductor compiles, main job, notebook)",
    )
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda", "auto"),
        help="where the device-generic tests (the ``device`` fixture) put their tensors: cpu "
        "(the default), cuda, or auto (cuda when one is present)",
    )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device of ``--device`` for the device-generic tests (``ft.step``'s fused paths and
    their wrappers): ``auto`` is CUDA when one is present; ``cuda`` without one is a usage
    error."""
    name = request.config.getoption("--device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pytest_configure(config):
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is present")
    if not os.environ.get("HYPOTHESIS_PROFILE"):  # (the tier's profile; see the docstring)
        settings.load_profile("ci" if config.getoption("--full") else "quick")


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist's, which reads the xdist_group marks)
def pytest_collection_modifyitems(config, items):
    """Deselect the ``slow`` tests unless ``--full`` or an explicit ``-m`` is given; under
    pytest-xdist (``--dist loadgroup``), run the tests that use the session's ranks on one
    worker, so that one set of rank processes serves them all (and a session fixture over
    them, such as tests/test_sweep.py's compiling job, runs once)."""
    for item in items:
        if "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ranks"))
    if config.getoption("--full") or config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


settings.register_profile(
    "ci",
    max_examples=10,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("quick", settings.get_profile("ci"), max_examples=5)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ranks():
    """Gloo ranks kept for the session, one set per world size: ``ranks.run(world,
    "module:function", *args)`` runs ``function(rank, world, *args)`` on each rank and returns
    their results (``tests/_ranks.py``)."""
    from _ranks import Ranks

    pools = Ranks()
    yield pools
    pools.close()


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


@pytest.fixture
def recognised_path(monkeypatch):
    """``ft.step`` takes the recognised chains' torch fused kernels on CPU too (it does on CUDA
    and under ``torch.compile``; eagerly on CPU a fusable chain runs as generated stages):
    for the tests of that path."""
    import sys

    import functional_train  # noqa: F401  (the module, which the package's ``step`` shadows)

    monkeypatch.setattr(sys.modules["functional_train.step"], "SPEC_FIRST", False)
