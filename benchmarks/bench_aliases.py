"""Optimizer aliases against their reference implementations: one step of the reference
(``torch.optim``-style ``opt.step()`` on ``nn.Parameter`` with ``.grad`` set) against
``ft.step(tx, grads, state, params, donate=False)`` and ``donate=True``.

Problem: the GPT-like tree of ``benchmarks/bench_engine.py`` (its ``gpt_shapes`` /
``make_problem``): 13,650,176 float32 parameters in 122 leaves (``embed`` 4096 x 256,
``final_norm``, 12 layers of ``attn_norm``, ``wq``/``wk``/``wv``/``wo`` 256 x 256, ``mlp_norm``,
``w1`` 1024 x 256, ``b1`` (1024), ``w3`` 1024 x 256, ``w2`` 256 x 1024); matrices ~0.02 randn,
norms 1, biases 0; one gradient tree ~1e-2 randn, written afresh (untimed) before every step,
as after a backward pass: ``p.grad.copy_(g)`` for the reference, a fresh clone for ft (which
``donate=True`` may write into). ``torch.set_num_threads(--threads)`` (default 1).

Aliases and their references (the configurations of the reference tests in ``tests/``):

  sgd           ft.sgd(1e-2, momentum=0.9)
                vs torch.optim.SGD(lr=1e-2, momentum=0.9, fused=True)
  adam          ft.adam(1e-3)
                vs torch.optim.Adam(lr=1e-3, fused=True)
  adamw         ft.adamw(1e-3, weight_decay=0.1)
                vs torch.optim.AdamW(lr=1e-3, weight_decay=0.1, fused=True)
  adafactor     ft.adafactor()
                vs transformers.optimization.Adafactor(lr=None, scale_parameter=True,
                   relative_step=True, warmup_init=False)
  adafactor_momentum
                ft.adafactor(beta1=0.9, weight_decay=0.01)
                vs transformers.optimization.Adafactor(the same, beta1=0.9, weight_decay=0.01)
                (a chain: the factored statistics, then the clip, the parameter scale, the
                learning rate, ema(0.9), the decay and scale(-1), one fused pass after the
                RMS)
  came          ft.came(2e-4, weight_decay=0.01)
                vs came_pytorch.CAME(lr=2e-4, weight_decay=0.01)
  galore_adamw  ft.galore_adamw(1e-3, weight_decay=0.1, rank=128, update_proj_gap=200,
                                scale=0.25, labels=ft.galore_param_labels(params))
                vs galore_torch.GaLoreAdamW(lr=1e-3, weight_decay=0.1) with Colossal-AI's groups:
                   the 2-D leaves {rank 128, update_proj_gap 200, scale 0.25, proj_type "std"},
                   ``b1`` (plain AdamW with decay), the norms {weight_decay 0} (plain AdamW
                   without)
  adamw8bit     ft.adamw(1e-3, weight_decay=0.1, optim_bits=8)
                vs bitsandbytes.optim.AdamW8bit(lr=1e-3, weight_decay=0.1) on CPU
                (both: 8-bit moments for leaves of >= 4096 elements, blocks of 256; every last
                dim here is a multiple of 256, so the blocks coincide)

Per alias the three systems (reference, ft pure, ft donate) start from the same parameters and
run interleaved, round by round, each once per round, each round in an order of its own
(``bench_engine.run_rounds``: a seeded shuffle; gc off, a system that raises is dropped with a
note):
``--warmup`` (default 1) untimed rounds, then ``--rounds`` (default 5) timed ones; the ft
systems run as a training loop (``params, state = ft.step(...)``, the results feed the next
round). The default run of all eight aliases takes
about 35 s on 2 shared cores (the longest adamw8bit: bitsandbytes 0.50.2's step ~0.27 s, ft's
~0.2 s through its compiled kernel, which compiles on ft's first step).
GaLore's first step computes the SVD of every projected gradient (galore-torch and ft alike; the
next refresh would be at step 201): that step is the warm-up round, so the timed rounds are
projection-only steps. The ``step 1`` column gives the first (warm-up) step's time of every
system (state allocation, ft's plan building; for GaLore the SVDs).

Tables: (1) median ms/step of the reference, ft pure and ft donate, the ratios ft / reference
(< 1: ft is faster), the first step, and the median minor page faults during a step (see
bench_engine); (2) correctness after all ``warmup + rounds`` steps, ft against the reference:
the largest over the leaves of ``max|p_ft - p_ref| / max|p_ref - p_0|`` (the parameter
difference relative to the reference's change of that leaf), ``||p_ft - p_ref|| / ||p_ref -
p_0||`` over the whole tree, and "ok" when every element is within ``1e-5 * max|p_ref - p_0|``
of its leaf plus ``steps`` float32 ulps of the largest magnitude it took: both runs store the
parameter in float32 after every step, and the norms, at 1.0, move by ~1e-4 .. 1e-3 per step, so
one ulp (1.2e-7) there is already 1e-4 .. 1e-3 of their change (the worst-leaf column shows this
for adafactor, came and galore; the matrices agree to ~1e-5). 8-bit: bitsandbytes' CPU optimizer
re-quantises its moments with a C kernel whose rounding differs from its reference kernel, which
ft implements; small elements of a block then get different codes, and the runs drift apart
(several % of the change over a few steps with these constant gradients).
``--bnb-reference-rounding`` patches bitsandbytes to re-quantise with its reference kernel (as
tests/test_quantization.py does): the runs then agree to float32 ulps, and bitsandbytes' step
becomes ~4x slower.

    python benchmarks/bench_aliases.py [--only sgd,adamw,...] [--rounds 5] [--warmup 1]
                                       [--threads 1] [--bnb-reference-rounding]
"""

