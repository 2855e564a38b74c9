#!/usr/bin/env bash
# Deviceless XLA:GPU compilation (no GPU needed): the compiled H100 programs of issue 8's steps.
#
#   bash scripts/gpu_aot.sh [OUTDIR]        # default OUTDIR: runs/gpu_aot
#
# Builds .venv-gpu-aot (mfopt[dev] plus the JAX CUDA plugin of the same JAX version, ~6 GB
# with the CUDA wheels, `du -sh .venv-gpu-aot` 2026-11-24; a separate environment so the
# main .venv stays CPU-only), then runs
#   python -m experiments.bench_comm --platform gpu-aot   (bf16 all-reduce operands, 8 x H100)
#   python -m experiments.bench_gpu_hlo                    (convolutions, launches, buffers)
#   python -m experiments.bench_update --platform gpu-aot  (every update's traffic vs optax's)
#   pytest tests/test_gpu_aot.py                           (its deviceless tests run here)
# and writes OUTDIR/<bench>.json and .log. Nothing executes on a GPU: figures are structure
# (what XLA:GPU emitted), never timings. See experiments/_gpu_aot.py and BENCHMARKS.md.
VENV=.venv-gpu-aot
caller=$PWD  # a relative OUTDIR is the caller's, not the repo's
source "$(dirname "$0")/_venv.sh"
if ! "$PY" -c "import jax_plugins.xla_cuda12" 2>/dev/null; then
  version=$("$PY" -c "import jax; print(jax.__version__)")
  "$PY" -m pip install --quiet "jax-cuda12-plugin[with-cuda]==$version"
fi
out="${1:-runs/gpu_aot}"
[[ -z "${1:-}" || "$out" == /* ]] || out="$caller/$out"
mkdir -p "$out"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
status=0
"$PY" -m experiments.bench_comm --platform gpu-aot --json "$out/bench_comm.json" 2>&1 \
  | tee "$out/bench_comm.log" | grep -E "^(#|RESULT)" || status=1
"$PY" -m experiments.bench_gpu_hlo --json "$out/bench_gpu_hlo.json" 2>&1 \
  | tee "$out/bench_gpu_hlo.log" | grep -E "^(#|RESULT|FIG bench_gpu_hlo \| [345])" || status=1
"$PY" -m experiments.bench_update --platform gpu-aot --json "$out/bench_update_gpu_aot.json" 2>&1 \
  | tee "$out/bench_update_gpu_aot.log" | grep -E "^(#|RESULT)" || status=1
"$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_aot.py || status=1
exit $status
