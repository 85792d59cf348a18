// The native NCCL communicator (declarations and the contract: nccl_comm.h).
//
// Everything NCCL/CUDA is compiled only with FLCOMM_WITH_NCCL (setup.py defines it when it builds
// with CUDA and finds nccl.h). Without it the same names exist and throw an error that says how
// to build with NCCL.
#include "nccl_comm.h"

#include "common.h"
#include "info.h"

#include <c10/util/Exception.h>

#ifdef FLCOMM_WITH_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>
#endif

namespace flcomm {

#ifdef FLCOMM_WITH_NCCL

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size changed");

// NOTE: NCCL gained fp8 types in 2.24; older headers do not have the enum values.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
#define FLCOMM_NCCL_HAS_FP8 1
#endif
// NOTE: ncclConfig_t.CTAPolicy and the NCCL_CTA_POLICY_* values came with NCCL 2.27.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0) && defined(NCCL_CTA_POLICY_DEFAULT)
#define FLCOMM_NCCL_HAS_CTA_POLICY 1
#endif

struct NcclCommState {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int device = 0;
  double timeout_s = 300.0;
  int max_ctas = 0;     // the split's ncclConfig_t.maxCTAs; 0: NCCL's default
  int cta_policy = -1;  // the split's ncclConfig_t.CTAPolicy; -1: NCCL's default
  // NOTE: atomic so that is_aborted / is_destroyed / repr read them without the mutex, which an
  // abort may hold for as long as the work queued ahead of it takes to drain.
  std::atomic<bool> aborted{false};
  std::atomic<bool> destroyed{false};
  std::string abort_reason;
  // Threads with an open group of this communicator, and whether an abort waits for them (see
  // abort_locked).
  int open_groups = 0;
  bool abort_deferred = false;
  // NOTE: guards `comm` and the fields above: wait() runs without the GIL and abort() may come
  // from another thread; NCCL must never see a comm that another thread is freeing.
  std::mutex mu;
  // Held by a launch from its issue until NCCL has left ncclInProgress (await_ready), and by
  // group_end and split over the same window: a non-blocking communicator used again while its
  // previous call is still in progress returns ncclInvalidArgument (NCCL init.cc, "Attempt to use
  // communicator before the previous operation returned ncclSuccess"), so a second thread waits
  // here instead (N4). Taken before `mu`, never while holding it; abort() takes only `mu`.
  std::mutex launch_mu;

  ~NcclCommState();
};

struct NcclEvent {
  cudaEvent_t event = nullptr;
  int device = 0;
  bool recorded = false;
  bool done = false;

  explicit NcclEvent(int dev) : device(dev) {}
  ~NcclEvent() {
    if (event == nullptr) return;
    // NOTE: never throws (a throwing destructor is std::terminate): at interpreter teardown the
    // CUDA context may already be gone, and the guard or the destroy may fail; nothing to report.
    try {
      c10::cuda::CUDAGuard guard(device);
      (void)cudaEventDestroy(event);
    } catch (...) {
    }
    (void)cudaGetLastError();
  }
  void record(cudaStream_t stream) {
    if (event == nullptr) FLCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    FLCOMM_CUDA_CHECK(cudaEventRecord(event, stream));
    recorded = true;
  }
  // true when complete, false when not yet; throws on a CUDA error.
  bool query() {
    if (done) return true;
    cudaError_t err = cudaEventQuery(event);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // NOTE: NotReady is not sticky, but clear it for later checks
      return false;
    }
    FLCOMM_CUDA_CHECK(err);
    done = true;
    return true;
  }
};

