"""The problem tests/test_precompile.py steps, built alike by the test and by the process it
starts (``python tests/_precompile_problem.py CACHE_DIR OUT KINDS [used]``: per kind of
the comma-separated KINDS (:func:`make`'s), in that order, loads the precompiled step from
CACHE_DIR (or compiles and saves it), runs it, and saves the results and its counters to OUT,
a dict by kind; ``used``: each transform used eagerly first; ``... path CACHE_DIR LR DONATE
SHAPE``: prints the file it would load for that learning rate, donate and last leaf shape)."""

import sys

import torch

import functional_train as ft


def make(lr=1e-2, shapes=((16, 8), (8,), (4, 3)), kind="schedule"):
    """``kind``: ``"schedule"`` (adamw given a schedule), ``"inject"`` (optax's idiom:
    ``inject_hyperparams(adamw)`` given it), ``"masked"`` (adamw given it and
    ``mask=decay_mask``) or ``"partition"`` (adamw given it for the matrices, sgd for the
    rest, by a labelling function)."""
    gen = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(5)]
    schedule = ft.schedules.warmup_cosine_decay_schedule(0.0, lr, 1, 10)
    if kind == "masked":
        inner = ft.adamw(schedule, weight_decay=0.1, mask=ft.decay_mask)
    elif kind == "partition":
        inner = ft.partition(
            {"matrix": ft.adamw(schedule, weight_decay=0.1), "other": ft.sgd(schedule, 0.9)},
            lambda p: {k: "matrix" if v.ndim > 1 else "other" for k, v in p.items()},
        )
    else:
        adamw = ft.inject_hyperparams(ft.adamw) if kind == "inject" else ft.adamw
        inner = adamw(schedule, weight_decay=0.1)
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), inner), every_k=2)
    return tx, params, grads


def run(step, tx, params, grads):
    p, s = params, tx.init(params)
    for g in grads:
        p, s = step(g, s, p)
    return p, s


def transforms():
    """Transforms whose closures hold sets, dicts built from sets, tensors and schedules."""
    return {
        "inject_hyperparams": ft.inject_hyperparams(ft.adamw)(
            learning_rate=1e-3, weight_decay=0.1, b1=torch.tensor(0.9), eps=1e-8
        ),
        "came": ft.came(1e-3),
        "adafactor": ft.adafactor(),
        "galore_adamw": ft.galore_adamw(1e-3),
        "muon": ft.muon(1e-3, ns_dtype=torch.float32),
        "sgd": ft.sgd(0.1, momentum=0.9, nesterov=True),
        "lamb": ft.lamb(1e-3),
        "masked": ft.masked(ft.add_decayed_weights(0.1), ft.decay_mask),
        "dynamic_loss_scale": ft.dynamic_loss_scale(ft.adamw(1e-3)),
        "apply_if_finite": ft.apply_if_finite(ft.adamw(1e-3), 3),
    }


if __name__ == "__main__":
    if sys.argv[1] == "fingerprints":  # each transform's fingerprint bytes' digest
        import hashlib

        from functional_train.precompile import _fingerprint_bytes

        for name, tx in transforms().items():
            print(name, hashlib.sha256(_fingerprint_bytes(tx)).hexdigest())
    elif sys.argv[1] == "path":  # path CACHE_DIR LR DONATE LAST_SHAPE: print the step's file
        lr, donate, last = float(sys.argv[3]), sys.argv[4] == "1", eval(sys.argv[5])
        tx, params, grads = make(lr, shapes=((16, 8), (8,), last))
        f = ft.precompiled_step(tx, sys.argv[2], donate=donate)
        print(f.path_for(grads[0], tx.init(params), params))
    else:  # CACHE_DIR OUT KINDS [used]: "used": each transform used eagerly first
        cache_dir, out = sys.argv[1], sys.argv[2]
        results = {}
        for kind in sys.argv[3].split(","):
            tx, params, grads = make(kind=kind)
            if sys.argv[4:] == ["used"]:  # (init twice, a cycle of eager steps: what it
                # remembers grows)
                tx.init(params)
                run(lambda g, s, p: ft.step(tx, g, s, p), tx, params, grads[:2])
            f = ft.precompiled_step(tx, cache_dir)
            p, s = run(f, tx, params, grads)
            results[kind] = {"params": p, "compiled": f.compiled, "loaded": f.loaded}
        torch.save(results, out)
