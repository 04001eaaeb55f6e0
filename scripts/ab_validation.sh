#!/usr/bin/env bash
# Reproduces the figures of docs/ci.md on this machine: `bench ab` of a commit against itself (A/A, repeated),
# against a throwaway branch that makes `blocked` about 10% slower and one about 5% slower, and the wall time of
# one plain `bench run` of the same suite for scale.
#
#   scripts/ab_validation.sh [OUT_DIR]          (default OUT_DIR: docs/ab/<date>)
#   env: PY (python with the project installed; default .venv/bin/python), SUITE (default suites/smoke.yaml),
#        REPEATS (A/A repetitions, default 5), ROUNDS (default: bench ab's), IMPL (planted, default blocked),
#        PLANTS (planted slowdowns in percent, default "10 5"), SMOKE_RUN=0 (skip the plain bench run),
#        ONLY (run only these runs, e.g. "planted-5"), AB_ARGS (more bench ab arguments, e.g. "--impl blocked")
#
# Everything runs in a clean clone of HEAD in a temporary directory (the planted branches live and die there;
# the working tree is not touched). Per run OUT_DIR gets the `--json` and `--markdown` outputs; summary.json and
# summary.md (written by scripts/ab_summary.py) hold the verdict counts, exit codes, wall times, the share of
# the planted implementation's pairs read SLOWER, what else was flagged, and the same recomputed from the saved
# per-round medians at a 10% threshold.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
out=${1:-$repo/docs/ab/$(date -u +%Y%m%d)}
PY=${PY:-$repo/.venv/bin/python}
SUITE=${SUITE:-suites/smoke.yaml}
REPEATS=${REPEATS:-5}
IMPL=${IMPL:-blocked}
PLANTS=${PLANTS:-"10 5"}
rounds=()
if [ -n "${ROUNDS:-}" ]; then rounds=(--rounds "$ROUNDS"); fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/bench-ab-validation.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/repo"
cd "$work/repo"
base=$(git rev-parse HEAD)
store="$work/results"

plant() {  # a branch whose $IMPL spends $1% more time in every call (a busy wait proportional to its own time)
  local pct=$1
  git checkout -q -b "planted-$pct" "$base"
  "$PY" "$repo/scripts/ab_plant.py" "impls/$IMPL" "$pct"
  git -c user.name=validation -c user.email=validation@localhost commit -qam "planted: $IMPL $pct% slower"
  git checkout -q --detach "$base"
}

timed() {  # NAME CMD...: runs CMD, writes NAME.json (stdout), NAME.md, NAME.log and NAME.meta (exit code, wall s)
  local name=$1; shift
  local start end code=0
  start=$(date +%s.%N)
  "$@" > "$out/$name.json" 2> "$out/$name.log" || code=$?
  end=$(date +%s.%N)
  printf '{"name": "%s", "exit_code": %d, "wall_s": %s, "started": "%s"}\n' "$name" "$code" \
    "$(echo "$end - $start" | bc)" "$(date -u -d "@${start%.*}" +%FT%TZ)" > "$out/$name.meta"
  echo "$name: exit $code, $(echo "$end - $start" | bc) s" >&2
}

ab() {  # NAME BASE NEW
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then return 0; fi
  # shellcheck disable=SC2086
  timed "$1" "$PY" -m bench ab "$2" "$3" "$SUITE" "${rounds[@]}" ${AB_ARGS:-} --out "$store" --json \
    --markdown "$out/$1.md"
}

for pct in $PLANTS; do plant "$pct"; done
if [ "${SMOKE_RUN:-1}" != 0 ] && [ -z "${ONLY:-}" ]; then  # SMOKE_RUN=0: keep the smoke-run.meta already in OUT_DIR
  timed smoke-run "$PY" -m bench run "$SUITE" --out "$store"
  rm -f "$out/smoke-run.json"
fi
first=${PLANTS%% *}
ab "planted-$first" "$base" "planted-$first"
ab aa-1 HEAD HEAD
for pct in ${PLANTS#"$first"}; do ab "planted-$pct" "$base" "planted-$pct"; done
for i in $(seq 2 "$REPEATS"); do ab "aa-$i" HEAD HEAD; done
"$PY" "$repo/scripts/ab_summary.py" "$out" --impl "$IMPL"
echo "summaries in $out" >&2
