#!/usr/bin/env bash
# Gathers what a bare GPU machine lacks into one git-ignored folder that travels with the repo:
# the Debian packages memtide builds against (unpacked, docs dropped, pkg-config files made
# relocatable) and Python 3.12 wheels the GPU image does not ship. scripts/gpu_check.sh finds
# the folder beside itself and builds against it.
#
# Usage: bash scripts/gpu_bundle.sh [DIR]      (default: .gpu-bundle, ignored by git)
# Runs on the CPU machine (it needs apt-get and pip, and the network those reach).
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${1:-.gpu-bundle}
# Together with the repository the bundle must travel in one call: 64 MiB in all.
limit_mib=64

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

# Unpack into a fresh folder first, so a failure leaves the previous bundle intact.
stage="$tmp/bundle"
mkdir -p "$stage/root" "$stage/wheels"
for deb in "$tmp"/*.deb; do
  dpkg -x "$deb" "$stage/root"
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >>"$stage/packages.txt"
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

{
  echo "memtide GPU bundle, made $(date -u +%Y-%m-%dT%H:%MZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(uname -m))"
  echo "root/   the Debian packages below, unpacked (dpkg -x); usr/include, usr/lib/$multiarch"
  echo "wheels/ Python 3.12 wheels: ${WHEELS[*]:-none}"
  echo
  echo "packages:"
  sed 's/^/  /' "$stage/packages.txt"
} >"$stage/MANIFEST.txt"
rm "$stage/packages.txt"

rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
mv "$stage" "$dir"

bundle_kib=$(du -sk "$dir" | cut -f1)
# What travels besides the bundle: tracked files and untracked files git does not ignore.
repo_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (bundle_kib + repo_kib + 1023) / 1024 ))
log "wrote $dir: $(( (bundle_kib + 1023) / 1024 )) MiB ($(find "$dir/root" -type f | wc -l) files), repository $(( (repo_kib + 1023) / 1024 )) MiB, together ${total_mib} MiB of ${limit_mib} MiB"
((total_mib <= limit_mib)) || die "the repository and the bundle together exceed ${limit_mib} MiB: trim DEB_PACKAGES or WHEELS"
log "on the GPU machine: bash scripts/gpu_check.sh \"\$OUT\"   (carry $dir)"
