# cmake -P script: configures and builds the torch bridge project (CMakeLists.txt beside this
# file) and never fails. It leaves libmemtide_torch.so and torch_bridge_status.txt in BINARY:
# the status says what the bridge was built against, or why it was not, for `memtide info`.
#
# -D inputs: SOURCE, BINARY, GENERATOR, CXX, MEMTIDE_PYTHON, MEMTIDE_LIBRARY, MEMTIDE_INCLUDE_DIRS,
# CUDA_ROOT (empty: no CUDA toolkit).
set(status "${BINARY}/torch_bridge_status.txt")
file(MAKE_DIRECTORY "${BINARY}")
file(REMOVE "${BINARY}/libmemtide_torch.so" "${BINARY}/libmemtide_torch_reads.so")

function(give_up why)
  file(WRITE "${status}" "not built: ${why}\n")
  file(WRITE "${BINARY}/torch_reads_status.txt" "not built: the bridge was not (${why})\n")
  message(WARNING "memtide: torch bridge not built (${why}); memtide.use_with_torch() will use torch's pluggable allocator")
endfunction()

if(CUDA_ROOT STREQUAL "")
  give_up("no CUDA toolkit (torch's allocator headers need cuda_runtime_api.h)")
  return()
endif()
execute_process(COMMAND "${MEMTIDE_PYTHON}" -c "import torch; print(torch.__version__)"
                OUTPUT_VARIABLE torch_version OUTPUT_STRIP_TRAILING_WHITESPACE
                ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  give_up("no torch in ${MEMTIDE_PYTHON} at install time")
  return()
endif()

execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${BINARY}/build" -G "${GENERATOR}"
          "-DCMAKE_CXX_COMPILER=${CXX}" -DCMAKE_BUILD_TYPE=Release "-DCUDAToolkit_ROOT=${CUDA_ROOT}"
          "-DMEMTIDE_PYTHON=${MEMTIDE_PYTHON}" "-DMEMTIDE_LIBRARY=${MEMTIDE_LIBRARY}"
          "-DMEMTIDE_INCLUDE_DIRS=${MEMTIDE_INCLUDE_DIRS}"
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(rc EQUAL 0)
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BINARY}/build"
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
endif()
if(NOT rc EQUAL 0)
  # The first error line says most; the whole log stays in the build folder.
  file(WRITE "${BINARY}/torch_bridge_build.log" "${out}\n${err}")
  string(REGEX MATCH "[^\n]*(error|Error)[^\n]*" first "${out}\n${err}")
  give_up("building against torch ${torch_version} failed: ${first}")
  return()
endif()
file(COPY_FILE "${BINARY}/build/libmemtide_torch.so" "${BINARY}/libmemtide_torch.so")
file(WRITE "${status}" "built against torch ${torch_version}\n")
message(STATUS "memtide: torch bridge built against torch ${torch_version}")

# TieredAdamW's reads of its params in C++ (torch_reads.cpp): optional, after the bridge; without
# it the optimizer reads them in Python. Its own status file says which.
set(reads_status "${BINARY}/torch_reads_status.txt")
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BINARY}/build" --target memtide_torch_reads
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(rc EQUAL 0)
  file(COPY_FILE "${BINARY}/build/libmemtide_torch_reads.so" "${BINARY}/libmemtide_torch_reads.so")
  file(WRITE "${reads_status}" "built against torch ${torch_version}\n")
else()
  file(WRITE "${BINARY}/torch_reads_build.log" "${out}\n${err}")
  string(REGEX MATCH "[^\n]*(error|Error)[^\n]*" first "${out}\n${err}")
  file(WRITE "${reads_status}" "not built: building against torch ${torch_version}'s Python headers failed: ${first}\n")
  message(WARNING "memtide: TieredAdamW's native reads not built (${first}); it reads its params in Python")
endif()
