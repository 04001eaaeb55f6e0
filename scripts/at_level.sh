#!/usr/bin/env bash
# Run a command with torch, oneDNN and MKL held to a lower x86-64 level than this CPU's: DEFAULT, AVX2 or AVX512.
#
#   scripts/at_level.sh AVX2 bench run suites/perf_prefill.yaml
#
# What a CPU of that level would run (torch's kernels, blocked's kernels built for that level, oneDNN's and MKL's
# GEMMs), on this CPU's caches, memory and clock: the records say the level (`device`, `config.gemm`,
# `config.engine`), and a figure measured this way is named as such wherever it is cited. Inductor (flex) keeps a
# cache of its own per level: its cache keys do not include ATEN_CPU_CAPABILITY, and a kernel compiled at one level
# and loaded at another gave wrong outputs here.
set -euo pipefail
level="${1:?usage: scripts/at_level.sh DEFAULT|AVX2|AVX512 COMMAND...}"
shift
case "$level" in
  DEFAULT) onednn=SSE41 mkl=SSE4_2 ;;
  AVX2) onednn=AVX2 mkl=AVX2 ;;
  AVX512) onednn=AVX512_CORE mkl=AVX512 ;;
  *) echo "level: DEFAULT, AVX2 or AVX512, not $level" >&2; exit 2 ;;
esac
export ATEN_CPU_CAPABILITY="${level,,}" ONEDNN_MAX_CPU_ISA="$onednn" MKL_ENABLE_INSTRUCTIONS="$mkl"
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor-$(id -u)-${level,,}"
exec "$@"