namespace {

using Clock = std::chrono::steady_clock;

std::string where(const NcclCommState& st) {
  std::ostringstream os;
  os << "NCCL communicator rank " << st.rank << " of " << st.size << " on cuda:" << st.device;
  return os.str();
}

// ncclCommAbort on a thread of its own; `detach`: return at once instead of joining it.
// NOTE: two reasons for the thread. (1) NCCL's groups are per thread and ncclCommAbort runs inside
// one (ncclGroupStartInternal / EndInternal): on a thread inside an open group (flcomm's, torch's or
// the caller's) the abort would join that group and run, freeing the communicator, only at its
// ncclGroupEnd. A new thread is outside every group. (2) The abort synchronizes NCCL's streams
// (commReclaim -> commDestroySync), i.e. it returns only once the work queued on the launch stream
// ahead of the communicator's kernels has run: a destructor must not wait for that, so it detaches.
// Its result is deliberately dropped: the communicator is gone whatever it returns, and a failed
// abort must not hide the error that caused it.
void nccl_abort(ncclComm_t comm, int device, bool detach) noexcept {
  if (comm == nullptr) return;
  auto body = [comm, device]() noexcept {
    (void)cudaSetDevice(device);  // NOTE: this thread's own current device
    (void)ncclCommAbort(comm);
    (void)cudaGetLastError();
  };
  try {
    std::thread t(body);
    if (detach) {
      t.detach();
    } else {
      t.join();
    }
  } catch (const std::system_error& e) {
    if (!detach) {  // NOTE: no thread to spare: abort here (correct outside any group)
      body();
      return;
    }
    std::fprintf(stderr, "flcomm: could not start a thread to abort a dropped NCCL communicator (%s); "
                         "its resources are leaked. Call destroy() or abort() before dropping it.\n",
                 e.what());
  }
}

// Caller holds st.mu. Idempotent. Marks the communicator aborted at once; the ncclCommAbort waits
// while a group of it is open on some thread, and runs at that group's end (group_end).
// NOTE: the open group links the ncclComm in that thread's NCCL group state; freeing it first would
// leave ncclGroupEnd touching freed memory.
void abort_locked(NcclCommState& st, const std::string& reason) {
  if (st.destroyed) return;
  if (!st.aborted) st.abort_reason = reason;
  st.aborted = true;
  if (st.comm == nullptr) return;
  if (st.open_groups > 0) {
    st.abort_deferred = true;
    return;
  }
  ncclComm_t comm = st.comm;
  st.comm = nullptr;
  st.abort_deferred = false;
  nccl_abort(comm, st.device, /*detach=*/false);
}

void check_alive_locked(const NcclCommState& st, const char* what) {
  TORCH_CHECK(!st.destroyed, what, ": the ", where(st), " was destroyed");
  TORCH_CHECK(!st.aborted, what, ": the ", where(st), " was aborted (", st.abort_reason, ")");
}

// The communicator's asynchronous state: ncclSuccess, ncclInProgress or an error. Caller holds
// st.mu and has checked the communicator is alive.
ncclResult_t async_state_locked(NcclCommState& st) {
  ncclResult_t state = ncclSuccess;
  FLCOMM_NCCL_CHECK(ncclCommGetAsyncError(st.comm, &state), st.comm);
  return state;
}

// Message for an asynchronous error; caller holds st.mu, the comm is still alive.
std::string async_message_locked(NcclCommState& st, ncclResult_t state, const std::string& what) {
  std::ostringstream os;
  os << what << ": NCCL error on the " << where(st) << ": " << ncclGetErrorString(state);
  const char* last = ncclGetLastError(st.comm);
  if (last != nullptr && last[0] != '\0') os << " (" << last << ")";
  os << "; the communicator was aborted";
  return os.str();
}

void sleep_backoff(int iter) {
  if (iter < 100) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (iter - 99))));
  }
}

// Non-blocking mode: an NCCL call may return ncclInProgress, and the communicator may be used
// again only once ncclCommGetAsyncError stops saying so. Polls until then, or aborts and throws
// (NcclTimeoutError after `timeout_s`).
void await_ready(NcclCommState& st, const std::string& what, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (int iter = 0;; ++iter) {
    {
      std::lock_guard<std::mutex> lock(st.mu);
      check_alive_locked(st, what.c_str());
      ncclResult_t state = async_state_locked(st);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        std::string msg = async_message_locked(st, state, what);
        abort_locked(st, msg);
        throw std::runtime_error(msg);
      }
      if (Clock::now() > deadline) {
        std::ostringstream os;
        os << what << ": the " << where(st) << " did not complete within " << timeout_s
           << " s (a peer did not join or is stuck); the communicator was aborted";
        abort_locked(st, os.str());
        throw NcclTimeoutError(os.str());
      }
    }
    sleep_backoff(iter);
  }
}

ncclDataType_t nccl_dtype(at::ScalarType t, const std::string& what) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
#ifdef FLCOMM_NCCL_HAS_FP8
    case at::kFloat8_e4m3fn: return ncclFloat8e4m3;
    case at::kFloat8_e5m2: return ncclFloat8e5m2;
#endif
    default: break;
  }
#ifdef FLCOMM_NCCL_HAS_FP8
  constexpr const char* fp8 = ", float8_e4m3fn, float8_e5m2";
#else
  constexpr const char* fp8 = " (fp8 needs NCCL >= 2.24)";
#endif
  TORCH_CHECK(false, what, ": dtype must be one of float32, bfloat16, float16, float64, int8, uint8, int32, int64",
              fp8, "; got ", t);
  return ncclFloat32;  // unreachable
}

// The NCCL reduction flcomm issues for `op` on `nranks` ranks.
// NOTE: avg over one rank is the input itself, and flcomm issues it as sum, which NCCL runs as a
// copy for every dtype. NCCL's own one-rank avg is a PreMulSum kernel (x * 1/1) whose fp8 variants
// are compiled out of NCCL's host code (onerank.cu guards them with __CUDA_ARCH__ >= 900, undefined
// on the host), so fp8 avg on one rank would fail with ncclInvalidArgument; the kernel also
// canonicalizes NaN payloads where a copy keeps them. On two or more ranks avg stays NCCL's avg.
ncclRedOp_t nccl_op(const std::string& op, int nranks, const std::string& what) {
  if (op == "sum") return ncclSum;
  if (op == "avg") return nranks == 1 ? ncclSum : ncclAvg;
  if (op == "max") return ncclMax;
  if (op == "min") return ncclMin;
  TORCH_CHECK(false, what, ": op must be one of sum, avg, max, min; got '", op, "'");
  return ncclSum;  // unreachable
}

const char* nccl_op_name(ncclRedOp_t op) {
  switch (op) {
    case ncclSum: return "sum";
    case ncclAvg: return "avg";
    case ncclMax: return "max";
    case ncclMin: return "min";
    default: return "other";
  }
}

