// The one binding file of flcomm._C. Bindings only bind: declarations are in ops.h (and the
// headers it names), implementations in their own source files.
#include "ops.h"

// NOTE: not torch/extension.h (the whole C++ frontend: autograd, nn, optim): the op registry and
// torch's pybind11 glue (the at::Tensor caster) are all this file needs, at a fraction of the
// compile time.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

// ---- torch operators: schemas here, implementations per device in their own files ----
TORCH_LIBRARY(flcomm, m) {
  // [quantization kernels]
  // quant.cpp (+ quant_cuda.cu: CUDA kernels; layout in quant.h): fmt is int8, fp8, bf16 or fp16
  m.def("quantize(Tensor x, Tensor(a!) out, str fmt, int block_size) -> ()");
  m.def("dequantize(Tensor buf, Tensor(a!) out, str fmt, int block_size, bool accumulate) -> ()");
  m.def("quantize_error_feedback(Tensor x, Tensor(a!) residual, Tensor(a!) out, str fmt, int block_size) -> ()");
  // [reorder kernels]
  // reorder.cpp (+ reorder_cuda.cu): view input as [rows, cols, chunk], write [cols, rows, chunk]
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
  // nccl_comm.h. Every call that may wait, for peers, the GPU or the communicator's mutex (which
  // an abort holds until NCCL has freed it), releases the GIL; the flags are atomics.
  {
    namespace py = pybind11;
    using flcomm::NcclComm;
    using flcomm::NcclWork;
    using nogil = py::call_guard<py::gil_scoped_release>;
    py::register_exception<flcomm::NcclTimeoutError>(m, "NcclTimeoutError", PyExc_TimeoutError);
    m.attr("NCCL_UNIQUE_ID_BYTES") = flcomm::kNcclUniqueIdBytes;
    m.def("nccl_unique_id", [] { return py::bytes(flcomm::nccl_unique_id()); },
          "ncclGetUniqueId(): the 128 bytes rank 0 shares with the other ranks (needs no GPU)");
    py::class_<NcclWork, std::shared_ptr<NcclWork>>(m, "NcclWork")
        .def("wait", &NcclWork::wait, py::arg("timeout_s") = -1.0, nogil())
        .def("is_completed", &NcclWork::is_completed, nogil())
        .def("stream_wait", &NcclWork::stream_wait, nogil());
    py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
        .def(py::init<const std::string&, int, int, int, double>(), py::arg("unique_id"), py::arg("nranks"),
             py::arg("rank"), py::arg("device"), py::arg("timeout_s") = 300.0, nogil())
        .def("split", &NcclComm::split, py::arg("color"), py::arg("key"), py::arg("timeout_s") = -1.0, nogil())
        .def("all_reduce", &NcclComm::all_reduce, py::arg("tensor"), py::arg("op") = "sum", nogil())
        .def("reduce_scatter", &NcclComm::reduce_scatter, py::arg("output"), py::arg("input"),
             py::arg("op") = "sum", nogil())
        .def("all_gather", &NcclComm::all_gather, py::arg("output"), py::arg("input"), nogil())
        .def("all_to_all", &NcclComm::all_to_all, py::arg("output"), py::arg("input"), nogil())
        .def("broadcast", &NcclComm::broadcast, py::arg("tensor"), py::arg("root") = 0, nogil())
        .def("group_start", &NcclComm::group_start, nogil())
        .def("group_end", &NcclComm::group_end, nogil())
        .def("abort", &NcclComm::abort, nogil())
        .def("destroy", &NcclComm::destroy, nogil())
        .def_property_readonly("rank", &NcclComm::rank)
        .def_property_readonly("size", &NcclComm::size)
        .def_property_readonly("device", &NcclComm::device)
        .def_property_readonly("timeout", &NcclComm::timeout)
        .def_property_readonly("is_aborted", &NcclComm::is_aborted)
        .def_property_readonly("is_destroyed", &NcclComm::is_destroyed)
        .def("__repr__", &NcclComm::repr);
    m.def("nccl_group_depth", &flcomm::nccl_group_depth,
          "How many NcclComm.group_start() blocks are open on the calling thread (needs no GPU)");
    auto t = m.def_submodule("_testing", "host-logic hooks of the NCCL communicator, for tests without a GPU");
    t.def("unattached_comm", &flcomm::testing::unattached_comm, py::arg("rank"), py::arg("size"));
    t.def("nccl_thread_in_group", &flcomm::testing::nccl_thread_in_group);
    t.def("nccl_reduction", &flcomm::testing::nccl_reduction, py::arg("op"), py::arg("nranks"));
  }
}
