// The one binding file of flcomm._C. Bindings only bind: declarations are in ops.h (and the
// headers it names), implementations in their own source files.
#include "ops.h"

// NOTE: not torch/extension.h (the whole C++ frontend: autograd, nn, optim): the op registry and
// torch's pybind11 glue (the at::Tensor caster) are all this file needs, at a fraction of the
// compile time.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>

// ---- torch operators: schemas here, implementations per device in their own files ----
TORCH_LIBRARY(flcomm, m) {
  // [quantization kernels]
  // quant.cpp (+ quant_cuda.cu: CUDA kernels; layout in quant.h): fmt is int8, fp8, bf16 or fp16
  m.def("quantize(Tensor x, Tensor(a!) out, str fmt, int block_size) -> ()");
  m.def("dequantize(Tensor buf, Tensor(a!) out, str fmt, int block_size, bool accumulate) -> ()");
  m.def("quantize_error_feedback(Tensor x, Tensor(a!) residual, Tensor(a!) out, str fmt, int block_size) -> ()");
  // [sparse top-k kernels]
  // sparse.cpp (+ sparse_cuda.cu; layout and rule in sparse.h): k of each block of `block`
  // elements kept, in `bits` bits each; with a residual, fused error feedback
  m.def("topk_encode(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int block, int k, int bits) -> ()");
  m.def("topk_decode(Tensor buf, Tensor(a!) out, int block, int k, int bits, bool accumulate) -> ()");
  // [reorder kernels]
  // reorder.cpp (+ reorder_cuda.cu): view input as [rows, cols, chunk], write [cols, rows, chunk]
  m.def("shard_transpose(Tensor input, int rows, int cols) -> Tensor");
  m.def("shard_transpose_out(Tensor input, int rows, int cols, Tensor(a!) out) -> Tensor(a!)");
  // [the exchange's fused apply]
  // apply.cpp (+ apply_cuda.cu): where ok, anchor += mean; target = correction ? anchor - target : anchor
  m.def("apply_average(Tensor mean, Tensor(a!) anchor, Tensor(b!) target, Tensor ok, bool correction) -> ()");
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
        .def("wait", &NcclWork::wait, py::arg("timeout_s") = -1.0, nogil(),
             "Blocks until the launch has completed on the GPU; aborts the communicator and raises on an NCCL "
             "error or after timeout_s (< 0: the communicator's timeout; NcclTimeoutError). Returns True.")
        .def("is_completed", &NcclWork::is_completed, nogil(),
             "Whether the launch has completed (non-blocking); raises, after aborting, on an NCCL error.")
        .def("stream_wait", &NcclWork::stream_wait, nogil(),
             "The current stream of the communicator's device waits for the launch; the host does not block.");
    py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
        .def(py::init<const std::string&, int, int, int, double>(), py::arg("unique_id"), py::arg("nranks"),
             py::arg("rank"), py::arg("device"), py::arg("timeout_s") = 300.0, nogil(),
             "Collective init over the nranks processes passing one unique_id (nccl_unique_id() of rank 0), on "
             "CUDA device `device`; a peer missing after timeout_s aborts it (NcclTimeoutError). NCCL's "
             "default configuration.")
        // NOTE: std::optional so that the signature in __doc__ says the None a rank with no color gets
        .def("split",
             [](NcclComm& self, int color, int key, double timeout_s, int max_ctas,
                int cta_policy) -> std::optional<std::shared_ptr<NcclComm>> {
               auto comm = self.split(color, key, timeout_s, max_ctas, cta_policy);
               if (!comm) return std::nullopt;
               return comm;
             },
             py::arg("color"), py::arg("key"), py::arg("timeout_s") = -1.0,
             py::arg("max_ctas") = 0, py::arg("cta_policy") = -1, nogil(),
             "ncclCommSplit (collective): ranks passing one color form a new communicator ordered by key; "
             "color < 0 joins none and returns None. timeout_s < 0: this communicator's timeout. max_ctas > 0 "
             "caps the new communicator's CTAs (ncclConfig_t.maxCTAs), 0 keeps NCCL's default; cta_policy "
             "one of NCCL_CTA_POLICIES' values (ncclConfig_t.CTAPolicy, NCCL >= 2.27), -1 keeps NCCL's "
             "default. Both are checked before anything is issued.")
        .def("all_reduce", &NcclComm::all_reduce, py::arg("tensor"), py::arg("op") = "sum", nogil(),
             "In-place all-reduce on the current stream; op: sum, avg, max or min. Returns an NcclWork.")
        .def("reduce_scatter", &NcclComm::reduce_scatter, py::arg("output"), py::arg("input"),
             py::arg("op") = "sum", nogil(),
             "Reduce-scatter of input (size * output.numel() elements) into output; op: sum, avg, max or min.")
        .def("all_gather", &NcclComm::all_gather, py::arg("output"), py::arg("input"), nogil(),
             "All-gather of input into output (size * input.numel() elements), rank order.")
        .def("all_to_all", &NcclComm::all_to_all, py::arg("output"), py::arg("input"), nogil(),
             "Chunk j of input goes to rank j, chunk i of output comes from rank i (equal chunks).")
        .def("broadcast", &NcclComm::broadcast, py::arg("tensor"), py::arg("root") = 0, nogil(),
             "In-place broadcast of tensor from rank root.")
        .def("group_start", &NcclComm::group_start, nogil(),
             "Opens an NCCL group on this thread for this communicator's ops (nests; one stream per group).")
        .def("group_end", &NcclComm::group_end, nogil(),
             "Ends the innermost group; the outermost launches it and returns its NcclWork (None for an inner one).")
        .def("abort", &NcclComm::abort, nogil(),
             "ncclCommAbort: drops outstanding work; the communicator is unusable afterwards.")
        .def("destroy", &NcclComm::destroy, nogil(),
             "ncclCommFinalize (bounded by the timeout, else abort) and ncclCommDestroy. Idempotent.")
        .def_property_readonly("rank", &NcclComm::rank, "This process's rank in the communicator.")
        .def_property_readonly("size", &NcclComm::size, "How many ranks the communicator has.")
        .def_property_readonly("device", &NcclComm::device, "The CUDA device index the communicator runs on.")
        .def_property_readonly("timeout", &NcclComm::timeout, "Seconds a wait for peers may take before an abort.")
        .def_property_readonly("max_ctas", &NcclComm::max_ctas,
                               "The max_ctas it was split with (ncclConfig_t.maxCTAs); 0: NCCL's default (a root).")
        .def_property_readonly("cta_policy", &NcclComm::cta_policy,
                               "The cta_policy it was split with (ncclConfig_t.CTAPolicy); -1: NCCL's default (a root).")
        .def_property_readonly("is_aborted", &NcclComm::is_aborted, "Whether the communicator was aborted.")
        .def_property_readonly("is_destroyed", &NcclComm::is_destroyed, "Whether the communicator was destroyed.")
        .def("__repr__", &NcclComm::repr);
    {
      py::dict policies;
      for (const auto& [name, value] : flcomm::nccl_cta_policies()) policies[py::str(name)] = value;
      m.attr("NCCL_CTA_POLICIES") = policies;  // NOTE: empty without NCCL or before NCCL 2.27
    }
    m.def("nccl_group_depth", &flcomm::nccl_group_depth,
          "How many NcclComm.group_start() blocks are open on the calling thread (needs no GPU)");
    auto t = m.def_submodule("_testing", "host-logic hooks of the NCCL communicator, for tests without a GPU");
    t.def("unattached_comm", &flcomm::testing::unattached_comm, py::arg("rank"), py::arg("size"));
    t.def("nccl_thread_in_group", &flcomm::testing::nccl_thread_in_group);
    t.def("nccl_reduction", &flcomm::testing::nccl_reduction, py::arg("op"), py::arg("nranks"));
  }
}
