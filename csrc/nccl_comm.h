// The native NCCL communicator: NCCL called directly, on the caller's current CUDA stream, with
// every return code checked and a timeout (async-error polling + ncclCommAbort) on everything
// that waits for peers, so a dead peer gives an exception instead of a hang.
//
// The declarations here do not depend on nccl.h: the state lives behind a pointer, and a build
// without NCCL (FLCOMM_WITH_NCCL undefined) compiles the same names, whose calls throw an error
// that says how to build with NCCL.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flcomm {

// Raised when a communicator init or a collective does not complete within its timeout (the
// communicator has been aborted by then). Bound as flcomm._C.NcclTimeoutError(TimeoutError).
struct NcclTimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct NcclCommState;  // the ncclComm_t and its flags (nccl_comm.cpp)
struct NcclEvent;      // a CUDA event recorded after a launch (nccl_comm.cpp)

// Bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
constexpr int kNcclUniqueIdBytes = 128;

// ncclGetUniqueId(): 128 bytes for rank 0 to share with the others. Needs no GPU.
std::string nccl_unique_id();

// Handle of one launch (or of one ncclGroupStart/End block). Keeps the communicator and the
// tensors alive until it is destroyed.
class NcclWork {
 public:
  NcclWork(std::shared_ptr<NcclCommState> comm, std::shared_ptr<NcclEvent> event,
           std::vector<at::Tensor> tensors);
  // Blocks until the launch has completed on the GPU: polls cudaEventQuery and
  // ncclCommGetAsyncError. On an NCCL error or after `timeout_s` (< 0: the communicator's
  // timeout) aborts the communicator and throws (NcclTimeoutError on timeout). Returns true.
  bool wait(double timeout_s = -1.0);
  // Non-blocking: whether the launch has completed; throws on an NCCL error (after aborting).
  bool is_completed();
  // Non-blocking wait, as torch's ProcessGroupNCCL Work.wait(): the current stream of the
  // communicator's device waits for the launch (cudaStreamWaitEvent); the host does not block.
  // Throws (after aborting) when the communicator has already reported an NCCL error.
  void stream_wait();

 private:
  std::shared_ptr<NcclCommState> comm_;
  std::shared_ptr<NcclEvent> event_;
  std::vector<at::Tensor> tensors_;
};

// One NCCL communicator on one CUDA device.
class NcclComm {
 public:
  // Collective over the `nranks` processes that pass the same `unique_id`. Non-blocking init
  // (ncclConfig_t.blocking = 0) polled with ncclCommGetAsyncError: a peer that does not join
  // within `timeout_s` gives ncclCommAbort and NcclTimeoutError.
  NcclComm(const std::string& unique_id, int nranks, int rank, int device, double timeout_s);
  ~NcclComm();

  // ncclCommSplit: ranks passing one `color` form a new communicator, ordered by `key` (ties
  // by rank); color < 0 (NCCL_SPLIT_NOCOLOR) joins none and gets nullptr (None). Collective.
  // The new communicator's own configuration: `max_ctas` > 0 caps the CTAs (SMs) its kernels use
  // (ncclConfig_t.maxCTAs, minCTAs 1), 0 keeps NCCL's default; `cta_policy` >= 0 sets
  // ncclConfig_t.CTAPolicy (one of nccl_cta_policies(); NCCL >= 2.27), -1 keeps NCCL's default.
  // Both are checked before anything is issued.
  std::shared_ptr<NcclComm> split(int color, int key, double timeout_s = -1.0, int max_ctas = 0,
                                  int cta_policy = -1);

