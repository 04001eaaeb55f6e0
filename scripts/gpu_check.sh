#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU: what the machine is, the GPU-marked tests, then the GPU suites,
# results under DIR, a short table printed last. Within about 9 minutes on an H200 (a hard deadline: a suite cut
# short keeps its records and the table says how to resume it).
#
# Usage: scripts/gpu_check.sh DIR [--dry-run]
#   DIR        where results go: DIR/machine.txt, DIR/pytest_gpu.log, DIR/<suite>.log, DIR/results/<run_id>/ per
#              suite, DIR/summary.txt
#   --dry-run  no GPU needed: show the GPU tests and the suites' cases, run nothing
# Environment: PYTHON (default: python3), GPU_CHECK_BUDGET_S (default 560), GPU_TESTS_BUDGET_S (default 140),
# GPU_CHECK_CARD_SUITE=1 (also the suite sized for the detected card, with what is left of the budget),
# GPU_CHECK_SUITES="suites/a.yaml ..." (these suites instead of the chosen ones: a rerun of a part).
#
# Nothing is installed from the network. The project's dependencies must be installed first
# (pip install -e . with torch already present); the script stops with a message if they are not.
set -uo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
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
BUDGET_S=${GPU_CHECK_BUDGET_S:-560}
TESTS_BUDGET_S=${GPU_TESTS_BUDGET_S:-140}
TABLE_RESERVE_S=20
START=$(date +%s)
mkdir -p "$DIR/results" || exit 2
DIR=$(cd "$DIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}  # Triton's default, said out loud
unset TRITON_INTERPRET  # the point is the compiled kernels

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }

if ! "$PY" -c "import torch, triton, pydantic, yaml, rich, scipy, bench.cli" 2>"$DIR/import_error.log"; then
    echo "gpu_check: the project's dependencies are missing for $PY; install them first: pip install -e ." >&2
    tail -n 3 "$DIR/import_error.log" >&2
    exit 2
fi
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
if [[ -z $GPU_NAME && $DRY_RUN -eq 0 ]]; then
    echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); --dry-run shows the plan" >&2
    exit 2
fi
echo "gpu_check: GPU '${GPU_NAME:-none}', results under $DIR, budget ${BUDGET_S}s"

# >>> Suite selection: THE one place that decides which suites run, from the detected GPU. <<<
# suites/gpu.yaml: the kernel comparison (Triton against FlexAttention and SDPA, block densities 5%..50%, forward
# and forward+backward); suites/gpu_workloads.yaml: Llama-3-8B's grouped-query shape (causal_local, packed
# documents, a softcap); suites/gpu_decode.yaml: one query over 128K keys, contiguous and through pages of 16;
# suites/gpu_model.yaml: two selectors at 32K and the built-in recall model. With GPU_CHECK_CARD_SUITE=1, then the suite sized to the detected card's memory
# (bench.measure.machine.hardware suite-for-gpu: rtx4090, a100, h100 - the last also on H200) with what is left.
choose_suites() {
    local gpu_name=$1 card_suite=""
    if [[ ${GPU_CHECK_CARD_SUITE:-0} == 1 ]]; then
        [[ -n $gpu_name ]] && card_suite=$("$PY" -m bench.measure.machine.hardware suite-for-gpu --name "$gpu_name" 2>/dev/null)
        card_suite=${card_suite:-suites/gpu_dense.yaml}
    fi
    echo "suites/gpu.yaml suites/gpu_workloads.yaml suites/gpu_decode.yaml suites/gpu_model.yaml $card_suite"
}
SUITES=${GPU_CHECK_SUITES:-$(choose_suites "$GPU_NAME")}  # GPU_CHECK_SUITES: these instead (a rerun of a part)
# Each suite's share of the budget after the tests, so that one slow suite cannot starve the ones after it
# (a share left unused passes on); the card suite takes what remains.
declare -A SHARE_S=([suites/gpu.yaml]=130 [suites/gpu_workloads.yaml]=110 [suites/gpu_decode.yaml]=50
                     [suites/gpu_model.yaml]=110)

status=0
if [[ $DRY_RUN -eq 1 ]]; then
    "$PY" -m pytest -m gpu --collect-only -q $(grep -l "pytest.mark.gpu" tests/test_*.py) 2>&1 | tail -n 40
    for suite in $SUITES; do
        "$PY" -m bench run "$suite" --dry-run --out "$DIR/results" || status=1
    done
    echo "gpu_check: dry run, nothing measured (suites: $SUITES)"
    exit $status
fi

# 0. the machine, for the note: GPU, driver, clocks, versions
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu \
        --format=csv 2>&1
    "$PY" - <<'EOF' 2>&1
import platform, torch, triton
p = torch.cuda.get_device_properties(0)
print(f"python {platform.python_version()} torch {torch.__version__} (CUDA {torch.version.cuda}) triton {triton.__version__}")
print(f"{p.name}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
EOF
} >"$DIR/machine.txt"
cat "$DIR/machine.txt"

# 1. GPU-marked tests (correctness of the compiled kernels, the device timer, NVML, memory; no timing asserted);
# GPU_TESTS_BUDGET_S=0 leaves them out (a rerun of a part)
tests_rc=0
if (( TESTS_BUDGET_S > 0 )); then
    echo "gpu_check: pytest -m gpu (at most ${TESTS_BUDGET_S}s)"
    # only the files that hold GPU tests: collecting the others needs packages a GPU image may lack
    GPU_TEST_FILES=$(grep -l "pytest.mark.gpu" tests/test_*.py)
    timeout --kill-after=10 "$TESTS_BUDGET_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider -o timeout=120 -rfE \
        $GPU_TEST_FILES >"$DIR/pytest_gpu.log" 2>&1
    tests_rc=$?
    tail -n 5 "$DIR/pytest_gpu.log"
else
    echo "gpu_check: GPU tests left out (GPU_TESTS_BUDGET_S=0)"
fi
if [[ $tests_rc -ne 0 ]]; then
    status=1
    [[ $tests_rc -eq 124 || $tests_rc -eq 137 ]] && echo "gpu_check: GPU tests cut at ${TESTS_BUDGET_S}s"
fi

# 2. the suites, each under its share (and what is left of the budget); records are written as they are measured
RUN_DIRS=()
carried=0
for suite in $SUITES; do
    share=$(( ${SHARE_S[$suite]:-100000} + carried ))
    budget=$(( $(left) - TABLE_RESERVE_S ))
    (( share < budget )) && budget=$share
    if (( budget < 30 )); then
        echo "gpu_check: no time left for $suite (budget ${BUDGET_S}s spent)"; status=1; continue
    fi
    before=$(ls -1 "$DIR/results")
    suite_start=$(date +%s)
    echo "gpu_check: bench run $suite (at most ${budget}s)"
    timeout --kill-after=10 "$budget" "$PY" -m bench run "$suite" --out "$DIR/results" >"$DIR/$(basename "$suite" .yaml).log" 2>&1
    rc=$?
    carried=$(( budget - ($(date +%s) - suite_start) ))
    (( carried < 0 )) && carried=0
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
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
    --format=csv >>"$DIR/machine.txt" 2>&1
if [[ ${#RUN_DIRS[@]} -gt 0 ]]; then
    timeout 60 "$PY" scripts/gpu_summary.py "${RUN_DIRS[@]}" | tee "$DIR/summary.txt"
fi
exit $status
