// RowProduct: y = x w^T for a few rows x [m, nx] and a weight held as w [nf, nx] (each
// output's weights in a row), reading w once, on the CPU's AVX-512 BF16 and VNNI instructions:
// bfloat16 x and w into float32 y (each pair's products summed in float32), int8 x and w into
// int32 y (exact). XLA's CPU backend multiplies 16-bit and 8-bit operands as float32 or int32
// copies; here they are read as they are held. Under XLA only: the op lowers to a CPU custom
// call that splits nf into `parts`, run side by side by the calling thread and parts - 1
// threads of its own (XLA's CPU runtime runs a decoding step's operations one after another).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/service/custom_call_status.h"
#include "xla/service/custom_call_target_registry.h"
#include "xla/shape_util.h"

namespace {

constexpr int kRows = 8;  // weight rows read side by side, each into its own accumulator

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vnni")))

// y[r, f:f+R] for every row r of x: w's R rows stay in L1 while each x row passes.
template <int R>
TARGET void bf16_group(float* y, const uint16_t* x, const uint16_t* w, int64_t m, int64_t nx, int64_t nf,
                       int64_t f) {
  for (int64_t r = 0; r < m; ++r) {
    __m512 acc[R];
    for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= nx; k += 32) {  // whole vectors, then the tail's under a mask (a masked load in the loop halves its rate)
      const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + r * nx + k);
      for (int j = 0; j < R; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], xs, (__m512bh)_mm512_loadu_si512(w + (f + j) * nx + k));
    }
    if (k < nx) {
      const __mmask32 in = (__mmask32(1) << (nx - k)) - 1;
      const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(in, x + r * nx + k);
      for (int j = 0; j < R; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], xs, (__m512bh)_mm512_maskz_loadu_epi16(in, w + (f + j) * nx + k));
    }
    for (int j = 0; j < R; ++j) y[r * nf + f + j] = _mm512_reduce_add_ps(acc[j]);
  }
}

// As bf16_group in int8: x's bytes read as x + 128 (unsigned, as VNNI takes them), the
// excess 128 * sum(w) taken off.
template <int R>
TARGET void int8_group(int32_t* y, const int8_t* x, const int8_t* w, int64_t m, int64_t nx, int64_t nf,
                       int64_t f) {
  const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
  for (int64_t r = 0; r < m; ++r) {
    __m512i acc[R], sum[R];
    for (int j = 0; j < R; ++j) acc[j] = sum[j] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= nx; k += 64) {
      const __m512i xs = _mm512_xor_si512(_mm512_loadu_si512(x + r * nx + k), flip);
      for (int j = 0; j < R; ++j) {
        const __m512i ws = _mm512_loadu_si512(w + (f + j) * nx + k);
        acc[j] = _mm512_dpbusd_epi32(acc[j], xs, ws);
        sum[j] = _mm512_dpbusd_epi32(sum[j], ones, ws);
      }
    }
    if (k < nx) {  // the tail: x's masked bytes read as 128, against w's as 0
      const __mmask64 in = (__mmask64(1) << (nx - k)) - 1;
      const __m512i xs = _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, x + r * nx + k), flip);
      for (int j = 0; j < R; ++j) {
        const __m512i ws = _mm512_maskz_loadu_epi8(in, w + (f + j) * nx + k);
        acc[j] = _mm512_dpbusd_epi32(acc[j], xs, ws);
        sum[j] = _mm512_dpbusd_epi32(sum[j], ones, ws);
      }
    }
    for (int j = 0; j < R; ++j)
      y[r * nf + f + j] = _mm512_reduce_add_epi32(acc[j]) - 128 * _mm512_reduce_add_epi32(sum[j]);
  }
}

