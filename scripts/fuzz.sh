#!/usr/bin/env bash
# libFuzzer runs of the two parsers memtide reads from users: the options table (MEMTIDE_* and
# the memtide items of PYTORCH_CUDA_ALLOC_CONF end there) and the hwloc XML topology loader
# (MEMTIDE_TOPOLOGY, memtide probe --topology). Each run uses ASan and UBSan; any crash, leak of
# memtide's, or error that does not name its input stops it.
#
# Usage: bash scripts/fuzz.sh [--runs N] [--only TARGET] [--ubsan-only] [--out FILE.md]
#   --runs N      inputs per target (default 20000: the short run of scripts/test.sh)
#   --only T      one target: options or topology_xml
#   --ubsan-only  UBSan without ASan (preset fuzz-ubsan): the topology loader forks per input, and
#                 an ASan process forks at ~150 inputs/s, too slow for 1e6; without ASan, ~380/s
#   --out FILE    also write the counts and results as Markdown (bench/results/fuzz/<date>-<machine>.md)
set -euo pipefail
args="$*"
cd "$(dirname "$0")/.."
runs=20000
out=""
only=""
preset=fuzz
sanitizers="ASan and UBSan"
while (($#)); do
  case "$1" in
    --runs) runs=${2:?--runs needs a number}; shift 2 ;;
    --out) out=${2:?--out needs a file}; shift 2 ;;
    --only) only=${2:?--only needs a target}; shift 2 ;;
    --ubsan-only) preset=fuzz-ubsan; sanitizers="UBSan (no ASan)"; shift ;;
    *) echo "fuzz.sh: unknown argument $1 (expected --runs N, --only TARGET, --ubsan-only or --out FILE)" >&2; exit 2 ;;
  esac
done
[[ "$runs" =~ ^[0-9]+$ ]] && ((runs > 0)) || { echo "fuzz.sh: --runs must be a whole number > 0, got $runs" >&2; exit 2; }
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }

targets=(options topology_xml)
if [ -n "$only" ]; then
  [[ " ${targets[*]} " == *" $only "* ]] || { echo "fuzz.sh: --only $only: expected one of: ${targets[*]}" >&2; exit 2; }
  targets=("$only")
fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" --target "${targets[@]/#/memtide_fuzz_}" >/dev/null
export LSAN_OPTIONS="suppressions=$PWD/tests/fuzz/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
declare -A seeds=([options]=tests/fuzz/corpus/options [topology_xml]=tests/data/topology)
declare -A max_len=([options]=256 [topology_xml]=16384)
# Topology::from_xml loads a user's file in a forked child first (hwloc crashes on some corrupt
# files), so each of its inputs costs a fork: under ASan a tenth of the runs.
declare -A share=([options]=1 [topology_xml]=10)
[ "$preset" = fuzz ] || share[topology_xml]=1
rows=()
for target in "${targets[@]}"; do
  mkdir -p "$work/$target"
  cp "${seeds[$target]}"/* "$work/$target/"
  start=$(date +%s)
  log="$work/$target.log"
  n=$(( runs / share[$target] > 0 ? runs / share[$target] : 1 ))
  if ./build/$preset/tests/fuzz/memtide_fuzz_$target -runs="$n" -seed=1 -max_len="${max_len[$target]}" \
      -artifact_prefix="$work/" "$work/$target" >"$log" 2>&1; then
    result=passed
  else
    result=FAILED
    tail -40 "$log" >&2
  fi
  done_runs=$(grep -o 'Done [0-9]* runs' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  secs=$(($(date +%s) - start))
  echo "fuzz $target: $result, $done_runs inputs in $secs s, coverage $cov edges"
  rows+=("| $target | $done_runs | $cov | $secs | $result |")
  [ "$result" = passed ] || failed=1
done
if [ -n "$out" ]; then
  {
    echo "# Fuzzing the parsers ($(date +%Y-%m-%d))"
    echo
    echo "Command: \`bash scripts/fuzz.sh $args\` on $(nproc) cores ($(uname -m)), clang $(clang++ --version | head -1 | grep -o '[0-9][0-9.]*' | head -1), libFuzzer with $sanitizers, seed 1."
    echo
    echo "| target | inputs | coverage (edges) | seconds | result |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "options: any key=value into Options::set and the same value for every MEMTIDE_* variable into Options::from_env; a ConfigError must name the variable. topology_xml: any bytes as an hwloc XML file into Topology::from_xml; an error must name the file. hwloc's own leaks on a failed import are suppressed (tests/fuzz/lsan.supp); inputs that crash hwloc itself (hwloc 2.9 dereferences null on some corrupt files) are loaded in a forked child first and must come back as an error naming the file."
  } >"$out"
  echo "wrote $out"
fi
exit "${failed:-0}"
