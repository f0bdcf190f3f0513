#!/usr/bin/env bash
# Every GPU check in one call, on a bare GPU machine: build with CUDA against the bundle made by
# scripts/gpu_bundle.sh, every C++ suite (the Cuda instantiations must run, not skip), the Python
# package and pytest, the loading checks, and every GPU benchmark. Writes one results Markdown per
# benchmark (OUTDIR/SUITE/<date>-<gpu>.md, as bench/results/ keeps them), summary.md and
# logs.tar.gz into OUTDIR, and prints a summary table at the end.
#
# Usage: bash scripts/gpu_check.sh [--quick|--full] [OUTDIR]
#   --quick (default) fits one 10-minute call: 2B-parameter update phase, short benchmarks.
#   --full            larger sizes and more repeats (about 15 minutes).
#   OUTDIR            default: $OUT when set, else gpu-check-<date>.
# Environment: MEMTIDE_GPU_BUNDLE (default .gpu-bundle), PYTHON (default python3);
#   MEMTIDE_GPU_CHECK_FORCE=1 runs the GPU steps even without a GPU (to try the script itself on a
#   CPU machine: the build, ctest, install and pytest steps then run; GPU-only checks fail).
#
# It never stops at a failed step: the steps that need its result are skipped, with the reason.
# Without a GPU every GPU step is skipped with the reason, and it exits 0. With a GPU it exits 1
# when any step failed.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

mode=quick
outdir=""
for a in "$@"; do
  case "$a" in
    --quick) mode=quick ;;
    --full) mode=full ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $a (expected --quick, --full or an output folder)" >&2; exit 2 ;;
    *) [ -z "$outdir" ] || { echo "gpu_check.sh: one output folder only (got $outdir and $a)" >&2; exit 2; }
       outdir=$a ;;
  esac
