#!/usr/bin/env bash
# The checks and benchmarks a session runs on a lent CUDA machine (the device tool), as one
# script: the environment, the device-generic tests on CUDA, and bench_compose on CUDA.
# Usage there: bash benchmarks/device_checks.sh [step ...]
# (steps: env tests compose compose-block prof tprof positions compose-compile gc; T_TESTS, T_THREADS and T_COMPILE
# set those steps' time limits in seconds, ROWS and ROUNDS the rows and rounds of compose).
# Run every benchmark through this script there: it puts the checkout on PYTHONPATH.
# Logs go to $OUT (or /tmp/device_checks when OUT is unset); each step has its own time limit.
# The machine's python3 holds a CUDA torch; optree travels as a wheel in .whl (see the
# device tool's README), installed into /tmp/site.
set -u
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
steps=${*:-env tests compose}
for s in $steps; do
  echo "=== $s $(date +%T)"
  case $s in
    env)
      nvidia-smi -L
      python3 -c 'import torch, optree; print("torch", torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(), "optree", optree.__version__)'
      FT_FUSED_DEBUG=1 timeout 120 python3 -W always -c 'import torch, functional_train as ft
p = {"w": torch.randn(64, 32, device="cuda"), "b": torch.randn(32, device="cuda")}
g = {k: torch.randn_like(v) for k, v in p.items()}
tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-3))
s = tx.init(p)
p2, s2 = ft.step(tx, g, s, p)
print("ft.step on cuda:", {k: float((p2[k] - p[k]).abs().max()) for k in p})
from functional_train.engine import fuse_triton
from functional_train.engine import fuse
print("triton:", fuse_triton.available(p["w"].device),
      "kernels:", [type(k).__name__ for k in fuse._kernels.values()])' 2>&1 | tail -20
      ;;
    tests)
      timeout ${T_TESTS:-180} python3 -m pytest -q -n 8 -p no:cacheprovider --device cuda \
        tests/test_fused.py tests/test_fused_wrappers.py tests/test_bad_input.py 2>&1 | tee "$OUT/tests_cuda.log" | tail -40
      # (steps in threads: CUDA's caching allocator, not the pool, makes a pure step's results)
      timeout ${T_THREADS:-180} python3 -m pytest -q -n 8 -p no:cacheprovider --device cuda \
        tests/test_threads.py 2>&1 | tee "$OUT/tests_threads_cuda.log" | tail -20
      ;;
    compose)  # ROWS: a comma-separated subset of the rows (default: every row)
      timeout 240 python3 benchmarks/bench_compose.py --device cuda --rounds "${ROUNDS:-7}" \
        ${ROWS:+--rows "$ROWS"} 2>&1 | tee "$OUT/bench_compose_cuda.txt" | tail -45
      ;;
    compose-block)  # the generated kernels' block size, on two rows
      for b in ${BLOCKS:-4096}; do
        FT_TRITON_BLOCK=$b timeout 120 python3 benchmarks/bench_compose.py --device cuda \
          --rounds 7 --rows adamw,primitives 2>&1 | tee "$OUT/bench_compose_cuda_block$b.txt" \
          | grep -E "^row|\(c\)|\(d\)|\(a\)"
      done
      ;;
    prof)  # host time by function (cProfile) of donated steps
      timeout 150 python3 benchmarks/profile_step.py --device cuda --rows "${ROWS:-primitives,multi_steps}" 2>&1 \
        | tee "$OUT/prof_cuda.txt" | grep -E "#####|tottime|^ +[0-9]" | head -400
      ;;
    tprof)  # torch.profiler of donated steps (launches, copies, synchronisations)
      timeout 150 python3 benchmarks/profile_step.py --device cuda --tool torch \
        --rows "${ROWS:-primitives,multi_steps}" 2>&1 | tee "$OUT/tprof_cuda.txt" | tail -80
      ;;
    positions)  # host time and time to a synchronisation per call position, tables copied
      timeout 150 python3 benchmarks/profile_step.py --device cuda --tool positions \
        --rows "${ROWS:-multi_steps,primitives}" 2>&1 | tee "$OUT/positions_cuda.txt" | tail -40
      ;;
    compose-compile)  # (torch >= 2.13: older dynamo does not trace the step)
      if ! python3 -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13))'; then
        echo "compose-compile: skipped, torch $(python3 -c 'import torch; print(torch.__version__)') < 2.13"
        continue
      fi
      timeout ${T_COMPILE:-240} python3 benchmarks/bench_compose.py --device cuda --rounds 5 --compile \
        --rows "${ROWS:-primitives}" 2>&1 | tee "$OUT/bench_compose_cuda_compile.txt" | tail -30
      ;;
    gc)  # Python's garbage collector on / frozen / off in a loop, each system its own process
      timeout 300 python3 benchmarks/bench_gc.py --device cuda --repeats 1 --cycles 600 \
        --rows "${ROWS:-multi_steps}" 2>&1 | tee "$OUT/bench_gc_cuda.txt" | tail -12
      ;;
    *) echo "unknown step $s";;
  esac
done
