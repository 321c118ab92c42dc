// mirage::linear on CUDA: one cuBLASLt matmul whose epilogue adds the bias and the residual, so
// x @ weight^T + bias + residual costs one pass over the output instead of PyTorch's two or three;
// for up to 8 rows (time embeddings) one kernel of mirage's own, the input activation included;
// for float32 outputs of up to 32 features from many rows (PaiNN's basis gradient) another; other
// float32 products may run on a third, tiled one (TF32 tensor cores, float32's accuracy).
// The algorithm is timed, not guessed: cuBLASLt's first heuristic pick was up to 1.6x slower than
// its best candidate at the U-Net's [8192, 320] x [320, 320] (docs/perf/norms.md), so the first
// eager call of each problem times the heuristic's candidates, and the tiled kernel where it
// applies, and keeps the fastest.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <cublasLt.h>
#include <torch/library.h>

#include "../../cuda/linear.cuh"
#include "bias_act.h"
#include "cuda_utils.h"
#include "linear.h"
#include "message.h"

namespace mirage::ops {
namespace {

// Whether PyTorch lets float32 CUDA matmuls use TF32 now, read through its newer API (CUDA
// matmul's setting, the generic one where that is NONE), as mirage.ops.tf32_matmuls reads it:
// the legacy getter, allowTF32CuBLAS(), raises once a caller has used both APIs (say
// torch.backends.cuda.matmul.fp32_precision = "tf32" alone).
bool tf32_matmuls() {
  const auto& context = at::globalContext();
  at::Float32Precision precision = context.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL);
  if (precision == at::Float32Precision::NONE)
    precision = context.float32Precision(at::Float32Backend::GENERIC, at::Float32Op::ALL);
  return precision == at::Float32Precision::TF32;
}

void check_lt(cublasStatus_t status, const char* call) {
  MIRAGE_CHECK(status == CUBLAS_STATUS_SUCCESS, kLinear, ": ", call, " failed: ",
              cublasLtGetStatusString(status));
}

// cuBLASLt descriptors, destroyed with their scope.
struct Descriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~Descriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    for (cublasLtMatrixLayout_t layout : {a, b, c, d})
      if (layout) cublasLtMatrixLayoutDestroy(layout);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

// t as row-major [rows, cols] with unit column stride: a view where t allows one, else a copy.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  at::Tensor r = t.reshape({rows, cols});
  if ((cols > 1 && r.stride(1) != 1) || (rows > 1 && r.stride(0) < cols)) r = r.contiguous();
  return r;
}

int64_t row_stride(const at::Tensor& rows) { return rows.size(0) > 1 ? rows.stride(0) : rows.size(1); }

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address and
// the row pitch in bytes: cuBLASLt must not pick a kernel that assumes more.
uint32_t alignment(const void* data, int64_t ld, size_t element_size) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(data) | static_cast<uint64_t>(ld) * element_size | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Everything the fastest algorithm depends on.
using ProblemKey = std::array<int64_t, 17>;

// How a problem runs: the tiled kernel, or cuBLASLt with `algo`.
struct Plan {
  bool tiled = false;
  cublasLtMatmulAlgo_t algo{};
};

std::mutex plans_mutex;
std::map<ProblemKey, Plan> plans;

using Run = std::function<cublasStatus_t(const cublasLtMatmulAlgo_t&, cudaStream_t)>;
// One call of a candidate on a stream; false if it could not run.
using Call = std::function<bool(cudaStream_t)>;

