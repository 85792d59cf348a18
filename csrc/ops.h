// Declarations of everything csrc/bindings.cpp binds. Kernels are torch operators in the
// `flcomm` namespace: their schemas are defined in bindings.cpp and each device's
// implementation registers itself (TORCH_LIBRARY_IMPL) in its own source file.
#pragma once

#include <torch/extension.h>

#include <string>

namespace flcomm {

// ---- build information (info.cpp) ----
bool compiled_with_cuda();
bool compiled_with_nccl();
std::string cuda_archs();            // e.g. "80_90", empty without CUDA
int nccl_version_compiled();         // NCCL_VERSION_CODE, 0 without NCCL
int nccl_version_loaded();           // ncclGetVersion() of the loaded libnccl, 0 without NCCL
int cuda_runtime_version();          // cudaRuntimeGetVersion(), 0 without CUDA

}  // namespace flcomm

// ---- nccl communicator (nccl_comm.h) ----
#include "nccl_comm.h"
