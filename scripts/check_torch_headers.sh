#!/usr/bin/env bash
# Compiles the torch bridge and TieredAdamW's native reads (torch_bridge/*.cpp) against another
# torch release's headers, and checks that every torch symbol they call is in that release's
# libraries: what `pip install .` would build against it, without installing it.
#
#   bash scripts/check_torch_headers.sh 2.11.0
#
# Downloads that release's Linux wheel from PyPI (about 0.5 GB, kept in build/torch-headers/) and
# needs a built memtide (`pip install .` once: it uses the bridge's compile commands from there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

version=${1:?usage: check_torch_headers.sh TORCH_VERSION (for example 2.11.0)}
python=${PYTHON:-.venv/bin/python}
work=build/torch-headers/$version
bridge_build=$(ls -d build/*/python_bindings/torch_bridge/build 2>/dev/null | head -1)
if [ -z "$bridge_build" ] || [ ! -f "$bridge_build/build.ninja" ]; then
  echo "check_torch_headers: no bridge build under build/ (run pip install . first; it needs ninja)" >&2
  exit 2
fi

mkdir -p "$work/objects"
if [ ! -d "$work/torch/include" ]; then
  echo "downloading torch $version (Linux wheel, PyPI)..."
  "$python" -m pip download "torch==$version" --no-deps -q -d "$work"
  wheel=$(ls "$work"/torch-"$version"*.whl | head -1)
  echo "unpacking headers and libraries of $(basename "$wheel")..."
  (cd "$work" && unzip -q -o "$(basename "$wheel")" 'torch/include/*' 'torch/lib/libc10.so' \
     'torch/lib/libc10_cuda.so' 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch_python.so')
fi

installed=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
target=$(cd "$work" && pwd)/torch
libstdcxx=$(g++ -print-file-name=libstdc++.so.6)
memtide_lib=$("$python" -c "import memtide._memtide as m; print(m.library_path())")
status=0
# The compile commands of the installed build, with the other torch's headers and our own outputs.
while read -r cmd; do
  src=$(sed -E 's/.* -c ([^ ]+)$/\1/' <<<"$cmd")
  name=$(basename "$src" .cpp)
  cmd=$(sed -E "s|$installed|$target|g; s| -MD -MT [^ ]+ -MF [^ ]+||; s| -o [^ ]+ -c | -o $work/objects/$name.o -c |" <<<"$cmd")
  if ! eval "$cmd"; then
    echo "FAIL $name: does not compile against torch $version" >&2
    status=1
    continue
  fi
  # Every C++ symbol it calls must be exported by that release's libraries, libstdc++ or memtide.
  missing=$(comm -23 <(nm -u "$work/objects/$name.o" | awk '$2 ~ /^(_Z|THP|ParameterClass$)/ {print $2}' | sort -u) \
                     <(for lib in "$target"/lib/*.so "$libstdcxx" "$memtide_lib"; do
                         nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//'
                       done | sort -u))
  if [ -n "$missing" ]; then
    echo "FAIL $name: torch $version's libraries lack:" >&2
    echo "$missing" | head -20 >&2
    status=1
  else
    echo "ok   $name compiles against torch $version, and its torch symbols are in its libraries"
  fi
done < <(cd "$bridge_build" && ninja -t commands memtide_torch memtide_torch_reads | grep -E ' -c [^ ]+\.cpp$')
exit $status