import argparse
import gc
import logging
import math
import os
import shlex
import statistics
import sys
import time
import warnings

import torch

import functional_train as ft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import PureLoop, gpt_shapes, make_problem, n_params, run_rounds  # noqa: E402


# -- aliases ----------------------------------------------------------------------------------
def _torch(cls, **kw):
    return lambda hp: cls(list(hp.values()), **kw)


def _adafactor_ref(hp):
    from transformers.optimization import Adafactor

    return Adafactor(
        list(hp.values()), lr=None, scale_parameter=True, relative_step=True, warmup_init=False
    )


def _adafactor_momentum_ref(hp):
    from transformers.optimization import Adafactor

    return Adafactor(
        list(hp.values()),
        lr=None,
        scale_parameter=True,
        relative_step=True,
        warmup_init=False,
        beta1=0.9,
        weight_decay=0.01,
    )


def _came_ref(hp):
    from came_pytorch import CAME

    return CAME(list(hp.values()), lr=2e-4, weight_decay=0.01)


GALORE = dict(rank=128, update_proj_gap=200, scale=0.25)


def _galore_ref(hp):
    with warnings.catch_warnings():  # galore-torch imports bitsandbytes, which warns without a GPU
        warnings.simplefilter("ignore")
        from galore_torch import GaLoreAdamW
    labels = ft.galore_param_labels(hp)
    groups = [
        dict(params=[p for k, p in hp.items() if labels[k] == "galore"], proj_type="std", **GALORE),
        dict(params=[p for k, p in hp.items() if labels[k] == "decay"]),
        dict(params=[p for k, p in hp.items() if labels[k] == "no_decay"], weight_decay=0.0),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation warning
        return GaLoreAdamW([g for g in groups if g["params"]], lr=1e-3, weight_decay=0.1)


def _galore_tx(params):
    return ft.galore_adamw(
        1e-3, weight_decay=0.1, labels=ft.galore_param_labels(params), proj_type="std", **GALORE
    )


def _bnb_ref(hp):
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(list(hp.values()), lr=1e-3, weight_decay=0.1)


# name -> (reference label, reference factory(dict of nn.Parameter), tx factory(params))
ALIASES = {
    "sgd": (
        "torch.optim.SGD(momentum=0.9, fused=True)",
        _torch(torch.optim.SGD, lr=1e-2, momentum=0.9, fused=True),
        lambda p: ft.sgd(1e-2, momentum=0.9),
    ),
    "adam": (
        "torch.optim.Adam(fused=True)",
        _torch(torch.optim.Adam, lr=1e-3, fused=True),
        lambda p: ft.adam(1e-3),
    ),
    "adamw": (
        "torch.optim.AdamW(wd=0.1, fused=True)",
        _torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, fused=True),
        lambda p: ft.adamw(1e-3, weight_decay=0.1),
    ),
    "adafactor": (
        "transformers Adafactor(lr=None, relative_step)",
        _adafactor_ref,
        lambda p: ft.adafactor(),
    ),
    "adafactor_momentum": (
        "transformers Adafactor(beta1=0.9, wd=0.01)",
        _adafactor_momentum_ref,
        lambda p: ft.adafactor(beta1=0.9, weight_decay=0.01),
    ),
    "came": (
        "came_pytorch.CAME(lr=2e-4, wd=0.01)",
        _came_ref,
        lambda p: ft.came(2e-4, weight_decay=0.01),
    ),
    "galore_adamw": ("galore_torch.GaLoreAdamW(rank=128, gap=200)", _galore_ref, _galore_tx),
    "adamw8bit": (
        "bitsandbytes AdamW8bit (CPU)",
        _bnb_ref,
        lambda p: ft.adamw(1e-3, weight_decay=0.1, optim_bits=8),
    ),
}


