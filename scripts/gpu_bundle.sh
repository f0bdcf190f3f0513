#!/usr/bin/env bash
# Gathers what a bare GPU machine lacks into one git-ignored folder that travels with the repo, and
# builds here what does not depend on that machine's Python or torch, so that its minutes go to
# running rather than compiling:
#   root/    the Debian packages memtide builds against and runs with (unpacked, docs dropped,
#            pkg-config files made relocatable);
#   hopper/  the CUDA libraries, the C++ tests and benchmarks, built here for Hopper (sm_90 machine
#            code + compute_90 PTX), Release, stripped, as hopper.tar.gz (unpacked on the GPU
#            machine); what was checked here about them is in hopper-checks.txt;
#   wheels/  Python 3.12 wheels the GPU image does not ship.
# scripts/gpu_check.sh finds the folder beside itself; there it builds only the nanobind module
# (Python 3.12) and the torch bridge (torch 2.11) against the prebuilt libmemtide.so.
#
# Usage: bash scripts/gpu_bundle.sh [--no-build] [DIR]    (DIR default: .gpu-bundle, ignored by git)
#   --no-build   the Debian packages and wheels only (gpu_check.sh then builds everything there).
# Runs on the CPU machine (it needs apt-get and pip, and the network those reach, and CUDA's nvcc).
# Environment: MEMTIDE_GPU_BUNDLE_JOBS (default: nproc), CUOBJDUMP (default: found on PATH, in
#   the CUDA toolkit, or the copy Triton ships).
set -euo pipefail
cd "$(dirname "$0")/.."

build_hopper=1
dir=""
for a in "$@"; do
  case "$a" in
    --no-build) build_hopper=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "gpu_bundle.sh: unknown option $a" >&2; exit 2 ;;
    *) [ -z "$dir" ] || { echo "gpu_bundle.sh: one folder only (got $dir and $a)" >&2; exit 2; }
       dir=$a ;;
  esac
done
dir=${dir:-.gpu-bundle}
# Together with the repository the bundle must travel in one call: 64 MiB in all.
limit_mib=64
preset=gpu-bundle-hopper
build=build/$preset
# The bundle is put together here (a fixed place, so the build tree's cached paths stay valid from
# one run to the next) and replaces DIR only when everything succeeded.
stage=build/gpu-bundle-stage

log() { printf '\033[1m[gpu-bundle]\033[0m %s\n' "$*"; }
die() { printf '[gpu-bundle] error: %s\n' "$*" >&2; exit 1; }

# Each -dev package with the runtime library it links to. GoogleTest and Google Benchmark: the
# C++ suites and benchmarks; hwloc (+ libudev1, which libhwloc.so.15 needs): GPU/NUMA topology;
# libnuma: NUMA-bound host slabs; jemalloc and mimalloc: PinnedHeap's backends (dlopen'ed);
# liburing and xxHash: the NVMe tier. Add a package here when the build starts to need it.
DEB_PACKAGES=(
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
  libhwloc-dev libhwloc15 libudev1
  libnuma-dev libnuma1
  libjemalloc-dev libjemalloc2
  libmimalloc-dev libmimalloc2.0
  liburing-dev liburing2
  libxxhash-dev libxxhash0
)

# Python packages the GPU image lacks, as NAME==VERSION (the image already has torch, numpy,
# pytest, nanobind, scikit-build-core and matplotlib; see docs/gpu.md). Empty today.
WHEELS=()

command -v apt-get >/dev/null || die "apt-get not found: run this on the Debian CPU machine, not the GPU one"
command -v dpkg >/dev/null || die "dpkg not found"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

log "downloading ${#DEB_PACKAGES[@]} Debian packages"
if ! (cd "$tmp" && apt-get download -qq "${DEB_PACKAGES[@]}" >/dev/null 2>"$tmp/apt.err"); then
  # A fresh machine has no package lists yet.
  log "apt-get download failed ($(head -c 200 "$tmp/apt.err")); running apt-get update once"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  (cd "$tmp" && apt-get download -qq "${DEB_PACKAGES[@]}" >/dev/null) || die "apt-get download failed for: ${DEB_PACKAGES[*]}"
