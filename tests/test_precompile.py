"""``ft.precompiled_step``: ft.step compiled ahead of time, saved, and loaded by a later
process instead of traced again; loaded only for the transform, ``donate`` and input
signature it was compiled for."""

import pathlib
import subprocess
import sys
import threading
import warnings

import optree
import pytest
import torch

import _sweep_registry as reg
import functional_train as ft
from _precompile_problem import make, run, transforms


def eager(tx):
    return lambda g, s, p: ft.step(tx, g, s, p)


@pytest.mark.slow
def test_the_file_is_named_by_the_transform_donate_and_the_inputs(tmp_path):
    """Fresh processes building equal transforms name the same file; another learning rate,
    ``donate`` or leaf shape another (``path_for`` only, no compile)."""
    here = pathlib.Path(__file__).parent
    configs = [("0.01", "0", "(4, 3)"), ("0.01", "0", "(4, 3)"), ("0.02", "0", "(4, 3)")]
    configs += [("0.01", "1", "(4, 3)"), ("0.01", "0", "(4, 4)")]
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "_precompile_problem.py"), "path", str(tmp_path), *c],
            stdout=subprocess.PIPE,
            text=True,
            cwd=here,
        )
        for c in configs
    ]
    base, again, lr, donate, shape = (pathlib.Path(p.communicate()[0].strip()) for p in procs)
    assert all(p.returncode == 0 for p in procs)
    assert base.parent == tmp_path and base == again
    assert len({base, lr, donate, shape}) == 4
    assert shape.name[:32] == base.name[:32]  # (the same transform; the inputs differ)


@pytest.mark.slow
def test_fingerprints_do_not_depend_on_the_hash_seed():
    """Processes with different hash seeds fingerprint equal transforms alike (sets are
    pickled in a fixed order, tensors by value; inject_hyperparams ordered a dict by a set)."""
    import os

    here = pathlib.Path(__file__).parent
    outs = []
    for seed in ("1", "2", "3"):
        outs.append(
            subprocess.run(
                [sys.executable, str(here / "_precompile_problem.py"), "fingerprints"],
                capture_output=True,
                text=True,
                check=True,
                cwd=here,
                env={**os.environ, "PYTHONHASHSEED": seed},
            ).stdout
        )
    assert len(outs[0].splitlines()) == 10
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("name", sorted(reg.all_entries()))
def test_fingerprint_is_what_the_transform_is_not_what_it_remembers(name):
    """Every registered transform's fingerprint (which names its saved step's file) is the
    same before ``init`` and after ``init`` again, an eager update, pure and donated steps
    and a step on a tree of other shapes: what a transform remembers between calls is left
    out (a partition's or a mask's labels per params tree, the flags made from them, an
    injected hyperparameter's last value). Before session 66 16 of them changed, and a
    process that had used its transform first compiled the step again."""
    from functional_train.precompile import _fingerprint_bytes

    tx = reg.all_entries()[name]()
    before = _fingerprint_bytes(tx)
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (16, 8), "b": (8,), "c": (4, 3), "d": (6, 6)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(3)]
    tx.update(grads[0], tx.init(params), params)
    state, p = tx.init(params), dict(params)
    for i, g in enumerate(grads):
        p, state = ft.step(tx, dict(g), state, p, donate=i == 2)
    other = {"x": torch.randn(5, 7, generator=gen), "y": torch.randn(3, generator=gen)}
    ft.step(
        tx,
        {k: torch.randn(v.shape, generator=gen) for k, v in other.items()},
        tx.init(other),
        other,
    )
    assert _fingerprint_bytes(tx) == before


def test_bad_transforms_are_refused(tmp_path):
    with pytest.raises(TypeError, match="GradientTransformation"):
        ft.precompiled_step(lambda g, s, p: None, tmp_path)
    lock = threading.Lock()

    def update(updates, state, params=None):
        with lock:
            return updates, state

    tx = ft.GradientTransformation(lambda params: ft.EmptyState(), update)
    with pytest.raises(ValueError, match="cannot be fingerprinted"):
        ft.precompiled_step(tx, tmp_path)