# -- systems ----------------------------------------------------------------------------------
class Reference:
    """A torch.optim-style optimizer stepping nn.Parameters in place."""

    def __init__(self, name, make_opt, params0, grads0):
        self.name = name
        self.hp = {k: torch.nn.Parameter(v.clone()) for k, v in params0.items()}
        self.gsrc = grads0
        for k, p in self.hp.items():
            p.grad = grads0[k].clone()
        self.opt = make_opt(self.hp)

    def prepare(self):
        with torch.no_grad():
            for k, p in self.hp.items():
                p.grad.copy_(self.gsrc[k])

    def step(self):
        self.opt.step()

    def params(self):
        return {k: p.detach() for k, p in self.hp.items()}


class FtLoop(PureLoop):
    """``params, state = ft.step(tx, grads, state, params, donate=...)`` as a training loop."""

    def __init__(self, name, tx, donate, params0, grads0):
        super().__init__(
            name, lambda g, s, p: ft.step(tx, g, s, p, donate=donate), tx, params0, grads0
        )

    def params(self):
        return self.p


# -- correctness ------------------------------------------------------------------------------
def ulp(x):
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def compare(ours, ref, p0, steps, rtol=1e-5):
    """ours vs the reference after ``steps`` steps from ``p0``. Returns (largest over leaves of
    ``max|ours - ref| / max|ref - p0|``; ``||ours - ref|| / ||ref - p0||`` over the whole tree;
    whether every element is within ``rtol * max|ref - p0|`` of its leaf plus ``steps`` float32
    ulps of the largest magnitude it took (the storage rounding of both runs); all finite)."""
    worst, err2, ch2, ok, finite = 0.0, 0.0, 0.0, True, True
    for k, r in ref.items():
        a, r, p = ours[k].detach().double(), r.detach(), p0[k]
        finite = finite and bool(torch.isfinite(a).all())
        err = (a - r.double()).abs()
        change = (r.double() - p.double()).abs()
        e, c = float(err.max()), float(change.max())
        err2 += float(err.square().sum())
        ch2 += float(change.square().sum())
        if e:
            worst = max(worst, e / c if c else math.inf)
            mag = torch.maximum(torch.maximum(a.abs(), r.abs().double()), p.abs().double())
            mag = mag.to(r.dtype)
            ok = ok and bool((err <= rtol * c + steps * ulp(mag).double()).all())
    return worst, math.sqrt(err2 / ch2) if ch2 else math.inf, ok, finite


# -- main -------------------------------------------------------------------------------------
def patch_bnb_reference_rounding():
    """Make bitsandbytes' CPU 8-bit optimizer requantise its moments with bitsandbytes' own
    reference (PyTorch) kernel of ``quantize_blockwise`` instead of its C kernel, whose rounding
    differs (as tests/test_quantization.py does); ft implements the reference rounding."""
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    import bitsandbytes.backends.cpu.ops as cpu_ops

    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)

    def requantize(A, code, absmax_out, out, blocksize):
        q, a = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
            keys, A, code, blocksize
        )
        out.copy_(q)
        absmax_out.copy_(a)

    assert hasattr(cpu_ops, "_quant_blockwise_fp32_direct"), "bitsandbytes changed its CPU ops"
    cpu_ops._quant_blockwise_fp32_direct = requantize


