# MEMTIDE_PREBUILT: the Python module and the torch bridge against memtide libraries built earlier,
# on another machine (scripts/gpu_bundle.sh builds them with the CUDA kernels for Hopper on a CPU
# machine; scripts/gpu_check.sh installs the package on the GPU machine with
# -Ccmake.define.MEMTIDE_PREBUILT=<bundle>/hopper/lib). Nothing of memtide itself is compiled: only
# the nanobind modules, which must match the interpreter, and the bridge, which must match torch.
#
# The folder holds libmemtide.so.0, libmemtide_sim.so, libmemtide_preload.so and
# memtide-prebuilt.cmake (written by the build that made them: its version, whether it has CUDA and
# the NVMe tier). The headers are this source tree's, which must be the one the libraries were
# built from.
if(NOT MEMTIDE_BUILD_PYTHON)
  message(FATAL_ERROR "MEMTIDE_PREBUILT is for the Python build only (MEMTIDE_BUILD_PYTHON=ON)")
endif()
get_filename_component(MEMTIDE_PREBUILT "${MEMTIDE_PREBUILT}" ABSOLUTE)
set(_memtide_prebuilt_files libmemtide.so.0 libmemtide_sim.so libmemtide_preload.so memtide-prebuilt.cmake)
foreach(f ${_memtide_prebuilt_files})
  if(NOT EXISTS "${MEMTIDE_PREBUILT}/${f}")
    message(FATAL_ERROR "MEMTIDE_PREBUILT=${MEMTIDE_PREBUILT} has no ${f}")
  endif()
endforeach()
include("${MEMTIDE_PREBUILT}/memtide-prebuilt.cmake")
if(NOT MEMTIDE_PREBUILT_VERSION VERSION_EQUAL PROJECT_VERSION)
  message(FATAL_ERROR "MEMTIDE_PREBUILT holds memtide ${MEMTIDE_PREBUILT_VERSION}, this tree is ${PROJECT_VERSION}")
endif()
set(MEMTIDE_HAVE_CUDA ${MEMTIDE_PREBUILT_HAVE_CUDA})
set(MEMTIDE_HAVE_NVME ${MEMTIDE_PREBUILT_HAVE_NVME})
if(MEMTIDE_HAVE_CUDA)
  # The bridge is built against this machine's CUDA headers (torch's allocator interface).
  find_package(CUDAToolkit REQUIRED)
  # Without the CUDA language enabled FindCUDAToolkit may leave this empty; python_bindings passes
  # it to the bridge as the toolkit's root.
  if(NOT CUDAToolkit_LIBRARY_ROOT)
    get_filename_component(CUDAToolkit_LIBRARY_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  endif()
endif()

# The same names the in-tree targets have, so python_bindings/CMakeLists.txt links them unchanged.
add_library(memtide SHARED IMPORTED GLOBAL)
set_target_properties(memtide PROPERTIES
  IMPORTED_LOCATION "${MEMTIDE_PREBUILT}/libmemtide.so.0"
  IMPORTED_SONAME libmemtide.so.0
  INTERFACE_INCLUDE_DIRECTORIES
    "${PROJECT_SOURCE_DIR}/capi/include;${PROJECT_SOURCE_DIR}/runtime/include;${PROJECT_SOURCE_DIR}/allocator/include;${PROJECT_SOURCE_DIR}/tiering/include;${PROJECT_SOURCE_DIR}/cupti_tracer/include;${PROJECT_SOURCE_DIR}/device/include;${PROJECT_SOURCE_DIR}/core/include"
  INTERFACE_LINK_LIBRARIES Threads::Threads)
add_library(memtide::memtide ALIAS memtide)

add_library(memtide_sim SHARED IMPORTED GLOBAL)
set_target_properties(memtide_sim PROPERTIES
  IMPORTED_LOCATION "${MEMTIDE_PREBUILT}/libmemtide_sim.so"
  IMPORTED_SONAME libmemtide_sim.so
  INTERFACE_INCLUDE_DIRECTORIES "${PROJECT_SOURCE_DIR}/tools/simulator/include"
  INTERFACE_LINK_LIBRARIES memtide)
add_library(memtide::sim ALIAS memtide_sim)

add_library(memtide_preload SHARED IMPORTED GLOBAL)
set_target_properties(memtide_preload PROPERTIES IMPORTED_LOCATION "${MEMTIDE_PREBUILT}/libmemtide_preload.so")

message(STATUS "memtide ${PROJECT_VERSION}: Python module against the libraries in ${MEMTIDE_PREBUILT} "
               "(CUDA=${MEMTIDE_HAVE_CUDA} NVMe=${MEMTIDE_HAVE_NVME}, built ${MEMTIDE_PREBUILT_BUILD_TYPE} "
               "for CUDA ${MEMTIDE_PREBUILT_CUDA_ARCHITECTURES})")
add_subdirectory(python_bindings)