void check_tensor(const NcclCommState& st, const at::Tensor& t, const char* name, const std::string& what) {
  TORCH_CHECK(t.defined(), what, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.is_cuda() && t.get_device() == st.device, what, ": ", name, " must be on cuda:", st.device,
              " (the communicator's device), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, ": ", name, " must be contiguous, got shape ", t.sizes(),
              " strides ", t.strides());
}

void check_pair(const NcclCommState& st, const at::Tensor& out, const at::Tensor& in, const std::string& what) {
  check_tensor(st, in, "input", what);
  check_tensor(st, out, "output", what);
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), what, ": output and input must have one dtype, got ",
              out.scalar_type(), " and ", in.scalar_type());
}

// NOTE: NCCL groups are per thread (ncclGroupStart/End nest per calling thread, and torch's
// ProcessGroupNCCL calls the same libnccl), so the open group is thread-local state, not the
// communicator's. One group holds the ops of one communicator, launched on one stream. The group
// keeps its communicator's state alive until it ends (its destructor would abort the ncclComm
// that this thread's NCCL group still links).
struct ThreadGroup {
  int depth = 0;
  std::shared_ptr<NcclCommState> comm;  // the communicator of the open group
  std::shared_ptr<NcclEvent> event;     // recorded at the outermost group_end()
  bool has_stream = false;              // whether an op was launched in the group yet
  cudaStream_t stream = nullptr;        // the stream of the group's ops
  // NOTE: the group's tensors, recorded on its stream at the outermost group_end(), once NCCL has
  // enqueued the kernels that use them (N14): a recordStream before that would let a caller that
  // drops a work and its tensor inside the group free the block ahead of the kernel
  std::vector<at::Tensor> tensors;
};
thread_local ThreadGroup tl_group;

// Every op: refused when a group of another communicator is open on this thread.
void check_group_owner(const NcclCommState& st, const std::string& what) {
  const ThreadGroup& g = tl_group;
  TORCH_CHECK(g.depth == 0 || g.comm.get() == &st, what,
              ": a group_start() of another communicator is open on this thread; a group holds the ops of "
              "one communicator (NCCL groups are per thread): call its group_end() first");
}

// Calls that NCCL would fold into this thread's open group (init, split, finalize): refused.
void check_no_group(const std::string& what) {
  TORCH_CHECK(tl_group.depth == 0, what, ": not allowed while a group_start() is open on this thread (",
              tl_group.depth, " open); NCCL would join it to the group and run it only at the group's end: "
              "call group_end() first");
}

// Inside an open group: checks that an op on `stream` may join it.
void check_group_stream(cudaStream_t stream, const std::string& what) {
  const ThreadGroup& g = tl_group;
  if (g.depth == 0) return;
  TORCH_CHECK(!g.has_stream || g.stream == stream, what, ": the ops of one group must launch on one CUDA stream; ",
              "the group's first op used stream ", static_cast<const void*>(g.stream), ", this one ",
              static_cast<const void*>(stream));
}

// NOTE: as ProcessGroupNCCL: tell the caching allocator that the tensors are used on `stream`, so
// memory allocated on another stream is not reused while the launch still reads or writes it,
// even when the caller drops the tensors and the work handle at once. A no-op when `stream` is
// the allocation stream, and for memory the caching allocator does not own.
void record_streams(const std::vector<at::Tensor>& tensors, const c10::cuda::CUDAStream& stream) {
  for (const auto& t : tensors) {
    if (t.defined() && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    }
  }
}

// "2.28.9" for an NCCL_VERSION_CODE (major * 10000 + minor * 100 + patch since NCCL 2.9).
std::string nccl_version_string(int code) {
  std::ostringstream os;
  os << code / 10000 << "." << (code / 100) % 100 << "." << code % 100;
  return os.str();
}

// The per-communicator configuration of a split, checked before anything is issued.
void check_split_config(int max_ctas, int cta_policy) {
  const char* what = "NcclComm.split";
  TORCH_CHECK(max_ctas >= 0, what, ": max_ctas must be >= 0 (0 keeps NCCL's default, > 0 caps the new ",
              "communicator's CTAs), got ", max_ctas);
  if (cta_policy == -1) return;
#ifdef FLCOMM_NCCL_HAS_CTA_POLICY
  const int loaded = nccl_version_loaded();
  TORCH_CHECK(loaded >= NCCL_VERSION(2, 27, 0), what, ": cta_policy needs NCCL >= 2.27 (ncclConfig_t.CTAPolicy), ",
              "but the loaded libnccl is ", nccl_version_string(loaded), "; pass cta_policy=-1");
  std::ostringstream names;
  for (const auto& [name, value] : nccl_cta_policies()) {
    if (value == cta_policy) return;
    names << (names.tellp() > 0 ? ", " : "") << value << " (" << name << ")";
  }
  TORCH_CHECK(false, what, ": cta_policy must be -1 (NCCL's default) or one of the NCCL_CTA_POLICY_* values ",
              names.str(), "; got ", cta_policy);
#else
  TORCH_CHECK(false, what, ": cta_policy needs NCCL >= 2.27 (ncclConfig_t.CTAPolicy), but flcomm was compiled ",
              "against NCCL ", nccl_version_string(NCCL_VERSION_CODE), "; pass cta_policy=-1");
#endif
}

}  // namespace