done
outdir=${outdir:-${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$outdir" || { echo "gpu_check.sh: cannot create $outdir" >&2; exit 2; }
outdir=$(cd "$outdir" && pwd)  # relative to where it was called from
cd "$here"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

if [ "$mode" = quick ]; then
  budget=540 update_params=2000000000 update_steps=3 adamw_n=67108864 adamw_repeats=10 bench_min_time=0.05
else
  budget=900 update_params=4000000000 update_steps=3 adamw_n=268435456 adamw_repeats=20 bench_min_time=0.5
fi
start=$(date +%s)
py=${PYTHON:-python3}
build=build/gpu-check
jobs=$(nproc)
date_tag=$(date +%Y-%m-%d)

# ---- the bundle -----------------------------------------------------------------------------
bundle=${MEMTIDE_GPU_BUNDLE:-.gpu-bundle}
bundle_note="no bundle at $bundle: building against what this machine has"
if [ -d "$bundle/root/usr" ]; then
  bundle=$(cd "$bundle" && pwd)
  multiarch=$(ls "$bundle/root/usr/lib" | grep -m1 -- '-linux-gnu$' || echo x86_64-linux-gnu)
  libdir=$bundle/root/usr/lib/$multiarch
  export CMAKE_PREFIX_PATH="$bundle/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  # The loader and (for libraries that the bundled ones need, e.g. libudev) the linker search it.
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  bundle_note="bundle $bundle ($(sed -n '1p' "$bundle/MANIFEST.txt" 2>/dev/null))"
fi

# ---- steps ----------------------------------------------------------------------------------
names=() states=() notes=() secs=()
declare -A state_of
record() {  # name state note seconds
  names+=("$1"); states+=("$2"); notes+=("$3"); secs+=("$4")
  state_of[$1]=$2
  printf '\033[1m[gpu-check]\033[0m %-22s %-7s %s\n' "$1" "$2" "$3"
}
skip() { record "$1" skipped "$2" 0; }
left() { echo $(( budget - ($(date +%s) - start) )); }

gpu_reason=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="no GPU: nvidia-smi not found"
elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  gpu_reason="no GPU: nvidia-smi lists none ($(nvidia-smi -L 2>&1 | head -c 120))"
fi

# run NAME CAP_SECONDS NEEDS... -- COMMAND: runs COMMAND with its output in NAME.log, under a
# time limit of min(CAP, what is left of the budget). NEEDS: "gpu" or names of earlier steps that
# must have passed.
run() {
  local name=$1 cap=$2; shift 2
  local need
  while [ "$1" != "--" ]; do
    need=$1; shift
    if [ "$need" = gpu ]; then
      [ -z "$gpu_reason" ] || [ "${MEMTIDE_GPU_CHECK_FORCE:-0}" = 1 ] || { skip "$name" "$gpu_reason"; return 0; }
    elif [ "${state_of[$need]:-}" != passed ]; then
      skip "$name" "needs $need, which ${state_of[$need]:-did not run}"; return 0
    fi
  done
  shift
  local limit rest
  rest=$(left)
  limit=$(( cap < rest ? cap : rest ))
  if (( limit < 10 )); then skip "$name" "out of time (the $mode budget is $budget s)"; return 0; fi
  local t0 rc
  t0=$(date +%s)
  printf '\033[1m[gpu-check]\033[0m %-22s running (limit %d s)\n' "$name" "$limit"
  # A fresh bash runs it, so that `timeout` can stop a shell function too (see the exports below).
  { echo "\$ $*"; timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@"; } >"$logs/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then
    record "$name" passed "" "$dt"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" failed "timed out after $limit s (see logs/$name.log)" "$dt"
  else
    local why
    why=$(grep -E -m1 -i 'error|fail|assert' "$logs/$name.log" | cut -c1-140)
    record "$name" failed "exit $rc${why:+: $why} (logs/$name.log)" "$dt"
  fi
}

# ---- what each step does --------------------------------------------------------------------
machine() {
  echo "mode $mode, budget $budget s, $bundle_note"
  nvidia-smi || true
  nvcc --version || echo "nvcc not found"
  cmake --version | head -1
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' || true
  echo "$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
}

configure_and_build() {
  local common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMTIDE_CUDA=ON -DMEMTIDE_BUILD_TESTS=ON
    -DMEMTIDE_BUILD_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=80-real;90-real;90-virtual")
  # The Python module in the same tree, so `pip install` below reuses it instead of building twice.
  if ! cmake -S . -B "$build" "${common[@]}" -DMEMTIDE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$py")"; then
    echo "configure with the Python module failed; building the C++ parts alone"
    rm -rf "$build"
    cmake -S . -B "$build" "${common[@]}" -DMEMTIDE_BUILD_PYTHON=OFF || return 1
  fi
  cmake --build "$build" -j "$jobs"
}

# The Cuda instantiations of the typed suites and the CUDA kernel tests must have run, not skipped.
cuda_suites_ran() {
  "$py" - "$logs/ctest.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
cuda = [(c.get("name"), c.get("status")) for c in cases if "Cuda" in c.get("name", "") or "cuda" in c.get("name", "")]
skipped = [n for n, s in cuda if s not in ("run", "passed", "fail", "failed")]
print(f"{len(cuda)} CUDA test cases, {len(skipped)} not run")
for n in skipped[:20]:
    print("  not run:", n)
sys.exit(0 if cuda and not skipped else 1)
EOF
}

install_package() {
  # Same tree and settings as the build step: scikit-build-core reconfigures it and only installs.
  "$py" -m pip install --no-build-isolation --no-deps -v . \
    -Cbuild-dir="$build" -Ccmake.define.MEMTIDE_CUDA=ON -Ccmake.define.MEMTIDE_BUILD_TESTS=ON \
    -Ccmake.define.MEMTIDE_BUILD_BENCH=ON "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=80-real;90-real;90-virtual"
}

alloc_conf_check() {
  PYTORCH_CUDA_ALLOC_CONF=backend:memtide "$py" -c "
import torch, memtide
x = torch.ones(1 << 20, device='cuda')
installed = memtide.torch_allocator_installed()
allocated = memtide.stats()['allocated_bytes.all.current']
print('installed', installed, 'allocated', allocated)
assert installed and allocated >= 4 << 20, 'backend:memtide did not route the tensor through memtide'
"
}

bridge_check() {
  # memtide as torch's own allocator, built here against this machine's torch at install.
  "$py" -c "
import json, torch, memtide, memtide.torch_bridge as tb
chosen = memtide.use_with_torch()
print(json.dumps(chosen))
assert chosen['path'] == 'bridge', chosen
print(json.dumps(tb.selfcheck()))
x = torch.ones(1 << 20, device='cuda')
s = torch.cuda.memory_stats()
print('allocated', s['allocated_bytes.all.current'], 'reserved', s['reserved_bytes.all.current'])
assert s['allocated_bytes.all.current'] >= 4 << 20, s
"
}

observe_check() {
  "$py" -m memtide.cli observe --json --log "$logs/observe.jsonl" -- \
    "$py" -c "import torch; x = torch.ones(1 << 28, device='cuda'); torch.cuda.synchronize()" | tee "$logs/observe.json"
  "$py" -c "
import json, sys
s = json.load(open(sys.argv[1]))
peak = s.get('peak_bytes', 0)
print('observer peak', peak)
assert peak >= 1 << 30, 'the observer did not see torch allocate 1 GiB'
" "$logs/observe.json"
}

# The main job with --timeline on the GPU: CUPTI must be active and its copies and kernels must
# be in the trace beside the allocator's events; the report, trace and pickle go in the logs.
timeline_check() {
  "$py" -m memtide.cli info | grep -E "^CUPTI" || true
  "$py" -m memtide.cli run --iterations 4 --timeline "$logs/timeline.html" || return 1
  "$py" - "$logs/timeline.trace.jsonl" <<'EOF2'
import json, sys
kinds, engines = {}, {}
with open(sys.argv[1]) as f:
    header = json.loads(f.readline())
    for line in f:
        e = json.loads(line)
        kinds[e["type"]] = kinds.get(e["type"], 0) + 1
        if e["type"] == "op":
            engines[e["engine"]] = engines.get(e["engine"], 0) + 1
print("cupti", header.get("cupti"), "events", kinds, "device ops", engines)
assert header.get("cupti") in ("active", "partial"), "CUPTI did not trace the run"
assert engines.get("compute", 0) > 0 and engines.get("h2d", 0) + engines.get("d2h", 0) > 0
EOF2
}

# The NVMe tier's store on the machine's scratch disk (whatever backs the temp folder).
nvme_check() {
  local dir
  dir=$(mktemp -d)
  "$py" -m memtide.cli probe --nvme "$dir" --nvme-bytes 2GiB
  local rc=$?
  rm -rf "$dir"
  return $rc
}

# The main job with the NVMe tier on the GPU: half the optimizer state spilled to the scratch
# disk, the spilled GPU subgroups going NVMe -> pinned staging -> GPU and back.
nvme_train_check() {
  local dir
  dir=$(mktemp -d)
  "$py" -m memtide.cli run --iterations 4 --policy interleaved --host-budget 50MB --nvme-dir "$dir" --json \
    > "$logs/nvme-run.json"
  local rc=$?
  rm -rf "$dir"
  ((rc == 0)) || return $rc
  "$py" - "$logs/nvme-run.json" <<'EOF2'
import json, sys
r = json.load(open(sys.argv[1]))
nv = r["nvme"]
print("spilled", nv["spilled"], "last step", nv["last"], "placement", r["plan"]["placement"])
assert r["device"]["kind"] == "cuda" and nv["spilled"] > 0 and nv["last"]["reads"] == nv["spilled"]
digests = {p["digest"] for p in r["policies"]}
assert len(digests) == 1, f"policies disagree with the NVMe tier: {digests}"
EOF2
}

gbench_report() {  # target title suite
  local json=$logs/$1.json
  "$build/bench/cpp/$1" --benchmark_min_time="$bench_min_time" --benchmark_format=console \
    --benchmark_out="$json" --benchmark_out_format=json || return 1
  "$py" bench/cpp/report.py "$json" "$(results "$3")" --title "$2" --command "bash scripts/gpu_check.sh --$mode"
}

# A benchmark's results file, laid out as bench/results/ keeps them (SUITE/<date>-<gpu>.md), so
# OUTDIR's suite folders copy over as they are. Made when the step's command line is expanded;
# the folders of steps that wrote nothing are removed before the summary.
results() {  # suite
  mkdir -p "$outdir/$1" && echo "$outdir/$1/$date_tag-$gpu_label.md"
}

# ---- the run --------------------------------------------------------------------------------
gpu_label=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | tr 'A-Z' 'a-z' |
  sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
gpu_label=${gpu_label:-nogpu}
export -f machine configure_and_build cuda_suites_ran install_package alloc_conf_check bridge_check observe_check gbench_report \
  results timeline_check nvme_check nvme_train_check
export mode budget bundle_note py build jobs logs outdir date_tag gpu_label bench_min_time

run machine 30 -- machine
run build 300 gpu -- configure_and_build
run ctest 150 gpu build -- ctest --test-dir "$build" -j 8 --timeout 120 --output-on-failure --output-junit "$logs/ctest.xml"
run cuda-suites 10 gpu build -- cuda_suites_ran
run install 120 gpu build -- install_package
run probe 30 gpu install -- "$py" -m memtide.cli probe
run backend-memtide 60 gpu install -- alloc_conf_check
run torch-bridge 60 gpu install -- bridge_check
run observe 60 gpu install -- observe_check
run timeline 120 gpu install -- timeline_check
run nvme-probe 60 gpu install -- nvme_check
run nvme-train 120 gpu install -- nvme_train_check
# The layer window: a model whose parameters and gradients exceed a capped GPU memory trains with
# it; throughput against the same model uncapped without it.
run bench-window-gpu 240 gpu install -- "$py" bench/python/bench_window_gpu.py --out "$(results window)"
run bench-update-phase 200 gpu build -- "$build/bench/memtide_bench_update_phase" --device cuda --params "$update_params" \
  --steps "$update_steps" --headroom 16GiB --out "$(results update-phase)"
run pytest 200 gpu install -- "$py" -m pytest tests -q -rs -p no:cacheprovider --junitxml="$logs/pytest.xml"
run bench-adamw-gpu 90 gpu install -- "$py" bench/python/bench_adamw_gpu.py --n "$adamw_n" --repeats "$adamw_repeats" \
  --out "$(results adamw-gpu)"
run bench-torch-allocator 120 gpu install -- "$py" bench/python/torch_allocator_compare.py \
  --out "$(results torch-allocator)"
run bench-allocator 90 gpu build -- gbench_report memtide_bench_allocator "Allocator benchmarks" allocator
run bench-host 90 gpu build -- gbench_report memtide_bench_host "Host tier benchmarks (HostArena)" host-arena

# ---- summary --------------------------------------------------------------------------------
find "$outdir" -mindepth 1 -maxdepth 1 -type d -empty -delete
failed=0
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $mode mode"
  echo
  echo "Machine: $( (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU") | head -1), $(nproc) cores. $bundle_note. Total $(( $(date +%s) - start )) s."
  echo
  echo "| step | result | seconds | why |"
  echo "|---|---|---|---|"
  for i in "${!names[@]}"; do
    echo "| ${names[$i]} | ${states[$i]} | ${secs[$i]} | ${notes[$i]//|/\\|} |"
    [ "${states[$i]}" != failed ] || failed=$((failed + 1))
  done
} >"$outdir/summary.md"
cp "$outdir/summary.md" "$logs/summary.md"
tar -czf "$outdir/logs.tar.gz" -C "$logs" . 2>/dev/null || true

echo
printf '%-22s %-8s %7s  %s\n' step result seconds why
for i in "${!names[@]}"; do printf '%-22s %-8s %7s  %s\n' "${names[$i]}" "${states[$i]}" "${secs[$i]}" "${notes[$i]}"; done
echo "results in $outdir ($(ls "$outdir" | wc -l) files)"
if [ -n "$gpu_reason" ]; then exit 0; fi
((failed == 0))
