// Shared macros of flcomm's native code: every CUDA / NCCL return code goes through one macro
// that throws (std::runtime_error, a RuntimeError in Python) with file:line and the library's own
// message. No torch headers: the CUDA kernels (nvcc) include this too.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#ifdef FLCOMM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef FLCOMM_WITH_NCCL
#include <nccl.h>
#endif

#ifdef FLCOMM_WITH_CUDA
#define FLCOMM_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    cudaError_t err_ = (expr);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      std::ostringstream os_;                                                           \
      os_ << "CUDA error at " << __FILE__ << ":" << __LINE__ << " in `" #expr "`: "     \
          << cudaGetErrorName(err_) << ": " << cudaGetErrorString(err_);                \
      throw std::runtime_error(os_.str());                                              \
    }                                                                                   \
  } while (0)
#endif

#ifdef FLCOMM_WITH_NCCL
// `comm` may be nullptr (before a communicator exists); ncclGetLastError then reports the
// last error of the calling thread.
#define FLCOMM_NCCL_CHECK(expr, comm)                                                   \
  do {                                                                                  \
    ncclResult_t res_ = (expr);                                                         \
    if (res_ != ncclSuccess && res_ != ncclInProgress) {                                \
      std::ostringstream os_;                                                           \
      os_ << "NCCL error at " << __FILE__ << ":" << __LINE__ << " in `" #expr "`: "     \
          << ncclGetErrorString(res_);                                                  \
      const char* last_ = ncclGetLastError(comm);                                       \
      if (last_ != nullptr && last_[0] != '\0') os_ << " (" << last_ << ")";            \
      throw std::runtime_error(os_.str());                                              \
    }                                                                                   \
  } while (0)
#endif
