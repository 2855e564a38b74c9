#!/usr/bin/env bash
# Issue 8's GPU rows, for a machine with an NVIDIA GPU and JAX, flax, optax, chex, orbax, tqdm
# installed (the lent H100/H200 image has them; ml_collections is carried as a wheel:
# `bash scripts/gpu_bench.sh --fetch-wheels` here, then carry `.whl` there).
#
#   bash scripts/gpu_bench.sh [OUTDIR [BENCH[:ARGS] ...]]
#       OUTDIR default: $OUT if set, else runs/gpu_bench (in the repo; a relative OUTDIR given
#       is the current directory's); BENCH default: all four benches.
#   bash scripts/gpu_bench.sh "$OUT" bench_update bench_train_step      # one device call
#   bash scripts/gpu_bench.sh "$OUT" "bench_virtual_workers:--shapes 4x256,8x128"
#   bash scripts/gpu_bench.sh "$OUT" "bench_virtual_workers:--shapes 16x64 --fastpath-variants"
#       (decides fastpath's update_in_place default on GPU: BENCHMARKS.md, target 4)
#   (the open measurements, as numbered calls of this script: scripts/gpu_plan.sh --list)
#   BENCH_ARGS=--quick PYTHON=.venv/bin/python bash scripts/gpu_bench.sh /tmp/x   # smoke test
#
# Writes OUTDIR/<bench>.json (every figure as data) and OUTDIR/<bench>.log (the FIG/TARGET
# lines) and prints the header and RESULT lines. The device machine gets a copy of the working
# tree without .git: prefix the call with MFOPT_COMMIT=<sha> (computed here) so the JSON
# records the code's commit. Back here, `python -m experiments.bench_tables <files_at>` turns
# the JSON into BENCHMARKS.md rows (device, date, JAX, command, commit, every target). Time: a device call may run 10 minutes and
# nothing compiled survives between machines, so split the benches over calls (ResNet-18/50
# compile once per variant and shape; bench_virtual_workers compiles ~10 steps per shape:
# give it two or three shapes per call with --shapes).
set -uo pipefail
caller=$PWD  # a relative OUTDIR is the caller's, not the repo's
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fetch-wheels" ]]; then  # run where pip can reach PyPI
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl ml_collections
  exit $?
fi
out="${1:-${OUT:-runs/gpu_bench}}"
[[ -z "${1:-}" || "$out" == /* ]] || out="$caller/$out"
shift || true
benches=("$@")
if [[ ${#benches[@]} -eq 0 ]]; then
  benches=(bench_update bench_train_step bench_virtual_workers bench_comm)
fi
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" || exit 1
fi
export PYTHONUNBUFFERED=1
# JAX's persistent compilation cache inside the repository (ignored by git): the device
# machine keeps ignored files of the working tree between calls while it stays warm, so a
# program compiled in one call (e.g. unroll's, the slowest) loads from the cache in the next.
export MFOPT_JAX_CACHE="${MFOPT_JAX_CACHE:-$PWD/.jax_cache/gpu}"
py="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  || true  # (printed only: the device tool returns at most 8 files)
status=0
for spec in "${benches[@]}"; do
  bench="${spec%%:*}"
  extra=""
  [[ "$spec" == *:* ]] && extra="${spec#*:}"
  name="$bench"  # output names: letters, digits, '.', '_', '-' only (the device tool's rule)
  [[ -n "$extra" ]] && name="${bench}_$(printf '%s' "$extra" | tr -c 'A-Za-z0-9._-' '_')"
  # shellcheck disable=SC2086  # BENCH_ARGS and extra are word lists on purpose
  # BENCH_TIMEOUT (seconds): a bench still running then is stopped; its JSON, written after
  # every figure, keeps what it measured ("complete": false), so later benches still run.
  timeout --signal=INT --kill-after=20 "${BENCH_TIMEOUT:-0}" \
    "$py" -m "experiments.$bench" ${BENCH_ARGS:-} $extra --json "$out/$name.json" 2>&1 \
    | tee "$out/$name.log" | grep -E "^(#|RESULT|Traceback|[A-Za-z]*Error)" || status=1
done
exit $status
