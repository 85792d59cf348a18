// Build information: what this binary was compiled with.
#include "info.h"

#include "common.h"

// setup.py passes the arches as a bare token (80_90): quotes do not survive the build files.
#define FLCOMM_STR_(x) #x
#define FLCOMM_STR(x) FLCOMM_STR_(x)
#ifdef FLCOMM_CUDA_ARCHS_TOKEN
#define FLCOMM_CUDA_ARCHS_STR FLCOMM_STR(FLCOMM_CUDA_ARCHS_TOKEN)
#else
#define FLCOMM_CUDA_ARCHS_STR ""
#endif

namespace flcomm {

bool compiled_with_cuda() {
#ifdef FLCOMM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool compiled_with_nccl() {
#ifdef FLCOMM_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::string cuda_archs() { return FLCOMM_CUDA_ARCHS_STR; }  // "80_90"

int nccl_version_compiled() {
#ifdef FLCOMM_WITH_NCCL
  return NCCL_VERSION_CODE;
#else
  return 0;
#endif
}

int nccl_version_loaded() {
#ifdef FLCOMM_WITH_NCCL
  int v = 0;
  FLCOMM_NCCL_CHECK(ncclGetVersion(&v), nullptr);
  return v;
#else
  return 0;
#endif
}

int cuda_runtime_version() {
#ifdef FLCOMM_WITH_CUDA
  int v = 0;
  FLCOMM_CUDA_CHECK(cudaRuntimeGetVersion(&v));
  return v;
#else
  return 0;
#endif
}

}  // namespace flcomm