def test_tensor_subclasses_are_refused_before_compiling(tmp_path):
    """A tensor subclass (a DTensor; here a Parameter) or a tensor that requires grad (which
    dynamo cannot return from a precompiled step) is refused, named by its leaf path."""
    tx, params, grads = make()
    f = ft.precompiled_step(tx, tmp_path)
    bad = {**params, "p1": torch.nn.Parameter(params["p1"])}
    with pytest.raises(ValueError, match="params leaf p1 is a Parameter"):
        f(grads[0], tx.init(bad), bad)
    bad = {**params, "p2": params["p2"].clone().requires_grad_()}
    with pytest.raises(ValueError, match="params leaf p2 requires grad"):
        f(grads[0], tx.init(params), bad)
    assert f.compiled == 0 and not list(tmp_path.iterdir())


KINDS = ("schedule", "inject", "masked", "partition")


@pytest.mark.slow
def test_saved_steps_are_loaded_by_another_process_and_match_eager(tmp_path):
    """A fresh process compiles and saves the step of each kind of transform; a second one,
    building the same transforms in the same order and using each eagerly first (``init``
    twice, a cycle of eager steps), loads them; both give eager ``ft.step``'s numbers.
    (Processes of their own: a file is named by the parts' numbers, which depend on what a
    process built before.) ``inject``: the schedule given to ``inject_hyperparams(adamw)``
    (its step failed to load before session 45: the loader could not rebuild a guard on a
    dict in its closures; and before session 66 after eager steps, whose last learning rate
    its fingerprint held). ``masked``, ``partition``: a mask and a labelling function (their
    steps failed to load in session 66: the loader could not rebuild dynamo's guard on the
    key order of the dict subclass the resolved labels were read from under compile)."""
    here = pathlib.Path(__file__).parent
    results = []
    for i in range(2):
        out = tmp_path / f"out{i}.pt"
        cmd = [
            sys.executable,
            str(here / "_precompile_problem.py"),
            str(tmp_path / "c"),
            str(out),
            ",".join(KINDS),
            *(["used"] if i else []),
        ]
        subprocess.run(cmd, check=True, cwd=here)
        results.append(torch.load(out))
    for kind in KINDS:
        counts = [(r[kind]["compiled"], r[kind]["loaded"]) for r in results]
        assert counts == [(1, 0), (0, 1)], f"{kind}: (compiled, loaded) per process {counts}"
        tx, params, grads = make(kind=kind)
        pe, se = run(eager(tx), tx, params, grads)
        assert int(se.mini_step) == 1
        for k in params:  # (five steps: two multi_steps cycles and a half, a warm-up schedule)
            assert not torch.equal(pe[k], params[k])
            for r in results:
                torch.testing.assert_close(
                    r[kind]["params"][k], pe[k], rtol=1e-6, atol=1e-7, msg=f"{kind}: {k}"
                )


@pytest.mark.slow
def test_another_transform_or_new_shapes_compile_again(tmp_path):
    """In one process: steps of two transforms are two files, and inputs of new shapes
    compile a second step for the same transform; each gives eager ``ft.step``'s numbers."""
    tx, params, grads = make()
    run(ft.precompiled_step(tx, tmp_path), tx, params, grads)
    tx2, params, grads = make(lr=3e-2)
    f = ft.precompiled_step(tx2, tmp_path)
    p, _ = run(f, tx2, params, grads)
    assert (f.compiled, f.loaded) == (1, 0)
    pe, _ = run(eager(tx2), tx2, params, grads)
    for k in params:
        torch.testing.assert_close(p[k], pe[k], rtol=1e-6, atol=1e-7)
    _, params3, grads3 = make(lr=3e-2, shapes=((16, 8), (8,), (4, 4)))
    p3, _ = run(f, tx2, params3, grads3)
    assert (f.compiled, f.loaded) == (2, 0)
    pe3, _ = run(eager(tx2), tx2, params3, grads3)
    for k in params3:
        torch.testing.assert_close(p3[k], pe3[k], rtol=1e-6, atol=1e-7)
    assert len(list(tmp_path.glob("*.pt2"))) == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(transforms()))
