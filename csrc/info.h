// Build information: what this binary was compiled with (info.cpp; bound in bindings.cpp).
#pragma once

#include <string>

namespace flcomm {

bool compiled_with_cuda();
bool compiled_with_nccl();
std::string cuda_archs();            // e.g. "80_90", empty without CUDA
int nccl_version_compiled();         // NCCL_VERSION_CODE, 0 without NCCL
int nccl_version_loaded();           // ncclGetVersion() of the loaded libnccl, 0 without NCCL
int cuda_runtime_version();          // cudaRuntimeGetVersion(), 0 without CUDA

}  // namespace flcomm
