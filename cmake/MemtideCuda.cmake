# Decides whether CudaDevice and the CUDA kernels are built. Sets MEMTIDE_HAVE_CUDA.
#
# The CUDA runtime is linked statically (cudart_static) so libmemtide.so needs no libcudart at
# load time: on a machine without a driver every call returns cudaErrorInsufficientDriver and
# memtide falls back to SimDevice instead of failing to load.
set(MEMTIDE_HAVE_CUDA OFF)
if(NOT MEMTIDE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere and Hopper SASS, plus PTX so newer GPUs JIT-compile.
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(MEMTIDE_HAVE_CUDA ON)
  elseif(MEMTIDE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MEMTIDE_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    message(STATUS "memtide: no CUDA compiler found; building without CudaDevice (SimDevice only)")
  endif()
endif()
