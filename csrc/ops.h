// Declarations of everything csrc/bindings.cpp binds. Kernels are torch operators in the
// `flcomm` namespace: their schemas are defined in bindings.cpp and each device's
// implementation registers itself (TORCH_LIBRARY_IMPL) in the operator's source file (quant.cpp,
// reorder.cpp, sparse.cpp, apply.cpp: CPU kernels, and the CUDA implementations, which launch
// the kernels of the .cu files).
#pragma once

// ---- build information (info.cpp) ----
#include "info.h"

// ---- nccl communicator (nccl_comm.cpp) ----
#include "nccl_comm.h"
