// Declarations of everything csrc/bindings.cpp binds. Kernels are torch operators in the
// `flcomm` namespace: their schemas are defined in bindings.cpp and each device's
// implementation registers itself (TORCH_LIBRARY_IMPL): CPU in quant.cpp and reorder.cpp, CUDA in
// cuda_ops.cpp (kernels in the .cu files).
#pragma once

// ---- build information (info.cpp) ----
#include "info.h"

// ---- nccl communicator (nccl_comm.cpp) ----
#include "nccl_comm.h"