std::vector<std::pair<std::string, int>> nccl_cta_policies() {
  std::vector<std::pair<std::string, int>> out;
#ifdef FLCOMM_NCCL_HAS_CTA_POLICY
  out.emplace_back("default", NCCL_CTA_POLICY_DEFAULT);
#ifdef NCCL_CTA_POLICY_EFFICIENCY
  out.emplace_back("efficiency", NCCL_CTA_POLICY_EFFICIENCY);
#endif
#ifdef NCCL_CTA_POLICY_ZERO
  out.emplace_back("zero", NCCL_CTA_POLICY_ZERO);
#endif
#endif
  return out;
}

NcclCommState::~NcclCommState() {
  // NOTE: never throws and never waits. destroy() is the clean shutdown (finalize, bounded by the
  // timeout). Getting here with a live communicator means destroy() was not called: typically
  // Python's GC dropping the last reference with the GIL held, where a finalize would poll for up
  // to the timeout and even ncclCommAbort waits for the work queued ahead of the communicator's
  // kernels (it synchronizes NCCL's streams). So the abort runs on a detached thread; the
  // communicator's memory is freed once that work has drained.
  if (comm == nullptr || destroyed) return;
  nccl_abort(comm, device, /*detach=*/true);
  comm = nullptr;
  destroyed = true;
}

std::string nccl_unique_id() {
  ncclUniqueId id;
  FLCOMM_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

// ---- NcclWork ----

NcclWork::NcclWork(std::shared_ptr<NcclCommState> comm, std::shared_ptr<NcclEvent> event,
                   std::vector<at::Tensor> tensors)
    : comm_(std::move(comm)), event_(std::move(event)), tensors_(std::move(tensors)) {}

bool NcclWork::is_completed() {
  NcclCommState& st = *comm_;
  std::lock_guard<std::mutex> lock(st.mu);
  if (event_->done) return true;
  TORCH_CHECK(event_->recorded, "NcclWork: the work of an open group completes with group_end(); call it first");
  check_alive_locked(st, "NcclWork");
  c10::cuda::CUDAGuard guard(event_->device);
  if (event_->query()) return true;
  ncclResult_t state = async_state_locked(st);
  if (state != ncclSuccess && state != ncclInProgress) {
    std::string msg = async_message_locked(st, state, "NcclWork");
    abort_locked(st, msg);
    throw std::runtime_error(msg);
  }
  return false;
}

void NcclWork::stream_wait() {
  NcclCommState& st = *comm_;
  std::lock_guard<std::mutex> lock(st.mu);
  TORCH_CHECK(event_->recorded,
              "NcclWork.stream_wait: the work of an open group completes with group_end(); call it first");
  if (event_->done) return;
  check_alive_locked(st, "NcclWork.stream_wait");
  ncclResult_t state = async_state_locked(st);
  if (state != ncclSuccess && state != ncclInProgress) {
    std::string msg = async_message_locked(st, state, "NcclWork.stream_wait");
    abort_locked(st, msg);
    throw std::runtime_error(msg);
  }
  c10::cuda::CUDAGuard guard(event_->device);
  FLCOMM_CUDA_CHECK(
      cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(event_->device).stream(), event_->event, 0));
}

bool NcclWork::wait(double timeout_s) {
  NcclCommState& st = *comm_;
  if (timeout_s < 0) timeout_s = st.timeout_s;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (int iter = 0;; ++iter) {
    {
      std::lock_guard<std::mutex> lock(st.mu);
      if (event_->done) return true;
      TORCH_CHECK(event_->recorded,
                  "NcclWork.wait: the work of an open group completes with group_end(); call it first");
      check_alive_locked(st, "NcclWork.wait");
      c10::cuda::CUDAGuard guard(event_->device);
      if (event_->query()) return true;
      ncclResult_t state = async_state_locked(st);
      if (state != ncclSuccess && state != ncclInProgress) {
        std::string msg = async_message_locked(st, state, "NcclWork.wait");
        abort_locked(st, msg);
        throw std::runtime_error(msg);
      }
      if (Clock::now() > deadline) {
        std::ostringstream os;
        os << "NcclWork.wait: the collective on the " << where(st) << " did not complete within "
           << timeout_s << " s (a peer is missing or stuck); the communicator was aborted";
        abort_locked(st, os.str());
        throw NcclTimeoutError(os.str());
      }
    }
    sleep_backoff(iter);
  }
}

// ---- NcclComm ----

NcclComm::NcclComm(std::shared_ptr<NcclCommState> state) : st_(std::move(state)) {}