// Microseconds per call, or a negative number if it fails. The calls run as a CUDA graph of
// back-to-back launches: timed one launch at a time, a few-microsecond matmul would measure the
// host's launch rate, the same for every candidate.
float time_calls(const Call& call, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
  constexpr int kCalls = 10;
  if (!call(stream)) return -1.0f;  // a refusal drops the candidate
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  for (int i = 0; ok && i < kCalls; ++i) ok = call(stream);
  ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && ok;
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  float ms = -1.0f;
  if (ok && cudaGraphLaunch(exec, stream) == cudaSuccess && cudaEventRecord(start, stream) == cudaSuccess &&
      cudaGraphLaunch(exec, stream) == cudaSuccess && cudaEventRecord(stop, stream) == cudaSuccess &&
      cudaEventSynchronize(stop) == cudaSuccess && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
    ms *= 1000.0f / kCalls;
  } else {
    ms = -1.0f;
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();  // a failed candidate leaves nothing behind for the next CUDA call to report
  return ms;
}

// The fastest of cuBLASLt's heuristic candidates and the tiled kernel (`tiled`, where it applies)
// for this problem, timed on its real operands on the first eager call, on a private stream that
// waits for the work queued before it. Inside a CUDA graph capture nothing can be timed: the
// heuristic's first pick runs and the problem stays untimed, so a capture after one eager call (as
// mirage.graphs.capture does after its warm-up) records the timed choice.
Plan choose_plan(const ProblemKey& key, const Descriptors& desc, const Run& run, const Call& tiled,
                 cudaStream_t stream) {
  {
    const std::lock_guard<std::mutex> lock(plans_mutex);
    const auto found = plans.find(key);
    if (found != plans.end()) return found->second;
  }
  constexpr int kCandidates = 8;
  std::array<cublasLtMatmulHeuristicResult_t, kCandidates> results{};
  int count = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), desc.matmul, desc.a,
                                          desc.b, desc.c, desc.d, desc.preference, kCandidates,
                                          results.data(), &count),
           "cublasLtMatmulAlgoGetHeuristic");
  MIRAGE_CHECK(count > 0, kLinear, ": cuBLASLt has no algorithm for this problem");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MIRAGE_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess, kLinear,
              ": cudaStreamIsCapturing failed");
  if (capture != cudaStreamCaptureStatusNone) return {false, results[0].algo};

  cudaStream_t tuning = nullptr;
  cudaEvent_t ready = nullptr, start = nullptr, stop = nullptr;
  MIRAGE_CHECK(cudaStreamCreateWithFlags(&tuning, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreate(&ready) == cudaSuccess && cudaEventCreate(&start) == cudaSuccess &&
                  cudaEventCreate(&stop) == cudaSuccess && cudaEventRecord(ready, stream) == cudaSuccess &&
                  cudaStreamWaitEvent(tuning, ready, 0) == cudaSuccess,
              kLinear, ": could not set up the algorithm timing (CUDA stream or event)");
  int best = -1;  // count: the tiled kernel
  float best_us = 0.0f;
  for (int i = 0; i <= count; ++i) {
    if (i == count && !tiled) break;
    const Call call = i == count ? tiled : Call([&, i](cudaStream_t on) {
      return run(results[i].algo, on) == CUBLAS_STATUS_SUCCESS;
    });
    const float us = time_calls(call, tuning, start, stop);
    if (us >= 0.0f && (best < 0 || us < best_us)) {
      best = i;
      best_us = us;
    }
  }
  cudaStreamSynchronize(tuning);  // its last writes to the output land before the real call's
  cudaStreamDestroy(tuning);
  for (cudaEvent_t event : {ready, start, stop}) cudaEventDestroy(event);
  MIRAGE_CHECK(best >= 0, kLinear, ": every cuBLASLt candidate algorithm failed");
  const Plan plan = best == count ? Plan{true, {}} : Plan{false, results[best].algo};
  const std::lock_guard<std::mutex> lock(plans_mutex);
  plans.emplace(key, plan);
  return plan;
}

// MIRAGE_LINEAR_TILED in the environment: "1" runs the tiled kernel wherever it applies, "0"
// never (the tests run both ways); otherwise it is one of the timed candidates.
enum class TiledChoice : int64_t { kNever, kTimed, kAlways };

TiledChoice tiled_choice() {
  const char* value = std::getenv("MIRAGE_LINEAR_TILED");
  if (value == nullptr || *value == '\0') return TiledChoice::kTimed;
  const std::string_view choice(value);
  MIRAGE_CHECK(choice == "0" || choice == "1", kLinear, ": MIRAGE_LINEAR_TILED must be 0, 1 or unset, got \"",
              choice, "\"");
  return choice == "1" ? TiledChoice::kAlways : TiledChoice::kNever;
}

