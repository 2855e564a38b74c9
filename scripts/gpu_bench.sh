#!/usr/bin/env bash
# Issue 8's GPU rows in one command, for a machine with an NVIDIA GPU and JAX, flax, optax,
# chex, orbax, tqdm installed (the lent H100/H200 image has them; ml_collections is carried as
# a wheel: `bash scripts/gpu_bench.sh --fetch-wheels` here, then carry `.whl` there).
#
#   bash scripts/gpu_bench.sh [OUTDIR]      # default OUTDIR: $OUT if set, else runs/gpu_bench
#   BENCH_ARGS=--quick bash scripts/gpu_bench.sh /tmp/x   # smoke test of this script
#
# Writes OUTDIR/<bench>.json (every figure as data) and OUTDIR/<bench>.log (the FIG/TARGET
# lines), prints the RESULT lines. Budget on an H100: the four benches compile ResNet-18/50
# several times; give it the full 10 minutes of one call.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fetch-wheels" ]]; then  # run where pip can reach PyPI
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections
  exit $?
fi
out="${1:-${OUT:-runs/gpu_bench}}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" || exit 1
fi
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  || true  # (printed only: the device tool returns at most 8 files, the 4 JSON + 4 logs)
status=0
for bench in bench_update bench_train_step bench_virtual_workers bench_comm; do
  "$py" -m "experiments.$bench" ${BENCH_ARGS:-} --json "$out/$bench.json" 2>&1 | tee "$out/$bench.log" \
    | grep -E "^(#|RESULT)" || status=1
done
exit $status