def test_transforms_precompile_and_match_eager(name, tmp_path):
    """aot_compile takes each transform's step (it raised where dynamo restarts its analysis
    for a float made constant: adafactor, lamb, inject_hyperparams; muon's tall matrix gave a
    transposed result), and three steps match eager ``ft.step``'s parameter changes. A second
    ``precompiled_step`` of the transform loads every saved step and gives the same numbers:
    torch rebuilds the saved guards' objects from its own pickle of them, and a guard it
    cannot rebuild (the masked step's in session 66: the key order of a dict subclass reached
    through a spec) made it compile again."""
    tx = transforms()[name]
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (16, 8), "b": (8,), "ln.weight": (8,), "tall": (32, 16)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    f = ft.precompiled_step(tx, tmp_path)
    p, _ = run(f, tx, params, grads)
    pe, _ = run(eager(tx), tx, params, grads)
    # (one step per input signature: galore's state takes its projectors' shapes at step 1)
    assert f.compiled == len(list(tmp_path.glob("*.pt2"))) >= 1
    for k in params:
        torch.testing.assert_close(p[k] - params[k], pe[k] - params[k], rtol=1e-4, atol=1e-6)
    f2 = ft.precompiled_step(tx, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (a step that could not be loaded)
        p2, _ = run(f2, tx, params, grads)
    assert (f2.compiled, f2.loaded) == (0, f.compiled)
    for k in params:
        assert torch.equal(p2[k], p[k]), k


@pytest.mark.slow
def test_steps_of_two_transforms_in_one_process(tmp_path):
    """Each precompiled step's code is its own: dynamo keeps what it learnt of a code's
    inputs across compiles (automatic dynamic), and sgd's step compiled after adafactor's,
    both from one template code, failed in inductor (``ToFloat(False)``; found by running
    ``test_transforms_precompile_and_match_eager`` in one process). Both match eager."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (16, 8), "b": (8,), "ln.weight": (8,), "tall": (32, 16)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    for name in ("adafactor", "sgd"):
        tx = transforms()[name]
        p, _ = run(ft.precompiled_step(tx, tmp_path / name), tx, params, grads)
        pe, _ = run(eager(tx), tx, params, grads)
        for k in params:
            torch.testing.assert_close(p[k] - params[k], pe[k] - params[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_donated_step_copies_what_an_eager_pure_step_handed_back(tmp_path):
    """A donated precompiled step given an eager pure step's result copies first what that
    step handed back as it was (a ``None`` gradient's parameter and momentum, recorded as
    shared), as the eager donated step does: the caller's older trees keep their values (the
    compiled graph cannot read the records; before, it wrote into them). Its numbers are the
    eager step's."""
    tx = ft.sgd(0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    p0 = {"a": torch.randn(3, 2, generator=gen), "m": torch.randn(4, generator=gen)}
    s0 = ft.step(tx, {k: torch.ones_like(v) for k, v in p0.items()}, tx.init(p0), p0)[1]
    p1, s1 = ft.step(tx, {"a": torch.randn(3, 2, generator=gen), "m": None}, s0, p0)
    assert p1["m"] is p0["m"]  # (handed back as it was)
    before = [x.clone() for x in (p0["m"], *[v for v in optree.tree_leaves(s0) if v.numel() == 4])]
    g = {"a": torch.randn(3, 2, generator=gen), "m": torch.randn(4, generator=gen)}
    want, want_state = ft.step(tx, {k: v.clone() for k, v in g.items()}, s1, p1)
    step = ft.precompiled_step(tx, tmp_path, donate=True)
    got, got_state = step(g, s1, p1)
    after = [p0["m"], *[v for v in optree.tree_leaves(s0) if v.numel() == 4]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    for k in p0:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    for a, b in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