// Up to kSmallLinearMaxRows rows: mirage's kernel, the activation applied as x is read. A
// residual whose rows repeat (stride 0: a bias broadcast over the batch) is read in place.
void small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual, std::string_view activation, at::Tensor& y,
                  int64_t m, int64_t n, int64_t k) {
  const at::Tensor rows = as_rows(x, m, k), weight_rows = as_rows(weight, n, k);
  const at::Tensor bias_vector = contiguous_or_undefined(bias);
  at::Tensor residual_rows;
  if (present(residual)) {
    residual_rows = residual->reshape({m, n});
    if (n > 1 && residual_rows.stride(1) != 1) residual_rows = residual_rows.contiguous();
  }
  cuda::SmallLinearParams params{};
  params.x = rows.const_data_ptr();
  params.weight = weight_rows.const_data_ptr();
  params.bias = data_or_null(bias_vector);
  params.residual = data_or_null(residual_rows);
  params.y = y.mutable_data_ptr();
  params.m = m;
  params.n = n;
  params.k = k;
  params.ldx = row_stride(rows);
  params.ldw = row_stride(weight_rows);
  params.ldr = residual_rows.defined() && m > 1 ? residual_rows.stride(0) : 0;
  params.activation = static_cast<cuda::Activation>(bias_activation_index(activation));
  params.dtype = to_kernel_dtype(x.scalar_type());
  check_launch(kLinear, cuda::launch_small_linear(params, c10::cuda::getCurrentCUDAStream()));
}

// From this many rows on, float32 products of at most kNarrowLinearMaxOutputs outputs run on
// mirage's narrow kernel. H200, 2026-11-24, [m, 384] x [384, 21] (docs/perf/linear.md): 92.6
// against cuBLAS's 108.8 us at m = 139,046, 581 against 772 at 1M, but 37.3 against 27.9 at
// 32,768 (a warp's 16-row tile is then all it has: too little work in flight).
constexpr int64_t kNarrowLinearMinRows = 131072;

// The narrow kernel's shapes: float32 x with 16-byte aligned rows, n <= 32 and k a multiple of 4
// up to 1,024 whose weight fits the device's shared memory, no input activation or residual, many
// rows.
bool use_narrow_linear(const at::Tensor& rows, bool has_residual, std::string_view activation, int64_t m,
                       int64_t n, int64_t k) {
  return rows.scalar_type() == at::kFloat && !has_residual && activation == "none" && m >= kNarrowLinearMinRows &&
         n <= cuda::kNarrowLinearMaxOutputs && k <= cuda::kNarrowLinearMaxInputs && k % 4 == 0 &&
         row_stride(rows) % 4 == 0 && is_16_byte_aligned(rows) &&
         cuda::narrow_linear_fits(k);
}

void narrow_linear(const at::Tensor& rows, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   at::Tensor& y, int64_t m, int64_t n, int64_t k) {
  const at::Tensor bias_vector = contiguous_or_undefined(bias);
  cuda::NarrowLinearParams params{};
  params.x = rows.const_data_ptr<float>();
  params.weight = weight.const_data_ptr<float>();
  params.bias = bias_vector.defined() ? bias_vector.const_data_ptr<float>() : nullptr;
  params.y = y.mutable_data_ptr<float>();
  params.m = m;
  params.ldx = row_stride(rows);
  params.wn = weight.stride(0);
  params.wk = weight.stride(1);
  params.n = static_cast<int>(n);
  params.k = static_cast<int>(k);
  check_launch(kLinear, cuda::launch_narrow_linear(params, c10::cuda::getCurrentCUDAStream()));
}