  // Collectives, launched on the current CUDA stream of the communicator's device. `op` is
  // "sum", "avg", "max" or "min"; avg over a one-rank communicator is the input itself, issued as
  // sum (a copy) for every dtype (nccl_comm.cpp nccl_op). Every check runs before anything is issued. The tensors are
  // recorded on the launch stream with the caching allocator (recordStream). Inside a
  // group_start()/group_end() block the returned work completes with the block's group_end().
  std::shared_ptr<NcclWork> all_reduce(const at::Tensor& tensor, const std::string& op);
  std::shared_ptr<NcclWork> reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                           const std::string& op);
  std::shared_ptr<NcclWork> all_gather(const at::Tensor& output, const at::Tensor& input);
  // Chunk j of `input` goes to rank j, chunk i of `output` comes from rank i (ncclSend/ncclRecv
  // per peer inside one group).
  std::shared_ptr<NcclWork> all_to_all(const at::Tensor& output, const at::Tensor& input);
  std::shared_ptr<NcclWork> broadcast(const at::Tensor& tensor, int root);

  // Groups are per thread, as NCCL's: a group holds the ops of this communicator only, all on
  // one stream (other communicators or streams are rejected before anything is issued; so are
  // init, split and destroy while any group is open on the thread, which NCCL would fold into it).
  // NOTE: NCCL's group state is the thread's, shared by every NCCL user in the process: a
  // torch.distributed NCCL collective issued on this thread inside the block joins the group
  // (ncclGroupCommJoin) and is launched only at group_end(), so its Work reports completion of
  // nothing. flcomm cannot see torch's calls; nccl_group_depth() lets Python refuse them.
  void group_start();
  // Ends the innermost block; the outermost one launches the block and returns its work, whose
  // event is recorded on the stream of the group's ops (nullptr for an inner one). ncclGroupEnd
  // always runs, so the thread leaves NCCL's group even when this throws (e.g. the communicator
  // was aborted during the block).
  std::shared_ptr<NcclWork> group_end();

  // ncclCommAbort: drops outstanding work; the communicator is unusable afterwards. Returns once
  // NCCL has freed it, which waits for the work queued on the launch streams ahead of its kernels
  // (run without the GIL). While a group of it is open on some thread the communicator is marked
  // aborted at once and the ncclCommAbort runs at that group's end.
  void abort();
  // ncclCommFinalize (bounded by the timeout, else abort) + ncclCommDestroy. Idempotent. A
  // communicator dropped without destroy() is aborted (never finalized) by its destructor, on a
  // detached thread: the destructor neither waits nor throws, and NCCL frees the communicator once
  // the work queued ahead of it has run.
  void destroy();

  int rank() const;
  int size() const;
  int device() const;
  double timeout() const;
  // What the communicator was created with: the split's max_ctas / cta_policy (0 / -1: NCCL's
  // defaults, as for a root communicator).
  int max_ctas() const;
  int cta_policy() const;
  bool is_aborted() const;
  bool is_destroyed() const;
  std::string repr() const;

  explicit NcclComm(std::shared_ptr<NcclCommState> state);  // used by split()

 private:
  std::shared_ptr<NcclCommState> st_;
};

// How many group_start() blocks are open on the calling thread (0 without NCCL). Needs no GPU.
int nccl_group_depth();

// The CTA policies of the compiled nccl.h (NCCL_CTA_POLICY_* by name, e.g. "efficiency"): the
// values NcclComm.split accepts as cta_policy. Empty without NCCL or before NCCL 2.27.
std::vector<std::pair<std::string, int>> nccl_cta_policies();

// Host-logic hooks for tests on machines without a GPU (bound as flcomm._C._testing).
namespace testing {
// A communicator with no ncclComm behind it (rank and size only): group_start / group_end /
// abort / the checks run, and a collective fails at its tensor checks.
std::shared_ptr<NcclComm> unattached_comm(int rank, int size);
// Whether the calling thread is inside an NCCL group (ncclGroupStart without its ncclGroupEnd).
// Probes with ncclGroupEnd + ncclGroupStart: call it only with no ops queued in the group.
bool nccl_thread_in_group();
// The NCCL reduction ("sum", "avg", ...) flcomm issues for `op` on `nranks` ranks.
std::string nccl_reduction(const std::string& op, int nranks);
}  // namespace testing

}  // namespace flcomm