NcclComm::NcclComm(const std::string& unique_id, int nranks, int rank, int device, double timeout_s) {
  check_no_group("NcclComm init");
  TORCH_CHECK(unique_id.size() == NCCL_UNIQUE_ID_BYTES, "NcclComm: unique_id must be ", NCCL_UNIQUE_ID_BYTES,
              " bytes (from nccl_unique_id() on rank 0), got ", unique_id.size());
  TORCH_CHECK(nranks >= 1, "NcclComm: nranks must be >= 1, got ", nranks);
  TORCH_CHECK(rank >= 0 && rank < nranks, "NcclComm: rank must be in [0, ", nranks, "), got ", rank);
  TORCH_CHECK(timeout_s > 0, "NcclComm: timeout_s must be > 0, got ", timeout_s);
  int ndev = 0;
  try {
    FLCOMM_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  } catch (const std::exception& e) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "NcclComm needs a CUDA device, but CUDA reports none usable on this machine: ", e.what());
  }
  TORCH_CHECK(ndev > 0, "NcclComm needs a CUDA device, but none is visible");
  TORCH_CHECK(device >= 0 && device < ndev, "NcclComm: device must be a CUDA device index in [0, ", ndev,
              "), got ", device);

  auto st = std::make_shared<NcclCommState>();
  st->rank = rank;
  st->size = nranks;
  st->device = device;
  st->timeout_s = timeout_s;
  c10::cuda::CUDAGuard guard(device);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // NOTE: init returns at once; await_ready bounds the wait for peers
  try {
    FLCOMM_NCCL_CHECK(ncclCommInitRankConfig(&st->comm, nranks, id, rank, &config), nullptr);
  } catch (...) {
    nccl_abort(st->comm, device, /*detach=*/false);
    st->comm = nullptr;
    st->aborted = true;
    throw;
  }
  await_ready(*st, "NcclComm init", timeout_s);
  st_ = std::move(st);
}

NcclComm::~NcclComm() = default;  // NOTE: NcclCommState's destructor shuts NCCL down, once no
                                  // work holds the state any more

std::shared_ptr<NcclComm> NcclComm::split(int color, int key, double timeout_s, int max_ctas, int cta_policy) {
  NcclCommState& st = *st_;
  check_split_config(max_ctas, cta_policy);
  if (timeout_s < 0) timeout_s = st.timeout_s;
  check_no_group("NcclComm.split");
  std::lock_guard<std::mutex> launch_lock(st.launch_mu);  // NOTE: the split is in progress until await_ready (N4)
  auto cst = std::make_shared<NcclCommState>();
  cst->device = st.device;
  cst->timeout_s = timeout_s;
  cst->max_ctas = max_ctas;
  cst->cta_policy = cta_policy;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    check_alive_locked(st, "NcclComm.split");
    c10::cuda::CUDAGuard guard(st.device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (max_ctas > 0) {
      config.maxCTAs = max_ctas;
      config.minCTAs = 1;  // NOTE: NCCL's default; NCCL refuses a minCTAs above maxCTAs
    }
#ifdef FLCOMM_NCCL_HAS_CTA_POLICY
    if (cta_policy >= 0) config.CTAPolicy = cta_policy;
#endif
    // NOTE: with a non-blocking parent, ncclCommSplit writes *newcomm only when its async job
    // ends: the target must outlive this call (heap memory, `cst`), and is read only once the
    // parent's state has left ncclInProgress.
    FLCOMM_NCCL_CHECK(ncclCommSplit(st.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &cst->comm, &config),
                      st.comm);
  }
  try {
    // NOTE: the split is a collective of the parent: poll it (it is the only handle a rank with
    // no color has), then the child's own init.
    await_ready(st, "NcclComm.split", timeout_s);
    if (cst->comm == nullptr) {
      TORCH_CHECK(color < 0, "NcclComm.split: NCCL returned no communicator for color ", color);
      cst->destroyed = true;
      return nullptr;
    }
    await_ready(*cst, "NcclComm.split (new communicator)", timeout_s);
    FLCOMM_NCCL_CHECK(ncclCommUserRank(cst->comm, &cst->rank), cst->comm);
    FLCOMM_NCCL_CHECK(ncclCommCount(cst->comm, &cst->size), cst->comm);
  } catch (...) {
    // NOTE: a failed parent poll aborted the parent, which ends its async job: nothing writes
    // cst->comm after this point.
    std::lock_guard<std::mutex> lock(cst->mu);
    abort_locked(*cst, "split failed");
    throw;
  }
  return std::make_shared<NcclComm>(std::move(cst));
}

namespace {

// Issues one launch: checks the communicator, runs `issue(stream)` on the current stream of the
// communicator's device under a device guard, waits out ncclInProgress (non-blocking mode) and
// records the event the work waits on. Inside a group the work shares the group's event.
template <typename Issue>
std::shared_ptr<NcclWork> launch(const std::shared_ptr<NcclCommState>& sp, const std::string& what,
                                 std::vector<at::Tensor> tensors, Issue issue) {
  NcclCommState& st = *sp;
  c10::cuda::CUDAGuard guard(st.device);
  const c10::cuda::CUDAStream cstream = c10::cuda::getCurrentCUDAStream(st.device);
  const cudaStream_t stream = cstream.stream();
  check_group_stream(stream, what);
  // NOTE: inside a group nothing is in progress until group_end, which takes the lock itself
  std::unique_lock<std::mutex> launch_lock(st.launch_mu, std::defer_lock);
  if (tl_group.depth == 0) launch_lock.lock();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    check_alive_locked(st, what.c_str());
    try {
      issue(st.comm, stream);
    } catch (const std::exception&) {
      // NOTE: an argument error leaves the communicator usable; an asynchronous one does not.
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(st.comm, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        abort_locked(st, async_message_locked(st, state, what));
      }
      throw;
    }
  }
  if (tl_group.depth > 0) {
    tl_group.has_stream = true;
    tl_group.stream = stream;
    tl_group.tensors.insert(tl_group.tensors.end(), tensors.begin(), tensors.end());
    return std::make_shared<NcclWork>(sp, tl_group.event, std::move(tensors));
  }
  await_ready(st, what, st.timeout_s);
  launch_lock.unlock();
  record_streams(tensors, cstream);
  auto event = std::make_shared<NcclEvent>(st.device);
  event->record(stream);
  return std::make_shared<NcclWork>(sp, std::move(event), std::move(tensors));
}

}  // namespace

