#!/usr/bin/env bash
# Issue 8's open GPU measurements as numbered device calls, in priority order (why each one:
# BENCHMARKS.md, "Session 8" and "Session 9"; what each bench does: its docstring). One call
# fits one device command (10 minutes): its benches share BENCH_BUDGET seconds (default 540),
# each getting an equal BENCH_TIMEOUT.
#
#   bash scripts/gpu_plan.sh --list           the calls
#   bash scripts/gpu_plan.sh --check          every call's benches with --quick on this machine
#                                             (their --shapes dropped): flags and code paths
#   bash scripts/gpu_plan.sh --check-list     the commands --check runs (the tests run them
#                                             in one process)
#   bash scripts/gpu_bench.sh --fetch-wheels  (here, once: ml_collections as a wheel in .whl)
#   then, on the device, with .whl carried:
#   MFOPT_COMMIT=<sha> bash scripts/gpu_plan.sh N "$OUT"
#
# Call 7 needs a machine with >= 2 GPUs. The JSON and logs land in OUTDIR (gpu_bench.sh);
# back here: copy them to benchmarks/<device>_<date>/ and run
# `python -m experiments.bench_tables benchmarks/<device>_<date>`.
set -uo pipefail
caller=$PWD  # a relative OUTDIR is the caller's, not the repo's
cd "$(dirname "$0")/.."
gpus() { local c; c=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); echo "${c:-0}"; }
declare -A CALLS=(
  # 4b stretch: unroll (never GPU-timed), lax.map, their GroupBatchNorm variants, the
  # sequential reference (6 programs, 2 of them unroll's: its compile is the slow one).
  [1]="bench_virtual_workers:--shapes 16x256 --stretch-only --bn-variants"
  # 4a with GroupBatchNorm, against the earlier vmap-over-groups design and a copying update.
  [2]="bench_virtual_workers:--shapes 16x64,4x256 --fastpath-variants"
  # profiles where a target may stay missed: 4a at 16x64, the stretch at 16x256.
  [3]="profile_step:--programs one,fast --shapes 16x64|profile_step:--programs one,unroll,map --shapes 16x256"
  # target 1's block momentum with flat state, target 3 with 25 repetitions, bn_impl='mfopt'.
  [4]="bench_update:--only block|bench_train_step:--periodic-only --reps 25|bench_train_step:--bn-variants"
  # CUDA-graph scheduling CONCURRENT for the stretch (may let unrolled replicas overlap).
  [5]="bench_virtual_workers:--shapes 16x256 --stretch-only --compiler-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
  # 4a and 4b at the other two shapes.
  [6]="bench_virtual_workers:--shapes 8x128,32x32"
  # >= 2 GPUs: bf16 all-reduce operands in the executed HLO; targets 2-3 data-parallel.
  [7]="bench_comm:--platform gpu|bench_train_step:--devices GPUS"
  # A gamble, last: XLA's experimental convolution fusion takes the convolutions into the
  # CUDA graph (one command buffer for the whole step in a deviceless compile, where the
  # convolutions become XLA's own loop kernels, not cuDNN: session 9), with CONCURRENT.
  [8]="bench_virtual_workers:--shapes 16x256 --stretch-only --compiler-option xla_gpu_experimental_enable_conv_fusion=true --compiler-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
  # What fit's 8-step dispatch bound (session 14, against an XLA:CPU deadlock) costs on a GPU.
  [9]="bench_fit_dispatch:"
)
BUDGET=${BENCH_BUDGET:-540}  # seconds per call, shared by its benches

specs_of() {  # call number -> one bench spec per line
  local IFS='|'
  for spec in ${CALLS[$1]}; do printf '%s\n' "$spec"; done
}

# --check's edit of a call's arguments for this CPU: shapes and repetitions dropped, CPU devices
CPU_ARGS='s/--shapes [^ ]+//; s/--platform gpu/--platform cpu/; s/--devices GPUS/--devices 8/;
  s/--reps [0-9]+//; s/  +/ /g; s/^ //; s/ $//'
check_commands() {  # every call's benches as --check runs them on a CPU: shapes dropped
  for n in $(printf '%s\n' "${!CALLS[@]}" | sort -n); do
    while IFS= read -r spec; do
      printf '%s\t%s\t%s\n' "$n" "${spec%%:*}" "$(printf '%s' "${spec#*:}" | sed -E "$CPU_ARGS")"
    done < <(specs_of "$n")
  done
}

case "${1:-}" in
  --list)
    for n in $(printf '%s\n' "${!CALLS[@]}" | sort -n); do
      echo "call $n:"; specs_of "$n" | sed 's/^/  /'
    done
    ;;
  --check-list)  # what --check runs, one "N<tab>bench<tab>args" line per bench (the tests)
    check_commands
    ;;
  --check)
    status=0
    while IFS=$'\t' read -r n bench args; do
      echo "call $n: $bench --quick $args"
      # shellcheck disable=SC2086  # args is a word list on purpose
      "${PYTHON:-.venv/bin/python}" -m "experiments.$bench" --quick $args > /dev/null 2>&1 \
        || { echo "  FAILED: python -m experiments.$bench --quick $args"; status=1; }
    done < <(check_commands)
    exit $status
    ;;
  [1-9])
    n=$1
    out="${2:-${OUT:-runs/gpu_plan}}"
    [[ -z "${2:-}" || "$out" == /* ]] || out="$caller/$out"
    [[ -n "${CALLS[$n]:-}" ]] || { echo "gpu_plan: no call $n (--list)"; exit 2; }
    mapfile -t specs < <(specs_of "$n")
    if [[ "${CALLS[$n]}" == *GPUS* ]]; then
      g=$(gpus)
      (( g >= 2 )) || { echo "gpu_plan: call $n needs >= 2 GPUs, this machine has $g"; exit 2; }
      specs=("${specs[@]//GPUS/$g}")
    fi
    export BENCH_TIMEOUT=$(( BUDGET / ${#specs[@]} ))
    echo "gpu_plan: call $n, ${#specs[@]} bench(es), BENCH_TIMEOUT=$BENCH_TIMEOUT s each"
    exec bash scripts/gpu_bench.sh "$out" "${specs[@]}"
    ;;
  *)
    echo "usage: bash scripts/gpu_plan.sh --list | --check | --check-list | N [OUTDIR]" >&2
    exit 2
    ;;
esac