at::Tensor linear_cuda(const at::Tensor& x_in, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, c10::string_view input_activation) {
  const c10::SymDimVector shape = check_linear(x_in, weight, bias, residual, input_activation);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor y = at::empty_symint(shape, x_in.options());
  const bool has_bias = present(bias);
  const bool has_residual = present(residual);
  const int64_t k = x_in.size(-1), n = weight.size(0);
  const int64_t m = c10::multiply_integers(x_in.sizes().slice(0, x_in.dim() - 1));
  if (y.numel() == 0) return y;
  if (k == 0) {  // no products: each sum is 0
    y.zero_();
    if (has_bias) y.add_(*bias);
    if (has_residual) y.add_(*residual);
    return y;
  }
  // A column-major weight (the transpose of a row-major matrix, as the backward's x gradient
  // passes it) goes to cuBLASLt as it is; the few-rows kernel streams weight rows.
  const bool weight_columns = k > 1 && n > 1 && weight.stride(0) == 1 && weight.stride(1) >= n;
  if (!weight_columns && m <= cuda::kSmallLinearMaxRows && m * k <= cuda::kSmallLinearMaxInputs) {
    small_linear(x_in, weight, bias, residual, input_activation, y, m, n, k);
    return y;
  }
  if (m >= kNarrowLinearMinRows) {
    const at::Tensor rows = as_rows(x_in, m, k);
    if (use_narrow_linear(rows, has_residual, input_activation, m, n, k)) {
      narrow_linear(rows, weight, bias, y, m, n, k);
      return y;
    }
  }
  // cuBLASLt takes no activation of its operands: past the few-rows kernel it is a pass of its own.
  const at::Tensor x = apply_activation(x_in, input_activation);
  const at::Tensor a = weight_columns ? weight : as_rows(weight, n, k), b = as_rows(x, m, k);
  const at::Tensor residual_rows = has_residual ? as_rows(*residual, m, n) : at::Tensor();
  const size_t element = x.element_size();
  const int64_t lda = weight_columns ? a.stride(1) : row_stride(a), ldb = row_stride(b);
  const uint32_t align_a = alignment(a.const_data_ptr(), lda, element);
  const uint32_t align_b = alignment(b.const_data_ptr(), ldb, element);
  const uint32_t align_d = alignment(y.const_data_ptr(), n, element);
  const uint32_t align_residual =
      has_residual ? alignment(residual_rows.const_data_ptr(), row_stride(residual_rows), element) : 256;
  // Measured on an H200 (cuBLASLt 13.1): with operands not 16-byte aligned, the algorithms that
  // add both a bias and C round in between (float16 2.6 ulp off, bfloat16 25, where one rounding
  // is 0.5). There the residual is added by a second pass, as PyTorch adds it: two roundings.
  const bool residual_after =
      has_bias && has_residual && std::min({align_a, align_b, align_d, align_residual}) < 16;
  const bool residual_in_epilogue = has_residual && !residual_after;
  const at::Tensor c = residual_in_epilogue ? residual_rows : y.view({m, n});
  const int64_t ldc = row_stride(c);
  const uint32_t align_c = residual_in_epilogue ? align_residual : align_d;
  // The epilogue reads the bias in vectors: a view at an odd offset gets a fresh, aligned copy.
  at::Tensor bias_vector;
  if (has_bias) {
    bias_vector = bias->contiguous();
    if (!is_16_byte_aligned(bias_vector)) bias_vector = bias_vector.clone();
  }

  const at::ScalarType dtype = x.scalar_type();
  const cudaDataType_t type = dtype == at::kHalf ? CUDA_R_16F : dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  const bool tf32 = dtype == at::kFloat && tf32_matmuls();

  // The tiled kernel: float32 only (cuBLASLt's float16/bfloat16 kernels run on tensor cores
  // already), bias and residual added to the float32 sums in its epilogue, whatever the alignment.
  // (Pointers cast, not typed reads: this is filled for every dtype and used for float32 only.)
  cuda::TiledLinearParams tiled{};
  tiled.x = static_cast<const float*>(b.const_data_ptr());
  tiled.weight = static_cast<const float*>(a.const_data_ptr());
  tiled.bias = static_cast<const float*>(data_or_null(bias_vector));
  tiled.residual = static_cast<const float*>(data_or_null(residual_rows));
  tiled.y = static_cast<float*>(y.mutable_data_ptr());
  tiled.m = m;
  tiled.ldx = ldb;
  tiled.ldw = lda;
  tiled.ldr = has_residual ? row_stride(residual_rows) : 0;
  tiled.n = static_cast<int>(n);
  tiled.k = static_cast<int>(k);
  tiled.weight_columns = weight_columns;
  tiled.split = !tf32;
  // The setting is read (and a bad one refused) on every call, whether the kernel applies or not.
  // Where cuBLASLt would leave the residual to a second pass (residual_after: a second rounding
  // too), the tiled kernel, which adds it in its epilogue, is taken without timing: the timed
  // cuBLASLt candidates would leave that pass out of their times.
  const TiledChoice setting = tiled_choice();
  const bool applies = dtype == at::kFloat && n <= INT32_MAX && k <= INT32_MAX && cuda::tiled_linear_applies(tiled);
  const TiledChoice choice = !applies                                            ? TiledChoice::kNever
                             : setting == TiledChoice::kTimed && residual_after ? TiledChoice::kAlways
                                                                                 : setting;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (choice == TiledChoice::kAlways) {  // no cuBLASLt descriptors to build
    check_launch(kLinear, cuda::launch_tiled_linear(tiled, stream));
    return y;
  }

  // Row-major [m, n] y is column-major [n, m]: y^T = weight x x^T ([k, m] column-major), the
  // weight a row-major [n, k] (column-major [k, n], transposed) or a column-major [n, k] one.
  Descriptors desc;
  check_lt(cublasLtMatmulDescCreate(&desc.matmul, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                    CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  const cublasOperation_t weight_op = weight_columns ? CUBLAS_OP_N : CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(desc.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &weight_op, sizeof weight_op),
           "cublasLtMatmulDescSetAttribute");
  check_lt(cublasLtMatmulDescSetAttribute(desc.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep),
           "cublasLtMatmulDescSetAttribute");
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const void* bias_data = bias_vector.const_data_ptr();
    check_lt(cublasLtMatmulDescSetAttribute(desc.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
             "cublasLtMatmulDescSetAttribute");
    check_lt(cublasLtMatmulDescSetAttribute(desc.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_data,
                                            sizeof bias_data),
             "cublasLtMatmulDescSetAttribute");
  }
  check_lt(weight_columns ? cublasLtMatrixLayoutCreate(&desc.a, type, n, k, lda)
                          : cublasLtMatrixLayoutCreate(&desc.a, type, k, n, lda),
           "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&desc.b, type, k, m, ldb), "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&desc.c, type, n, m, ldc), "cublasLtMatrixLayoutCreate");
  check_lt(cublasLtMatrixLayoutCreate(&desc.d, type, n, m, n), "cublasLtMatrixLayoutCreate");

  size_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  // Partial sums of a split-k reduction stay float32 (in the workspace): the in-place and
  // output-type schemes would add them in the output's dtype, a rounding per partial sum.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  check_lt(cublasLtMatmulPreferenceCreate(&desc.preference), "cublasLtMatmulPreferenceCreate");
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> preferences[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d},
      {CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction}};
  for (const auto& [attribute, value] : preferences)
    check_lt(cublasLtMatmulPreferenceSetAttribute(desc.preference, attribute, &value, sizeof value),
             "cublasLtMatmulPreferenceSetAttribute");
  check_lt(cublasLtMatmulPreferenceSetAttribute(desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &workspace_bytes, sizeof workspace_bytes),
           "cublasLtMatmulPreferenceSetAttribute");

  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const float alpha = 1.0f, beta = residual_in_epilogue ? 1.0f : 0.0f;
  const Run run = [&](const cublasLtMatmulAlgo_t& algo, cudaStream_t on) {
    return cublasLtMatmul(handle, desc.matmul, &alpha, a.const_data_ptr(), desc.a, b.const_data_ptr(),
                          desc.b, &beta, c.const_data_ptr(), desc.c, y.mutable_data_ptr(), desc.d, &algo,
                          workspace, workspace_bytes, on);
  };
  const Call tiled_call = choice == TiledChoice::kTimed ? Call([&tiled](cudaStream_t on) {
    return cuda::launch_tiled_linear(tiled, on) == cudaSuccess;
  }) : Call();
  const ProblemKey key{x.get_device(), static_cast<int64_t>(dtype), m, n, k, weight_columns, lda, ldb, ldc, has_bias,
                       residual_in_epilogue, tf32, align_a, align_b, align_c, align_d,
                       static_cast<int64_t>(choice)};
  const Plan plan = choose_plan(key, desc, run, tiled_call, stream);
  if (plan.tiled) {
    check_launch(kLinear, cuda::launch_tiled_linear(tiled, stream));
    return y;
  }
  check_lt(run(plan.algo, stream), "cublasLtMatmul");
  if (residual_after) y.add_(*residual);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(mirage, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace mirage::ops