std::shared_ptr<NcclWork> NcclComm::all_reduce(const at::Tensor& tensor, const std::string& op) {
  const std::string what = "NcclComm.all_reduce";
  check_group_owner(*st_, what);
  check_tensor(*st_, tensor, "tensor", what);
  ncclDataType_t dt = nccl_dtype(tensor.scalar_type(), what);
  ncclRedOp_t rop = nccl_op(op, st_->size, what);
  void* ptr = tensor.data_ptr();
  size_t count = tensor.numel();
  return launch(st_, what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
    FLCOMM_NCCL_CHECK(ncclAllReduce(ptr, ptr, count, dt, rop, comm, stream), comm);
  });
}

std::shared_ptr<NcclWork> NcclComm::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                                   const std::string& op) {
  const std::string what = "NcclComm.reduce_scatter";
  check_group_owner(*st_, what);
  check_pair(*st_, output, input, what);
  TORCH_CHECK(input.numel() == output.numel() * st_->size, what, ": input must have size * output.numel() = ",
              st_->size, " * ", output.numel(), " = ", output.numel() * st_->size, " elements, got ", input.numel());
  ncclDataType_t dt = nccl_dtype(input.scalar_type(), what);
  ncclRedOp_t rop = nccl_op(op, st_->size, what);
  const void* in = input.data_ptr();
  void* out = output.data_ptr();
  size_t count = output.numel();
  return launch(st_, what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
    FLCOMM_NCCL_CHECK(ncclReduceScatter(in, out, count, dt, rop, comm, stream), comm);
  });
}

std::shared_ptr<NcclWork> NcclComm::all_gather(const at::Tensor& output, const at::Tensor& input) {
  const std::string what = "NcclComm.all_gather";
  check_group_owner(*st_, what);
  check_pair(*st_, output, input, what);
  TORCH_CHECK(output.numel() == input.numel() * st_->size, what, ": output must have size * input.numel() = ",
              st_->size, " * ", input.numel(), " = ", input.numel() * st_->size, " elements, got ", output.numel());
  ncclDataType_t dt = nccl_dtype(input.scalar_type(), what);
  const void* in = input.data_ptr();
  void* out = output.data_ptr();
  size_t count = input.numel();
  return launch(st_, what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
    FLCOMM_NCCL_CHECK(ncclAllGather(in, out, count, dt, comm, stream), comm);
  });
}

std::shared_ptr<NcclWork> NcclComm::all_to_all(const at::Tensor& output, const at::Tensor& input) {
  const std::string what = "NcclComm.all_to_all";
  check_group_owner(*st_, what);
  check_pair(*st_, output, input, what);
  const int n = st_->size;
  TORCH_CHECK(output.numel() == input.numel(), what, ": output and input must have one size, got ",
              output.numel(), " and ", input.numel(), " elements");
  TORCH_CHECK(input.numel() % n == 0, what, ": ", input.numel(), " elements do not split into ", n,
              " equal chunks");
  ncclDataType_t dt = nccl_dtype(input.scalar_type(), what);
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  const size_t count = input.numel() / n;
  const size_t chunk_bytes = count * input.element_size();
  return launch(st_, what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
    FLCOMM_NCCL_CHECK(ncclGroupStart(), comm);
    try {
      for (int peer = 0; peer < n; ++peer) {
        FLCOMM_NCCL_CHECK(ncclSend(in + peer * chunk_bytes, count, dt, peer, comm, stream), comm);
        FLCOMM_NCCL_CHECK(ncclRecv(out + peer * chunk_bytes, count, dt, peer, comm, stream), comm);
      }
    } catch (...) {
      // NOTE: the group must be closed even on error, or the thread stays inside it.
      (void)ncclGroupEnd();
      throw;
    }
    FLCOMM_NCCL_CHECK(ncclGroupEnd(), comm);
  });
}

std::shared_ptr<NcclWork> NcclComm::broadcast(const at::Tensor& tensor, int root) {
  const std::string what = "NcclComm.broadcast";
  check_group_owner(*st_, what);
  check_tensor(*st_, tensor, "tensor", what);
  TORCH_CHECK(root >= 0 && root < st_->size, what, ": root must be a rank in [0, ", st_->size, "), got ", root);
  ncclDataType_t dt = nccl_dtype(tensor.scalar_type(), what);
  void* ptr = tensor.data_ptr();
  size_t count = tensor.numel();
  return launch(st_, what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
    FLCOMM_NCCL_CHECK(ncclBroadcast(ptr, ptr, count, dt, root, comm, stream), comm);
  });
}

