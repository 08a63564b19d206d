// Every CUDA runtime call goes through OFFCACHE_CUDA_CHECK, which names the
// failing call in the error.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#define OFFCACHE_CUDA_CHECK(call)                                                  \
  do {                                                                             \
    const cudaError_t offcache_err_ = (call);                                      \
    if (offcache_err_ != cudaSuccess) {                                            \
      (void)cudaGetLastError(); /* clear the non-sticky error for later callers */ \
      TORCH_CHECK(false, "offcache: CUDA call ", #call,                            \
                  " failed: ", cudaGetErrorName(offcache_err_), ": ",              \
                  cudaGetErrorString(offcache_err_));                              \
    }                                                                              \
  } while (0)