def run_alias(name, args, params0, grads0):
    label, make_ref, make_tx = ALIASES[name]
    try:
        ref = Reference(label, make_ref, params0, grads0)
    except Exception as e:  # noqa: BLE001 - e.g. a missing reference package: skip the alias
        print(f"note: {name}: reference unavailable, skipped: {type(e).__name__}: {e}")
        return None
    systems = [
        ref,
        FtLoop("ft.step(donate=False)", make_tx(params0), False, params0, grads0),
        FtLoop("ft.step(donate=True)", make_tx(params0), True, params0, grads0),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times, faults, warm = run_rounds(
            systems, args.rounds, args.warmup, log=lambda m: print(f"note: {name}: {m[6:]}")
        )
    if ref.name not in times:
        print(f"note: {name}: the reference failed; skipped")
        return None
    steps = args.warmup + args.rounds
    nan = math.nan
    row = {
        "name": name,
        "ref": label,
        "steps": steps,
        "ms": [],
        "first": [],
        "faults": [],
        "checks": [],
    }
    p_ref = ref.params()
    for i, s in enumerate(systems):
        ok = s.name in times
        row["ms"].append(statistics.median(times[s.name]) * 1e3 if ok else nan)
        row["faults"].append(statistics.median(faults[s.name]) if ok else nan)
        row["first"].append(warm[s.name][0] * 1e3 if warm.get(s.name) else nan)
        if i:
            row["checks"].append(
                compare(s.params(), p_ref, params0, steps) if ok else (nan, nan, False, False)
            )
    return row


def print_tables(rows):
    print(
        f"\n  {'alias':<13s} {'reference':<49s} {'ref ms':>7s} {'pure ms':>8s} {'don. ms':>8s} "
        f"{'pure/ref':>8s} {'don/ref':>7s}  {'step 1 ms ref/pure/don':>22s}  "
        f"{'faults ref/pure/don':>19s}"
    )
    for r in rows:
        ms, first, nf = r["ms"], r["first"], r["faults"]
        print(
            f"  {r['name']:<13s} {r['ref']:<49s} {ms[0]:7.1f} {ms[1]:8.1f} {ms[2]:8.1f} "
            f"{ms[1] / ms[0]:8.2f} {ms[2] / ms[0]:7.2f}  "
            f"{'/'.join(f'{t:.0f}' for t in first):>22s}  "
            f"{'/'.join(f'{n:.0f}' for n in nf):>19s}"
        )
    print(
        f"\n  correctness after all steps, ft vs reference (pure | donate):\n"
        f"  {'alias':<13s} {'steps':>5s}  {'max|dp|/max|change| (worst leaf)':>33s}  "
        f"{'||dp|| / ||change|| (tree)':>27s}  verdict"
    )
    for r in rows:
        (w1, l1, ok1, f1), (w2, l2, ok2, f2) = r["checks"]
        if not (f1 and f2):
            verdict = "NOT FINITE"
        elif ok1 and ok2:
            verdict = "ok: within 1e-5 of the change + float32 storage ulps"
        elif r["name"] == "adamw8bit":
            verdict = "differs: 8-bit requantisation rounding (see the docstring)"
        else:
            verdict = "LARGE DIFFERENCE"
        print(
            f"  {r['name']:<13s} {r['steps']:5d}  {f'{w1:.1e} | {w2:.1e}':>33s}  "
            f"{f'{l1:.1e} | {l2:.1e}':>27s}  {verdict}"
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default=None, help="comma-separated aliases: " + ",".join(ALIASES))
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds first (GaLore's SVD step)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument(
        "--bnb-reference-rounding",
        action="store_true",
        help="adamw8bit: bitsandbytes requantises with its reference kernel (slower)",
    )
    args = ap.parse_args()
    names = (
        list(ALIASES)
        if args.only is None
        else [n.strip() for n in args.only.split(",") if n.strip()]
    )
    bad = [n for n in names if n not in ALIASES]
    if bad:
        ap.error(f"unknown alias(es) {bad}; choose from {list(ALIASES)}")
    if args.warmup < 1 or args.rounds < 1:
        ap.error(
            "--warmup and --rounds must be >= 1 (the first step allocates the state; "
            "GaLore's does the SVDs)"
        )

    torch.set_num_threads(args.threads)
    shapes = gpt_shapes()
    params0, grads0 = make_problem(shapes)
    print("command: " + shlex.join(["python"] + sys.argv))
    print(
        f"torch {torch.__version__}; {torch.get_num_threads()} thread(s); GPT-like tree "
        f"{n_params(shapes):,} float32 params in {len(shapes)} leaves; per alias {args.warmup} "
        f"warm-up + {args.rounds} timed rounds, reference / ft pure / ft donate interleaved; "
        f"median ms/step"
    )
    if "adamw8bit" in names and args.bnb_reference_rounding:
        try:
            patch_bnb_reference_rounding()
            ALIASES["adamw8bit"] = (
                "bitsandbytes AdamW8bit (CPU, reference rounding)",
                *ALIASES["adamw8bit"][1:],
            )
        except Exception as e:  # noqa: BLE001
            print(f"note: --bnb-reference-rounding unavailable: {type(e).__name__}: {e}")
    rows = []
    for name in names:
        gc.collect()
        t0 = time.perf_counter()
        r = run_alias(name, args, params0, grads0)
        if r is not None:
            rows.append(r)
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print_tables(rows)


if __name__ == "__main__":
    main()