// Runs part(0 .. parts - 1) side by side: part 0 on the calling thread, the others on threads
// that wait for work spinning a while (a decoding step calls again within microseconds), then
// asleep.
class Team {
 public:
  void run(int parts, const std::function<void(int)>& part) {
    std::lock_guard<std::mutex> one(calls_);  // one call at a time
    while (int(threads_.size()) < parts - 1) {
      const int i = int(threads_.size()) + 1;
      threads_.emplace_back([this, i] { serve(i); });
    }
    part_ = &part;
    parts_ = parts;
    left_.store(parts - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      round_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    part(0);
    while (left_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  void serve(int i) {
    uint64_t seen = 0;
    for (;;) {
      for (int spin = 0; spin < kSpins && round_.load(std::memory_order_acquire) == seen; ++spin) _mm_pause();
      if (round_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return round_.load(std::memory_order_acquire) != seen; });
      }
      seen = round_.load(std::memory_order_acquire);
      if (i < parts_) {
        (*part_)(i);
        left_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  static constexpr int kSpins = 100000;  // pauses before sleeping: about a millisecond
  std::mutex calls_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> round_{0};
  std::atomic<int> left_{0};
  const std::function<void(int)>* part_ = nullptr;
  int parts_ = 0;
};

Team& team() {
  static Team* team = new Team;  // never destroyed: its threads wait as long as the process lives
  return *team;
}

// y [m, nf] = x [m, nx] . w^T, nf split into `parts` runs of whole groups of kRows rows
template <typename T, typename Y, void (*Group)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t),
          void (*One)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t)>
void rows(void* out, const void** in, const char* opaque, size_t length) {
  int64_t m, nx, nf, parts;
  std::sscanf(std::string(opaque, length).c_str(), "%ld %ld %ld %ld", &m, &nx, &nf, &parts);
  Y* y = static_cast<Y*>(out);
  const T* x = static_cast<const T*>(in[0]);
  const T* w = static_cast<const T*>(in[1]);
  const int64_t groups = nf / kRows;
  parts = std::max<int64_t>(1, std::min(parts, groups));
  team().run(int(parts), [&](int p) {
    for (int64_t f = groups * p / parts * kRows; f < groups * (p + 1) / parts * kRows; f += kRows)
      Group(y, x, w, m, nx, nf, f);
    if (p + 1 == parts)
      for (int64_t f = groups * kRows; f < nf; ++f) One(y, x, w, m, nx, nf, f);
  });
}

extern "C" void tfgpt2_rows_bf16(void* out, const void** in, const char* opaque, size_t length,
                                 XlaCustomCallStatus*) {
  rows<uint16_t, float, bf16_group<kRows>, bf16_group<1>>(out, in, opaque, length);
}

extern "C" void tfgpt2_rows_int8(void* out, const void** in, const char* opaque, size_t length,
                                 XlaCustomCallStatus*) {
  rows<int8_t, int32_t, int8_group<kRows>, int8_group<1>>(out, in, opaque, length);
}

XLA_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM("tfgpt2_rows_bf16", tfgpt2_rows_bf16, "Host");
XLA_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM("tfgpt2_rows_int8", tfgpt2_rows_int8, "Host");

class RowProduct : public tensorflow::XlaOpKernel {
 public:
  explicit RowProduct(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &type_));
    tensorflow::DataType out;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &out));
    OP_REQUIRES(ctx, out == (type_ == tensorflow::DT_BFLOAT16 ? tensorflow::DT_FLOAT : tensorflow::DT_INT32),
                absl::InvalidArgumentError("RowProduct: bfloat16 into float32, int8 into int32"));
    OP_REQUIRES(ctx, parts_ >= 1, absl::InvalidArgumentError("RowProduct: parts must be >= 1"));
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const tensorflow::TensorShape xs = ctx->InputShape(0), ws = ctx->InputShape(1);
    OP_REQUIRES(ctx, xs.dims() == 2 && ws.dims() == 2 && xs.dim_size(1) == ws.dim_size(1),
                absl::InvalidArgumentError("RowProduct: x [m, nx] and w [nf, nx]; got x " + xs.DebugString() +
                                           " and w " + ws.DebugString()));
    const bool bf16 = type_ == tensorflow::DT_BFLOAT16;
    const int64_t m = xs.dim_size(0), nf = ws.dim_size(0);
    const std::string opaque = std::to_string(m) + " " + std::to_string(xs.dim_size(1)) + " " +
                               std::to_string(nf) + " " + std::to_string(parts_);
    ctx->SetOutput(0, xla::CustomCall(ctx->builder(), bf16 ? "tfgpt2_rows_bf16" : "tfgpt2_rows_int8",
                                      {ctx->Input(0), ctx->Input(1)},
                                      xla::ShapeUtil::MakeShape(bf16 ? xla::F32 : xla::S32, {m, nf}), opaque,
                                      /*has_side_effect=*/false, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
                                      xla::CustomCallSchedule::SCHEDULE_NONE,
                                      xla::CustomCallApiVersion::API_VERSION_STATUS_RETURNING_UNIFIED));
  }

 private:
  int64_t parts_;
  tensorflow::DataType type_;
};

}  // namespace

REGISTER_OP("RowProduct")
    .Input("x: T")
    .Input("w: T")
    .Output("y: U")
    .Attr("T: {bfloat16, int8}")
    .Attr("U: {float, int32}")
    .Attr("parts: int = 1")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 0)));
      return absl::OkStatus();
    });

// a kernel of XLA's CPU device, registered directly: REGISTER_XLA_OP's registry is read once,
// at the process's first XLA compile, which may come before this library is loaded
REGISTER_KERNEL_BUILDER(Name("RowProduct").Device(tensorflow::DEVICE_CPU_XLA_JIT), RowProduct);
