// The fused apply of FedAvg's exchange: the operator flcomm::apply_average, CPU kernel and, with
// FLCOMM_WITH_CUDA, the CUDA implementation (the same checks, then apply_cuda.cu's kernel on
// torch's current stream under a device guard).
//
// apply_average(mean, anchor, target, ok, correction), elementwise over tensors of one dtype
// (float32 or float64), where the 0-dim bool `ok` holds:
//
//     a = anchor + mean;  anchor = a;  target = correction ? a - target : a
//
// (with overlap `target` is the local shard as of the sync, which becomes the correction the
// apply step adds, the new anchor less it; without, the local shard, which becomes the new
// anchor). Where `ok` does not hold,
// nothing is written. One pass over the three tensors instead of torch's three or four (masking
// the mean, the anchor's add, the target's update), and `ok` is read where it lives:
// on the CPU from memory, on CUDA by the kernel, so the host never waits for the device.
//
// Each element is one IEEE add or subtract, so every implementation (and the plain-torch
// reference in flcomm/apply.py) gives the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#ifdef FLCOMM_WITH_CUDA
#include "cuda_kernels.h"
// NOTE: not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which this toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>

namespace flcomm {
namespace {

constexpr int64_t kGrain = 1 << 16;

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* pa = static_cast<const char*>(a.const_data_ptr());
  const auto* pb = static_cast<const char*>(b.const_data_ptr());
  const auto na = static_cast<int64_t>(a.numel()) * a.element_size();
  const auto nb = static_cast<int64_t>(b.numel()) * b.element_size();
  return pa < pb + nb && pb < pa + na;
}

void check_apply(const at::Tensor& mean, const at::Tensor& anchor, const at::Tensor& target, const at::Tensor& ok) {
  const auto dt = mean.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "apply_average: mean must be float32 or float64, got ", dt);
  for (const auto* t : {&anchor, &target}) {
    TORCH_CHECK(t->scalar_type() == dt, "apply_average: anchor and target must have mean's dtype (", dt, "), got ",
                anchor.scalar_type(), " and ", target.scalar_type());
    TORCH_CHECK(t->numel() == mean.numel(), "apply_average: anchor and target must have mean's ", mean.numel(),
                " elements, got ", anchor.numel(), " and ", target.numel());
    TORCH_CHECK(t->device() == mean.device(), "apply_average: anchor and target must be on mean's device (",
                mean.device(), "), got ", anchor.device(), " and ", target.device());
  }
  TORCH_CHECK(mean.is_contiguous() && anchor.is_contiguous() && target.is_contiguous(),
              "apply_average: mean, anchor and target must be contiguous, got strides ", mean.strides(), ", ",
              anchor.strides(), " and ", target.strides());
  TORCH_CHECK(ok.scalar_type() == at::kBool && ok.numel() == 1 && ok.device() == mean.device(),
              "apply_average: ok must be one bool on mean's device (", mean.device(), "), got ", ok.numel(),
              " element(s) of ", ok.scalar_type(), " on ", ok.device());
  TORCH_CHECK(!overlap(mean, anchor) && !overlap(mean, target) && !overlap(anchor, target) &&
                  !overlap(ok, anchor) && !overlap(ok, target),
              "apply_average: anchor and target must not overlap each other, mean or ok in memory");
}

template <typename T>
void apply_cpu(const T* __restrict__ m, T* __restrict__ a, T* __restrict__ t, int64_t n, bool correction) {
  at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
    if (correction) {
      for (int64_t i = i0; i < i1; ++i) {
        const T v = a[i] + m[i];
        a[i] = v;
        t[i] = v - t[i];
      }
    } else {
      for (int64_t i = i0; i < i1; ++i) {
        const T v = a[i] + m[i];
        a[i] = v;
        t[i] = v;
      }
    }
  });
}

void apply_average_cpu(const at::Tensor& mean, at::Tensor& anchor, at::Tensor& target, const at::Tensor& ok,
                       bool correction) {
  check_apply(mean, anchor, target, ok);
  if (mean.numel() == 0 || !*ok.const_data_ptr<bool>()) return;
  if (mean.scalar_type() == at::kFloat) {
    apply_cpu(mean.const_data_ptr<float>(), anchor.data_ptr<float>(), target.data_ptr<float>(), mean.numel(),
              correction);
  } else {
    apply_cpu(mean.const_data_ptr<double>(), anchor.data_ptr<double>(), target.data_ptr<double>(), mean.numel(),
              correction);
  }
}

#ifdef FLCOMM_WITH_CUDA
void apply_average_cuda(const at::Tensor& mean, at::Tensor& anchor, at::Tensor& target, const at::Tensor& ok,
                        bool correction) {
  check_apply(mean, anchor, target, ok);
  if (mean.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(mean.device());
  cuda::apply_average(mean.scalar_type() == at::kDouble, mean.const_data_ptr(), anchor.data_ptr(),
                      target.data_ptr(), mean.numel(), ok.const_data_ptr<bool>(), correction,
                      c10::cuda::getCurrentCUDAStream(mean.device().index()).stream());
}
#endif  // FLCOMM_WITH_CUDA

}  // namespace

TORCH_LIBRARY_IMPL(flcomm, CPU, m) { m.impl("apply_average", &apply_average_cpu); }

#ifdef FLCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(flcomm, CUDA, m) { m.impl("apply_average", &apply_average_cuda); }
#endif

}  // namespace flcomm