void NcclComm::group_start() {
  NcclCommState& st = *st_;
  ThreadGroup& g = tl_group;
  TORCH_CHECK(g.depth == 0 || g.comm.get() == &st, "NcclComm.group_start: a group of another communicator is ",
              "open on this thread (NCCL groups are per thread): call its group_end() first");
  std::lock_guard<std::mutex> lock(st.mu);
  check_alive_locked(st, "NcclComm.group_start");
  FLCOMM_NCCL_CHECK(ncclGroupStart(), st.comm);
  if (g.depth++ == 0) {
    g.comm = st_;
    g.event = std::make_shared<NcclEvent>(st.device);
    g.has_stream = false;
    g.stream = nullptr;
    ++st.open_groups;
  }
}

std::shared_ptr<NcclWork> NcclComm::group_end() {
  NcclCommState& st = *st_;
  const std::string what = "NcclComm.group_end";
  ThreadGroup& g = tl_group;
  TORCH_CHECK(g.depth > 0, what, ": no open group on this thread (call group_start() first)");
  TORCH_CHECK(g.comm.get() == &st, what, ": the open group belongs to another communicator");
  const bool outermost = g.depth == 1;
  std::shared_ptr<NcclEvent> event;
  const bool has_stream = g.has_stream;
  const cudaStream_t group_stream = g.stream;
  std::vector<at::Tensor> group_tensors;
  --g.depth;
  if (outermost) {
    event = std::move(g.event);
    group_tensors = std::move(g.tensors);
    g.tensors.clear();
    g.comm.reset();  // NOTE: st_ keeps the state alive for the rest of this call
    g.has_stream = false;
    g.stream = nullptr;
  }
  std::unique_lock<std::mutex> launch_lock(st.launch_mu, std::defer_lock);
  if (outermost) launch_lock.lock();  // NOTE: ncclGroupEnd enqueues the group: in progress until await_ready
  {
    std::lock_guard<std::mutex> lock(st.mu);
    // NOTE: ncclGroupEnd runs whatever happened to the communicator since group_start(), each of
    // which issued one ncclGroupStart: reporting an error before it would leave this thread inside
    // NCCL's group, where every later NCCL call on the thread (torch's too) is deferred forever.
    // An abort during the group was deferred (abort_locked), so the ncclComm is still valid here.
    std::exception_ptr end_error;
    try {
      FLCOMM_NCCL_CHECK(ncclGroupEnd(), st.comm);
    } catch (const std::exception&) {
      end_error = std::current_exception();
    }
    if (outermost && --st.open_groups == 0 && st.abort_deferred) {
      abort_locked(st, st.abort_reason);  // NOTE: the deferred ncclCommAbort, after ncclGroupEnd
    }
    check_alive_locked(st, what.c_str());
    if (end_error) {
      // NOTE: as in launch(): an argument error leaves the communicator usable, an asynchronous one not
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(st.comm, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        abort_locked(st, async_message_locked(st, state, what));
      }
      std::rethrow_exception(end_error);
    }
    if (!outermost) return nullptr;
  }
  await_ready(st, what, st.timeout_s);
  launch_lock.unlock();
  c10::cuda::CUDAGuard guard(st.device);
  // NOTE: the event goes on the stream the group's ops launched on, not on whatever stream is
  // current now; a group without ops records on the current stream.
  const cudaStream_t stream = has_stream ? group_stream : c10::cuda::getCurrentCUDAStream(st.device).stream();
  if (has_stream) record_streams(group_tensors, c10::cuda::getStreamFromExternal(group_stream, st.device));
  event->record(stream);
  return std::make_shared<NcclWork>(st_, std::move(event), std::vector<at::Tensor>{});
}

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(st_->mu);
  abort_locked(*st_, "abort() was called");
}

void NcclComm::destroy() {
  NcclCommState& st = *st_;
  const std::string what = "NcclComm.destroy";
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.destroyed) return;
    check_no_group(what);
    TORCH_CHECK(st.open_groups == 0, what, ": a group of the ", where(st), " is open on another thread ",
                "(call its group_end() first)");
    if (st.aborted) {  // NOTE: ncclCommAbort already freed everything (no group defers it here)
      st.destroyed = true;
      return;
    }
    try {
      FLCOMM_NCCL_CHECK(ncclCommFinalize(st.comm), st.comm);
    } catch (const std::exception& e) {
      abort_locked(st, e.what());
      throw;
    }
  }
  await_ready(st, "NcclComm.destroy (ncclCommFinalize)", st.timeout_s);
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.comm != nullptr) {
    c10::cuda::CUDAGuard guard(st.device);
    ncclComm_t comm = st.comm;
    st.comm = nullptr;
    st.destroyed = true;
    FLCOMM_NCCL_CHECK(ncclCommDestroy(comm), nullptr);
  }
  st.destroyed = true;
}

int NcclComm::rank() const { return st_->rank; }
int NcclComm::size() const { return st_->size; }
int NcclComm::device() const { return st_->device; }
double NcclComm::timeout() const { return st_->timeout_s; }
int NcclComm::max_ctas() const { return st_->max_ctas; }
int NcclComm::cta_policy() const { return st_->cta_policy; }
bool NcclComm::is_aborted() const { return st_->aborted; }
bool NcclComm::is_destroyed() const { return st_->destroyed; }
std::string NcclComm::repr() const {
  std::ostringstream os;
  os << "NcclComm(rank=" << st_->rank << ", size=" << st_->size << ", device=cuda:" << st_->device
     << (st_->max_ctas > 0 ? ", max_ctas=" + std::to_string(st_->max_ctas) : "")
     << (st_->cta_policy >= 0 ? ", cta_policy=" + std::to_string(st_->cta_policy) : "")
     << (is_aborted() ? ", aborted" : "") << (is_destroyed() ? ", destroyed" : "") << ")";
  return os.str();
}

