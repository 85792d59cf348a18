// The one binding file of flcomm._C. Bindings only bind: declarations are in ops.h (and the
// headers it names), implementations in their own source files.
#include "ops.h"

// ---- torch operators: schemas here, implementations per device in their own files ----
TORCH_LIBRARY(flcomm, m) {
  // [quantization kernels]
  // quant.cpp / quant_cuda.cu (layout in quant.h): fmt is int8, fp8, bf16 or fp16
  m.def("quantize(Tensor x, Tensor(a!) out, str fmt, int block_size) -> ()");
  m.def("dequantize(Tensor buf, Tensor(a!) out, str fmt, int block_size, bool accumulate) -> ()");
  m.def("quantize_error_feedback(Tensor x, Tensor(a!) residual, Tensor(a!) out, str fmt, int block_size) -> ()");
  // [reorder kernels]
  // reorder.cpp / reorder_cuda.cu: view input as [rows, cols, chunk], write [cols, rows, chunk]
  m.def("shard_transpose(Tensor input, int rows, int cols) -> Tensor");
  m.def("shard_transpose_out(Tensor input, int rows, int cols, Tensor(a!) out) -> Tensor(a!)");
}

// ---- pybind11 module ----
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flcomm native core: CPU/CUDA kernels (torch.ops.flcomm.*) and the NCCL communicator";

  // build information
  m.def("compiled_with_cuda", &flcomm::compiled_with_cuda);
  m.def("compiled_with_nccl", &flcomm::compiled_with_nccl);
  m.def("cuda_archs", &flcomm::cuda_archs);
  m.def("nccl_version_compiled", &flcomm::nccl_version_compiled);
  m.def("nccl_version_loaded", &flcomm::nccl_version_loaded);
  m.def("cuda_runtime_version", &flcomm::cuda_runtime_version);

  // [nccl communicator]
}