fi

rm -rf "$stage"
mkdir -p "$stage/root" "$stage/wheels"
for deb in "$tmp"/*.deb; do
  dpkg -x "$deb" "$stage/root"
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >>"$tmp/packages.txt"
done
# Documentation, manuals and lintian overrides are not needed to build.
rm -rf "$stage/root/usr/share/doc" "$stage/root/usr/share/man" "$stage/root/usr/share/info" \
  "$stage/root/usr/share/lintian" "$stage/root/usr/share/bug"
# pkg-config files name prefix=/usr; make them relative to where they lie, so the bundle works
# wherever it is unpacked (pkg-config and pkgconf both expand ${pcfiledir}).
# Headers Debian puts in the multiarch include folder (hwloc's autogen/config.h) are found there
# through the compiler's default path on Debian, which the bundle's copy is not: name it.
multiarch=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
while IFS= read -r -d '' pc; do
  rel=$(realpath --relative-to="$(dirname "$pc")" "$stage/root/usr")
  sed -i -E "s|^prefix=/usr/?\$|prefix=\${pcfiledir}/$rel|" "$pc"
  if [ -d "$stage/root/usr/include/$multiarch" ]; then
    sed -i -E "s|^(Cflags:.*)\$|\1 -I\\\${includedir}/$multiarch|" "$pc"
  fi
done < <(find "$stage/root" -name '*.pc' -print0)

if ((${#WHEELS[@]})); then
  log "downloading ${#WHEELS[@]} Python 3.12 wheels: ${WHEELS[*]}"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$stage/wheels" "${WHEELS[@]}"
fi

# ---- the Hopper build ------------------------------------------------------------------------
find_cuobjdump() {
  local c
  for c in "${CUOBJDUMP:-}" "$(command -v cuobjdump || true)" "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" \
           /usr/local/cuda/bin/cuobjdump; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  # Triton's wheel carries one (bin/cuobjdump of its NVIDIA backend).
  for py in .venv/bin/python python3; do
    c=$("$py" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null) || continue
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

# The highest symbol version of LIB (GLIBC, GLIBCXX, CXXABI, GCC) any of the files asks for.
max_version() {  # prefix files...
  local prefix=$1; shift
  objdump -T "$@" 2>/dev/null | grep -oE "\b${prefix}_[0-9]+(\.[0-9]+)*\b" | sort -u -V | tail -1
}

build_note="not built (--no-build)"
if ((build_hopper)); then
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
  command -v nvcc >/dev/null || die "nvcc not found: the Hopper build needs CUDA's compiler (or pass --no-build)"
  cuobjdump=$(find_cuobjdump) || die "cuobjdump not found (set CUOBJDUMP, install the CUDA toolkit's, or pip install triton): it checks the sm_90 code"
  root=$PWD/$stage/root/usr
  libdir=$root/lib/$multiarch
  # Against the bundle's own packages: what is linked is exactly what travels.
  export CMAKE_PREFIX_PATH="$root" PKG_CONFIG_PATH="$libdir/pkgconfig" LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  jobs=${MEMTIDE_GPU_BUNDLE_JOBS:-$(nproc)}
  log "building preset $preset in $build with $jobs jobs ($(nvcc --version | grep -o 'release [0-9.]*'))"
  t0=$(date +%s)
  # --fresh: every find result is taken again from the stage, which is made anew each run (the
  # command lines stay the same, so ninja rebuilds only what changed).
  cmake --preset "$preset" --fresh >"$tmp/configure.log" 2>&1 || { tail -30 "$tmp/configure.log" >&2; die "configure failed"; }
  cmake --build "$build" -j "$jobs" >"$tmp/build.log" 2>&1 || { grep -m20 -B2 -A8 'error' "$tmp/build.log" >&2 || tail -40 "$tmp/build.log" >&2; die "build failed"; }
  build_s=$(( $(date +%s) - t0 ))
  log "built in ${build_s} s"

  hop=$tmp/hopper
  mkdir -p "$hop/bin" "$hop/lib"
  # Executables: every ELF program of the tree (tests, benchmarks, the preload demo); libraries:
  # libmemtide.so.0 under its soname (what the programs and the Python module ask for), the
  # simulator's, the LD_PRELOAD observer and the fake CUDA runtime the observer's test uses.
  while IFS= read -r -d '' f; do
    [ "$(head -c 4 "$f" | tail -c 3)" = ELF ] && cp "$f" "$hop/bin/"
  done < <(find "$build" -path '*/CMakeFiles' -prune -o -type f -executable -name 'memtide_*' -print0)
  cp -L "$build/capi/libmemtide.so.0" "$hop/lib/"
  for so in libmemtide_sim.so libmemtide_preload.so libmemtide_fake_cudart.so; do
    f=$(find "$build" -name "$so" -type f | head -1)
    [ -n "$f" ] || die "the build made no $so"
    cp "$f" "$hop/lib/"
  done
  cp "$build/memtide-prebuilt.cmake" "$hop/lib/"
  strip --strip-unneeded "$hop"/bin/* "$hop"/lib/*.so*
  # The C++ runtime this machine built against, for a GPU machine whose own is older (gpu_check.sh
  # uses it only then: its Python and torch must load the newer one too).
  mkdir -p "$hop/compat"
  for so in libstdc++.so.6 libgcc_s.so.1; do
    f=$(ldd "$hop/lib/libmemtide.so.0" | awk -v n="$so" '$1 == n {print $3}')
    [ -n "$f" ] && cp -L "$f" "$hop/compat/"
  done

  checks=$stage/hopper-checks.txt
  {
    echo "# What scripts/gpu_bundle.sh checked here, $(date -u +%Y-%m-%dT%H:%MZ), on $(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "nvcc: $(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*'); build: preset $preset, $jobs jobs, ${build_s} s"
    echo
    echo "## needs (the highest symbol versions any bundled program or library asks for)"
    for p in GLIBC GLIBCXX CXXABI GCC; do echo "$p $(max_version "$p" "$hop"/bin/* "$hop"/lib/*.so*)"; done
    echo
    echo "## CUDA code (cuobjdump --list-elf / --list-ptx; PTX is listed under the sm_ of its compute_ target)"
  } >"$checks"
  # Every file with a fatbin must hold sm_90 machine code; PTX, when there, must be compute_90.
  for f in "$hop"/bin/* "$hop"/lib/*.so*; do
    # (Not `| grep -q`: under pipefail, readelf killed by the early close would read as "none".)
    [[ "$(readelf -S "$f" 2>/dev/null)" == *.nv_fatbin* ]] || continue
    elfs=$("$cuobjdump" --list-elf "$f" 2>&1 | grep -oE 'sm_[0-9]+[a-z]?' | sort -u | tr '\n' ' ')
    ptx=$("$cuobjdump" --list-ptx "$f" 2>&1 | grep -oE 'sm_[0-9]+[a-z]?' | sort -u | tr '\n' ' ')
    echo "$(basename "$f"): elf ${elfs:-none}; ptx ${ptx:-none}" >>"$checks"
    [ "${elfs% }" = sm_90 ] || die "$(basename "$f") holds machine code for '${elfs:-nothing}', not sm_90 alone ($cuobjdump --list-elf)"
  done
  for f in libmemtide.so.0 memtide_cuda_kernel_tests memtide_tiering_tests memtide_bench_update_phase; do
    grep -q "^$f: elf sm_90" "$checks" || die "$f holds no CUDA code: was CUDA found by the build?"
  done
  # Here there is no GPU and no driver: every program must load and start, and the CUDA tests must
  # skip saying there is no usable GPU rather than fail.
  echo >>"$checks"
  echo "## started here without a GPU driver (exit status; gtest: passed/skipped/failed)" >>"$checks"
  export LD_LIBRARY_PATH="$libdir"
  for f in "$hop"/bin/*; do
    name=$(basename "$f")
    case "$name" in
      memtide_preload_demo) continue ;;  # the observer test's child; it needs the fake runtime's setup
      memtide_bench_update_phase)
        out=$( (cd "$tmp" && timeout 120 "$f" --device auto --params 4e6 --subgroup 5e5 --steps 1 --headroom 48MiB) 2>&1) \
          || die "$name failed to start here: $(tail -3 <<<"$out")"
        echo "$name: exit 0 (on $(grep -m1 -oE 'SimDevice|CudaDevice|sim(ulated)? device' <<<"$out" || echo 'the device it found'))" >>"$checks" ;;
      memtide_bench_*)
        out=$(timeout 60 "$f" --benchmark_list_tests 2>&1) || die "$name failed to start here: $(tail -3 <<<"$out")"
        echo "$name: exit 0 (--benchmark_list_tests: $(wc -l <<<"$out") benchmarks)" >>"$checks" ;;
      *)
        # The CUDA cases only (the whole suites run in CI and in gpu_check.sh --full); a program
        # without any lists its tests, which proves it loads.
        filter='*Cuda*:*cuda*:*CUDA*'
        n=$(timeout 60 "$f" --gtest_list_tests --gtest_filter="$filter" 2>/dev/null | grep -c '^  ' || true)
        if ((n == 0)); then
          out=$(timeout 60 "$f" --gtest_list_tests 2>&1) || die "$name failed to start here: $(tail -3 <<<"$out")"
          echo "$name: exit 0 (no CUDA cases; lists $(grep -c '^  ' <<<"$out") tests)" >>"$checks"
          continue
        fi
        out=$(timeout 300 "$f" --gtest_filter="$filter" --gtest_brief=1 2>&1) \
          || die "$name failed here without a GPU (it must skip its CUDA cases): $(grep -m3 -E 'FAILED|error' <<<"$out")"
        passed=$(grep -oE '\[  PASSED  \] [0-9]+' <<<"$out" | grep -oE '[0-9]+$' || echo 0)
        skipped=$(grep -oE '\[  SKIPPED \] [0-9]+' <<<"$out" | grep -oE '[0-9]+$' || echo 0)
        why=$(grep -m1 -oE 'no usable GPU[^"]*' <<<"$out" | cut -c1-100 || true)
        echo "$name: exit 0 ($n CUDA cases: ${passed:-0} passed, ${skipped:-0} skipped${why:+: $why})" >>"$checks" ;;
    esac
  done
  # Compressed, the programs travel in a third of their size (gzip: seconds, where xz would take a
  # minute here for another 5 MiB); gpu_check.sh unpacks them.
  tar -C "$tmp" -czf "$stage/hopper.tar.gz" hopper
  build_note="hopper.tar.gz: $(ls "$hop/bin" | wc -l) programs and $(ls "$hop"/lib/*.so* | wc -l) libraries, $(( $(du -sk "$hop" | cut -f1) / 1024 )) MiB unpacked"
  log "checked: $(grep -c 'elf sm_90' "$checks") files hold sm_90 code; every program started without a driver (see $dir/hopper-checks.txt)"
fi

{
  echo "memtide GPU bundle, made $(date -u +%Y-%m-%dT%H:%MZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(uname -m))"
  echo "root/          the Debian packages below, unpacked (dpkg -x); usr/include, usr/lib/$multiarch"
  echo "hopper.tar.gz  $build_note"
  echo "wheels/        Python 3.12 wheels: ${WHEELS[*]:-none}"
  echo
  echo "packages:"
  sed 's/^/  /' "$tmp/packages.txt"
} >"$stage/MANIFEST.txt"

rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
mv "$stage" "$dir"

bundle_kib=$(du -sk "$dir" | cut -f1)
# What travels besides the bundle: tracked files and untracked files git does not ignore.
repo_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (bundle_kib + repo_kib + 1023) / 1024 ))
log "wrote $dir: $(( (bundle_kib + 1023) / 1024 )) MiB, repository $(( (repo_kib + 1023) / 1024 )) MiB, together ${total_mib} MiB of ${limit_mib} MiB"
((total_mib <= limit_mib)) || die "the repository and the bundle together are ${total_mib} MiB, over the ${limit_mib} MiB a GPU call carries: trim DEB_PACKAGES, WHEELS or the programs built"
log "on the GPU machine: bash scripts/gpu_check.sh \"\$OUT\"   (carry $dir)"
