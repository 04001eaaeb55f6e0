#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU: the GPU-marked tests, then the GPU suite(s), results under
# DIR, a short table printed last. Within 8 minutes on an H200 (a hard deadline: a suite cut short keeps its
# records and the table says how to resume it).
#
# Usage: scripts/gpu_check.sh DIR [--dry-run]
#   DIR        where results go: DIR/pytest_gpu.log, DIR/results/<run_id>/ per suite, DIR/summary.txt
#   --dry-run  no GPU needed: show the GPU tests and the suites' cases, run nothing
# Environment: PYTHON (default: python3), GPU_CHECK_BUDGET_S (default 480), GPU_TESTS_BUDGET_S (default 180).
#
# Nothing is installed from the network. The project's dependencies must be installed first
# (pip install -e . with torch already present); the script stops with a message if they are not.
set -uo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
DIR=$1; shift
DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        *) echo "gpu_check: unknown argument '$arg'; allowed: --dry-run" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
TESTS_BUDGET_S=${GPU_TESTS_BUDGET_S:-180}
TABLE_RESERVE_S=20
START=$(date +%s)
mkdir -p "$DIR/results" || exit 2
DIR=$(cd "$DIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton 3.9's default, said out loud
unset TRITON_INTERPRET  # the point is the compiled kernels

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }

if ! "$PY" -c "import torch, triton, pydantic, yaml, rich, scipy, bench.cli" 2>/dev/null; then
    echo "gpu_check: the project's dependencies are missing for $PY; install them first: pip install -e ." >&2
    exit 2
fi
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
if [[ -z $GPU_NAME && $DRY_RUN -eq 0 ]]; then
    echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); --dry-run shows the plan" >&2
    exit 2
fi
echo "gpu_check: GPU '${GPU_NAME:-none}', results under $DIR, budget ${BUDGET_S}s"

# >>> Suite selection: THE one place that decides which suites run, from the detected GPU. <<<
# First suites/gpu.yaml, the kernel comparison (Triton vs FlexAttention, SDPA, blocked: densities 5%..50%,
# forward and forward+backward) sized for this budget; then suites/gpu_workloads.yaml (grouped-query attention,
# packed documents, decode, neighbourhoods at GPU sizes); then the suite sized to the detected card's memory (bench.measure.hardware suite-for-gpu: rtx4090, a100, h100 - the
# last also on H200), with what is left of the budget: a suite cut short keeps its records and can be resumed.
# Without a detected card (dry run) the dense peer suite stands in.
choose_suites() {
    local gpu_name=$1 card_suite=""
    [[ -n $gpu_name ]] && card_suite=$("$PY" -m bench.measure.hardware suite-for-gpu --name "$gpu_name" 2>/dev/null)
    echo "suites/gpu.yaml suites/gpu_workloads.yaml ${card_suite:-suites/gpu_dense.yaml}"
}
SUITES=$(choose_suites "$GPU_NAME")

status=0
if [[ $DRY_RUN -eq 1 ]]; then
    "$PY" -m pytest -m gpu --collect-only -q 2>&1 | tail -n 25
    for suite in $SUITES; do
        "$PY" -m bench run "$suite" --dry-run --out "$DIR/results" || status=1
    done
    echo "gpu_check: dry run, nothing measured (suites: $SUITES)"
    exit $status
fi

# 1. GPU-marked tests (correctness of the compiled kernels; no timing)
echo "gpu_check: pytest -m gpu (at most ${TESTS_BUDGET_S}s)"
timeout --kill-after=10 "$TESTS_BUDGET_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider >"$DIR/pytest_gpu.log" 2>&1
tests_rc=$?
tail -n 5 "$DIR/pytest_gpu.log"
if [[ $tests_rc -ne 0 ]]; then
    status=1
    [[ $tests_rc -eq 124 || $tests_rc -eq 137 ]] && echo "gpu_check: GPU tests cut at ${TESTS_BUDGET_S}s"
fi

# 2. the suites, each under what is left of the budget; records are written as they are measured
RUN_DIRS=()
for suite in $SUITES; do
    budget=$(( $(left) - TABLE_RESERVE_S ))
    if (( budget < 30 )); then
        echo "gpu_check: no time left for $suite (budget ${BUDGET_S}s spent)"; status=1; continue
    fi
    before=$(ls -1 "$DIR/results")
    echo "gpu_check: bench run $suite (at most ${budget}s)"
    timeout --kill-after=10 "$budget" "$PY" -m bench run "$suite" --out "$DIR/results" >"$DIR/$(basename "$suite" .yaml).log" 2>&1
    rc=$?
    run_dir=$(comm -13 <(echo "$before") <(ls -1 "$DIR/results") | tail -n 1)
    [[ -n $run_dir ]] && RUN_DIRS+=("$DIR/results/$run_dir")
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "gpu_check: $suite cut at ${budget}s; its records so far are kept"; status=1
    elif [[ $rc -ne 0 ]]; then
        echo "gpu_check: $suite exited $rc (see $DIR/$(basename "$suite" .yaml).log)"; status=1
    fi
done

# 3. the table, last
echo "gpu_check: done in $(elapsed)s (GPU tests exit $tests_rc)"
if [[ ${#RUN_DIRS[@]} -gt 0 ]]; then
    "$PY" scripts/gpu_summary.py "${RUN_DIRS[@]}" | tee "$DIR/summary.txt"
fi
exit $status