int nccl_group_depth() { return tl_group.depth; }

namespace testing {

std::shared_ptr<NcclComm> unattached_comm(int rank, int size) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "unattached_comm: need 0 <= rank < size, got rank ", rank,
              " size ", size);
  auto st = std::make_shared<NcclCommState>();
  st->rank = rank;
  st->size = size;
  return std::make_shared<NcclComm>(std::move(st));
}

bool nccl_thread_in_group() {
  // NOTE: NCCL has no query for it: ncclGroupEnd outside a group returns ncclInvalidUsage (and
  // touches nothing); inside one it leaves one level, which ncclGroupStart restores.
  const ncclResult_t res = ncclGroupEnd();
  if (res == ncclInvalidUsage) return false;
  FLCOMM_NCCL_CHECK(res, nullptr);
  FLCOMM_NCCL_CHECK(ncclGroupStart(), nullptr);
  return true;
}

std::string nccl_reduction(const std::string& op, int nranks) {
  TORCH_CHECK(nranks >= 1, "nccl_reduction: nranks must be >= 1, got ", nranks);
  return nccl_op_name(nccl_op(op, nranks, "nccl_reduction"));
}

}  // namespace testing

#else  // !FLCOMM_WITH_NCCL: same names, every call says how to get NCCL

struct NcclCommState {};
struct NcclEvent {};

namespace {
[[noreturn]] void no_nccl() {
  throw std::runtime_error(
#ifdef FLCOMM_WITH_CUDA
      "flcomm was built without NCCL (nccl.h was not found at build time), so the NCCL communicator "
      "is unavailable. Install the NCCL torch uses (pip install nvidia-nccl-cu13, or set NCCL_HOME) and "
      "rebuild: `pip install --no-build-isolation -e .`"
#else
      "flcomm was built without NCCL (a CPU-only build: no CUDA build of torch, no CUDA toolkit, or "
      "FLCOMM_CUDA=0), so the NCCL communicator is unavailable. Rebuild against a CUDA build of torch "
      "with CUDA_HOME set and the nvidia-nccl wheel installed: "
      "`CUDA_HOME=/usr/local/cuda FLCOMM_CUDA=1 pip install --no-build-isolation -e .`"
#endif
  );
}
}  // namespace

std::string nccl_unique_id() { no_nccl(); }
NcclWork::NcclWork(std::shared_ptr<NcclCommState> comm, std::shared_ptr<NcclEvent> event,
                   std::vector<at::Tensor> tensors)
    : comm_(std::move(comm)), event_(std::move(event)), tensors_(std::move(tensors)) {}
bool NcclWork::wait(double) { no_nccl(); }
bool NcclWork::is_completed() { no_nccl(); }
void NcclWork::stream_wait() { no_nccl(); }
NcclComm::NcclComm(std::shared_ptr<NcclCommState> state) : st_(std::move(state)) {}
NcclComm::NcclComm(const std::string&, int, int, int, double) { no_nccl(); }
NcclComm::~NcclComm() = default;
std::shared_ptr<NcclComm> NcclComm::split(int, int, double, int, int) { no_nccl(); }
std::shared_ptr<NcclWork> NcclComm::all_reduce(const at::Tensor&, const std::string&) { no_nccl(); }
std::shared_ptr<NcclWork> NcclComm::reduce_scatter(const at::Tensor&, const at::Tensor&, const std::string&) {
  no_nccl();
}
std::shared_ptr<NcclWork> NcclComm::all_gather(const at::Tensor&, const at::Tensor&) { no_nccl(); }
std::shared_ptr<NcclWork> NcclComm::all_to_all(const at::Tensor&, const at::Tensor&) { no_nccl(); }
std::shared_ptr<NcclWork> NcclComm::broadcast(const at::Tensor&, int) { no_nccl(); }
void NcclComm::group_start() { no_nccl(); }
std::shared_ptr<NcclWork> NcclComm::group_end() { no_nccl(); }
void NcclComm::abort() { no_nccl(); }
void NcclComm::destroy() { no_nccl(); }
int NcclComm::rank() const { no_nccl(); }
int NcclComm::size() const { no_nccl(); }
int NcclComm::device() const { no_nccl(); }
double NcclComm::timeout() const { no_nccl(); }
int NcclComm::max_ctas() const { no_nccl(); }
int NcclComm::cta_policy() const { no_nccl(); }
bool NcclComm::is_aborted() const { no_nccl(); }
bool NcclComm::is_destroyed() const { no_nccl(); }
std::string NcclComm::repr() const { no_nccl(); }
int nccl_group_depth() { return 0; }
std::vector<std::pair<std::string, int>> nccl_cta_policies() { return {}; }
namespace testing {
std::shared_ptr<NcclComm> unattached_comm(int, int) { no_nccl(); }
bool nccl_thread_in_group() { no_nccl(); }
std::string nccl_reduction(const std::string&, int) { no_nccl(); }
}  // namespace testing

#endif  // FLCOMM_WITH_NCCL

}  // namespace flcomm
