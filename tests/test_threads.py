"""Steps in several threads at once: each thread's results are those it gets alone.

A training script may step several models in threads (torch's kernels release the GIL), and
they may share one transform object. The library keeps things between steps (a plan's pool of
result buffers and its scratch buffers, ``multi_steps``' flag blocks, the values
``inject_hyperparams`` hands its inner transform, the answers its combinators remember last,
the records of shared tensors): each must give a thread its own. Before they did, 18 to 25 of
the 108 ``ft.step`` cases below gave other threads' numbers in a run (pure steps of pooled
trees, and donated GaLore, CAME and Adafactor), silently.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import _sweep_registry as reg  # noqa: E402  (tests/ is on sys.path)
import functional_train as ft

# leaves of 80 KiB and more: a pure step's results come from the plan's pool (64 KiB a leaf on
# average and more), Adafactor's and CAME's factored rows and columns, GaLore's projections
SHAPES = {"a": (128, 160), "b": (160, 128), "c": (96, 200)}
THREADS, STEPS = 4, 6


def _run(tx, seed: int, mode: str, device: torch.device, out: dict) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen).to(device) for n, s in SHAPES.items()}
    state = tx.init(params)
    for k in range(STEPS):
        g = torch.Generator().manual_seed(1000 * seed + k)
        grads = {n: torch.randn(s, generator=g).to(device) for n, s in SHAPES.items()}
        if mode == "update":
            updates, state = tx.update(grads, state, params)
            params = ft.apply_updates(params, updates)
        else:
            params, state = ft.step(tx, grads, state, params, donate=mode == "donated")
    out[seed] = params


@pytest.mark.parametrize("mode", ["pure", "donated", "update"])
@pytest.mark.parametrize("name", sorted(reg.all_entries()))
def test_threads_stepping_one_transform_get_their_own_results(name, mode, device):
    """``THREADS`` threads step one transform object on their own params and gradients (by
    ``ft.step``, pure or donated, or by ``update`` + ``apply_updates``), the interpreter
    switching threads every 10 us: each thread's params after ``STEPS`` steps are bitwise
    those of the same steps run one thread after another."""
    tx = reg.all_entries()[name]()
    want: dict = {}
    for seed in range(THREADS):
        _run(tx, seed, mode, device, want)
    got: dict = {}
    errors: list = []

    def target(seed):
        try:
            _run(tx, seed, mode, device, got)
        except Exception as e:  # (reported below, with the thread's seed)
            errors.append((seed, e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=target, args=(seed,)) for seed in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, f"{name}: a thread raised: {errors[0]!r}"
    wrong = [
        (seed, n)
        for seed in range(THREADS)
        for n in SHAPES
        if not torch.equal(got[seed][n], want[seed][n])
    ]
    assert not wrong, f"{name}: (thread, leaf) with another's numbers: {wrong}"
