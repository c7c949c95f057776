// RowProduct: y = x w^T for a few rows x [m, nx] and a weight held as w [nf, nx] (each
// output's weights in a row), reading w once, on the CPU's AVX-512 instructions (BF16, VNNI):
// bfloat16 or float32 x and w into float32 y (bfloat16 pairs' products summed in float32), int8
// x and w into int32 y (exact). BiasedRowProduct: bfloat16 y = x w^T + b as a bfloat16 layer
// computes it (the product rounded, b added, rounded), in one pass. ColumnProduct: y = x w for
// float32 w [nx, nf], as a layer holds it. XLA's CPU backend multiplies 16-bit and 8-bit
// operands as float32 or int32 copies, and a few rows by a float32 weight at a fraction of the
// memory's rate; here each weight is read once, as it is held. Under XLA only: each op lowers to
// a CPU custom call (a typed FFI handler: a program holding it loads from XLA's persistent cache
// too) that splits w into `parts`, run side by side by the calling thread and parts - 1 threads
// of its own (XLA's CPU runtime runs a decoding step's operations one after another).
// CachedAttention: the attention of one new position per row over a float32 cache held in
// blocks, each row reading its own cache row in place and only the positions it attends, the
// rows split between the threads as the products' parts are.
// HugePages: a tensor's memory moved to 2 MB pages (a TensorFlow op of its own, not XLA's).
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla/shape_util.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();  // TensorFlow's XLA's (libtensorflow_framework; its header needs MLIR's)
}  // namespace xla::ffi

namespace {

constexpr int kRows = 8;  // weight rows read side by side, each into its own accumulator

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

// 64 bytes at p, or where `bytes` < 64 only the first `bytes` (the rest read as 0): a masked
// load only for a row's tail (one in a loop halves the loop's rate)
TARGET inline __m512i load(const void* p, int64_t bytes) {
  return bytes >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, p);
}

// acc += x . w over a vector of each: bfloat16 pairs' products summed (BF16), or float32's
TARGET inline __m512 multiply_add(__m512 acc, __m512i x, __m512i w, uint16_t) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}
TARGET inline __m512 multiply_add(__m512 acc, __m512i x, __m512i w, float) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
}

// acc[i][j] += x[r+i, k:] . w[f+j, k:] over a vector (`bytes` of it read), for a tile of X rows
// of x and R rows of w: each vector loaded once for all the pairs it enters
template <typename T, int X, int R>
TARGET inline void float_step(__m512 (&acc)[X][R], const T* x, const T* w, int64_t nx, int64_t r, int64_t f,
                              int64_t k, int64_t bytes) {
  __m512i xs[X];
  for (int i = 0; i < X; ++i) xs[i] = load(x + (r + i) * nx + k, bytes);
  for (int j = 0; j < R; ++j) {
    const __m512i ws = load(w + (f + j) * nx + k, bytes);
    for (int i = 0; i < X; ++i) acc[i][j] = multiply_add(acc[i][j], xs[i], ws, T());
  }
}

// y[r:r+X, f:f+R] = x[r:r+X] . w[f:f+R]^T, T bfloat16 (as uint16_t) or float32, each pair's sum
// in its own accumulator
template <typename T, int X, int R>
TARGET void float_tile(float* y, const T* x, const T* w, int64_t nx, int64_t nf, int64_t r, int64_t f) {
  constexpr int64_t per = 64 / sizeof(T);
  __m512 acc[X][R];
  for (int i = 0; i < X; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + per <= nx; k += per) float_step<T, X, R>(acc, x, w, nx, r, f, k, 64);
  if (k < nx) float_step<T, X, R>(acc, x, w, nx, r, f, k, sizeof(T) * (nx - k));
  for (int i = 0; i < X; ++i)
    for (int j = 0; j < R; ++j) y[(r + i) * nf + f + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// As bf16_step in int8: w's bytes read as w + 128 (unsigned, as VNNI takes them), and xsum[i]
// sums x's row, so that the excess 128 * sum(x) comes off (a masked tail reads x as 0)
template <int X, int R>
TARGET inline void int8_step(__m512i (&acc)[X][R], __m512i (&xsum)[X], const int8_t* x, const int8_t* w,
                             int64_t nx, int64_t r, int64_t f, int64_t k, int64_t bytes) {
  const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
  __m512i xs[X];
  for (int i = 0; i < X; ++i) {
    xs[i] = load(x + (r + i) * nx + k, bytes);
    xsum[i] = _mm512_dpbusd_epi32(xsum[i], ones, xs[i]);
  }
  for (int j = 0; j < R; ++j) {
    const __m512i ws = _mm512_xor_si512(load(w + (f + j) * nx + k, bytes), flip);
    for (int i = 0; i < X; ++i) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], ws, xs[i]);
  }
}

template <int X, int R>
TARGET void int8_tile(int32_t* y, const int8_t* x, const int8_t* w, int64_t nx, int64_t nf, int64_t r,
                      int64_t f) {
  __m512i acc[X][R], xsum[X];
  for (int i = 0; i < X; ++i) {
    xsum[i] = _mm512_setzero_si512();
    for (int j = 0; j < R; ++j) acc[i][j] = _mm512_setzero_si512();
  }
  int64_t k = 0;
  for (; k + 64 <= nx; k += 64) int8_step<X, R>(acc, xsum, x, w, nx, r, f, k, 64);
  if (k < nx) int8_step<X, R>(acc, xsum, x, w, nx, r, f, k, nx - k);
  for (int i = 0; i < X; ++i) {
    const int32_t excess = 128 * _mm512_reduce_add_epi32(xsum[i]);
    for (int j = 0; j < R; ++j) y[(r + i) * nf + f + j] = _mm512_reduce_add_epi32(acc[i][j]) - excess;
  }
}

// y[:, f:f+R] for all m rows of x: four at a time against R / 2 rows of w twice (the
// accumulators fit the registers), then one at a time against all R.
template <typename T, typename Y, void (*Four)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t),
          void (*One)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t), int R>
void group(Y* y, const T* x, const T* w, int64_t m, int64_t nx, int64_t nf, int64_t f) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4)
    for (int half = 0; half < R; half += R / 2) Four(y, x, w, nx, nf, r, f + half);
  for (; r < m; ++r) One(y, x, w, nx, nf, r, f);
}

// Runs part(0 .. parts - 1) side by side, on the calling thread and on threads that wait for
// work spinning a while (a decoding step calls again within microseconds), then asleep. Each
// part goes to the first thread that claims it, the caller's included, so that a thread the
// system has not yet run (a busy host) leaves its part to the others instead of holding up the
// call; the caller then waits only for parts under way.
class Team {
 public:
  void run(int parts, const std::function<void(int)>& part) {
    if (parts == 1) return part(0);
    std::lock_guard<std::mutex> one(calls_);  // one call at a time
    if (owner_ != getpid()) {  // none yet, or a forked child's copy: its threads are the parent's
      threads_ = new std::vector<std::thread>;  // (the parent's std::thread objects are left as they are)
      owner_ = getpid();
    }
    const uint32_t round = uint32_t(claims_.load(std::memory_order_relaxed) >> 32) + 1;  // (compared only: wraps)
    while (int(threads_->size()) < parts - 1) threads_->emplace_back([this, round] { serve(round - 1u); });
    part_ = &part;
    done_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      claims_.store(uint64_t(round) << 32 | uint64_t(parts) << 16, std::memory_order_release);
    }
    wake_.notify_all();
    work(round);
    for (int spin = 0; done_.load(std::memory_order_acquire) < parts; ++spin) {
      if (spin < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();  // a part's thread was put off: let it run
      }
    }
  }

 private:
  // claims_ holds the round (bits 32..63), its number of parts (16..31) and how many are claimed
  void work(uint32_t round) {
    uint64_t at = claims_.load(std::memory_order_acquire);
    while (at >> 32 == round && (at & 0xffff) < (at >> 16 & 0xffff)) {
      if (!claims_.compare_exchange_weak(at, at + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      (*part_)(int(at & 0xffff));
      done_.fetch_add(1, std::memory_order_release);
      at = claims_.load(std::memory_order_acquire);
    }
  }

  void serve(uint32_t seen) {
    for (;;) {
      for (int spin = 0; spin < kSpins && claims_.load(std::memory_order_acquire) >> 32 == seen; ++spin)
        _mm_pause();
      if (claims_.load(std::memory_order_acquire) >> 32 == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return claims_.load(std::memory_order_acquire) >> 32 != seen; });
      }
      seen = uint32_t(claims_.load(std::memory_order_acquire) >> 32);
      work(seen);
    }
  }

  static constexpr int kSpins = 100000;  // pauses before sleeping (or yielding): about a millisecond
  std::mutex calls_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread>* threads_ = nullptr;
  pid_t owner_ = 0;
  std::atomic<uint64_t> claims_{0};
  std::atomic<int> done_{0};
  const std::function<void(int)>* part_ = nullptr;
};

Team& team() {
  static Team* team = new Team;  // never destroyed: its threads wait as long as the process lives
  return *team;
}

// y [m, nf] = x [m, nx] . w^T, nf split into `parts` runs of whole groups of kRows rows of w;
// then(f0, f1) on each part's outputs y[:, f0:f1], by the thread that made them
template <typename T, typename Y, void (*Group)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t),
          void (*Rest)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t), typename Then>
void rows_then(Y* y, const T* x, const T* w, int64_t m, int64_t nx, int64_t nf, int64_t parts, const Then& then) {
  const int64_t groups = nf / kRows;
  parts = std::max<int64_t>(1, std::min(parts, groups));
  team().run(int(parts), [&](int p) {
    const int64_t f0 = groups * p / parts * kRows, f1 = groups * (p + 1) / parts * kRows;
    for (int64_t f = f0; f < f1; f += kRows) Group(y, x, w, m, nx, nf, f);
    if (p + 1 < parts) return then(f0, f1);
    for (int64_t f = f1; f < nf; ++f) Rest(y, x, w, m, nx, nf, f);
    then(f0, nf);
  });
}

template <typename T, typename Y, void (*Group)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t),
          void (*Rest)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t)>
void rows(Y* y, const T* x, const T* w, int64_t m, int64_t nx, int64_t nf, int64_t parts) {
  rows_then<T, Y, Group, Rest>(y, x, w, m, nx, nf, parts, [](int64_t, int64_t) {});
}

template <typename T, typename Y, void (*Tile)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t)>
void each_row(Y* y, const T* x, const T* w, int64_t m, int64_t nx, int64_t nf, int64_t f) {
  for (int64_t r = 0; r < m; ++r) Tile(y, x, w, nx, nf, r, f);
}

// a product as an XLA FFI handler: x [m, nx], w [nf, nx] (or [nx, nf]: `Columns`), y [m, nf]
template <typename T, typename Y, void (*Product)(Y*, const T*, const T*, int64_t, int64_t, int64_t, int64_t),
          bool Columns = false>
xla::ffi::Error product(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w, xla::ffi::Result<xla::ffi::AnyBuffer> y,
                        int64_t parts) {
  const auto xs = x.dimensions(), ws = w.dimensions();
  Product(static_cast<Y*>(y->untyped_data()), static_cast<const T*>(x.untyped_data()),
          static_cast<const T*>(w.untyped_data()), xs[0], xs[1], Columns ? ws[1] : ws[0], parts);
  return xla::ffi::Error::Success();
}

constexpr auto group_bf16 =
    group<uint16_t, float, float_tile<uint16_t, 4, kRows / 2>, float_tile<uint16_t, 1, kRows>, kRows>;
constexpr auto rest_bf16 = each_row<uint16_t, float, float_tile<uint16_t, 1, 1>>;
constexpr auto rows_bf16 = rows<uint16_t, float, group_bf16, rest_bf16>;
constexpr auto rows_f32 =
    rows<float, float, group<float, float, float_tile<float, 4, kRows / 2>, float_tile<float, 1, kRows>, kRows>,
         each_row<float, float, float_tile<float, 1, 1>>>;
constexpr auto rows_int8 = rows<int8_t, int32_t, group<int8_t, int32_t, int8_tile<4, kRows / 2>, int8_tile<1, kRows>, kRows>,
                                each_row<int8_t, int32_t, int8_tile<1, 1>>>;

// the mask of the first `left` of 16 lanes (all where left >= 16)
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1 << left) - 1); }

// 16 floats rounded to bfloat16 (to nearest, ties to even) and back
TARGET inline __m512 rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// y[i, f0:f1] = (sums[i, f0:f1] rounded to bfloat16) + b[f0:f1], rounded, for each row i
TARGET void add_bias_bf16(uint16_t* y, const float* sums, const uint16_t* b, int64_t m, int64_t nf, int64_t f0,
                          int64_t f1) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t f = f0; f < f1; f += 16) {
      const __mmask16 in = lanes(f1 - f);
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, b + f));
      const __m512 bias = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      const __m512 sum = _mm512_add_ps(rounded(_mm512_maskz_loadu_ps(in, sums + i * nf + f)), bias);
      _mm256_mask_storeu_epi16(y + i * nf + f, in, (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

// the biased product's handler: x [m, nx], w [nf, nx], b [nf], y [m, nf], all bfloat16
xla::ffi::Error biased_bf16(xla::ffi::AnyBuffer x, xla::ffi::AnyBuffer w, xla::ffi::AnyBuffer b,
                            xla::ffi::Result<xla::ffi::AnyBuffer> y, int64_t parts) {
  const auto xs = x.dimensions(), ws = w.dimensions();
  const int64_t m = xs[0], nx = xs[1], nf = ws[0];
  thread_local std::vector<float> kept;  // the float32 products, the calling thread's from call to call
  kept.resize(m * nf);
  float* sums = kept.data();  // (a lambda names the thread_local of the thread it runs on)
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  const auto* bias = static_cast<const uint16_t*>(b.untyped_data());
  rows_then<uint16_t, float, group_bf16, rest_bf16>(
      sums, static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint16_t*>(w.untyped_data()), m, nx, nf,
      parts, [&](int64_t f0, int64_t f1) { add_bias_bf16(out, sums, bias, m, nf, f0, f1); });
  return xla::ffi::Error::Success();
}

// 16 floats at p, or with `Masked` only those of `in` (the rest read as 0)
template <bool Masked>
TARGET inline __m512 read16(const float* p, __mmask16 in) {
  return Masked ? _mm512_maskz_loadu_ps(in, p) : _mm512_loadu_ps(p);
}

// y[i, f:f+16] += x[i, k:k+4] . w[k:k+4, f:f+16] (float32, w [nx, nf]); with `Masked`, only the
// outputs of `in` (a row's tail)
template <bool Masked>
TARGET inline void column_step(float* yi, const __m512 (&xs)[4], const float* wk, int64_t nf, int64_t f,
                               __mmask16 in = 0) {
  __m512 a = read16<Masked>(yi + f, in);
  for (int j = 0; j < 4; ++j) a = _mm512_fmadd_ps(xs[j], read16<Masked>(wk + j * nf + f, in), a);
  if (Masked)
    _mm512_mask_storeu_ps(yi + f, in, a);
  else
    _mm512_storeu_ps(yi + f, a);
}

// y[i] += x[i, k0:k1] . w[k0:k1] for each row i of x (float32, w [nx, nf] as a layer holds it):
// w's rows read once, in order, four at a time, y kept in the cache; whole vectors unmasked, a
// row's tail under a mask
TARGET void column_part(float* y, const float* x, const float* w, int64_t m, int64_t nx, int64_t nf, int64_t k0,
                        int64_t k1) {
  const __mmask16 tail = (__mmask16(1) << (nf % 16)) - 1;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4)
    for (int64_t i = 0; i < m; ++i) {
      const __m512 xs[4] = {_mm512_set1_ps(x[i * nx + k]), _mm512_set1_ps(x[i * nx + k + 1]),
                            _mm512_set1_ps(x[i * nx + k + 2]), _mm512_set1_ps(x[i * nx + k + 3])};
      int64_t f = 0;
      for (; f + 16 <= nf; f += 16) column_step<false>(y + i * nf, xs, w + k * nf, nf, f);
      if (f < nf) column_step<true>(y + i * nf, xs, w + k * nf, nf, f, tail);
    }
  for (; k < k1; ++k)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t f = 0; f < nf; ++f) y[i * nf + f] += x[i * nx + k] * w[k * nf + f];
}

// y [m, nf] = x [m, nx] . w [nx, nf], nx split into `parts` runs of w's rows (whole groups of four),
// each part's sums into a y of its own, added up at the end
void columns_f32(float* y, const float* x, const float* w, int64_t m, int64_t nx, int64_t nf, int64_t parts) {
  const int64_t groups = nx / 4;
  parts = std::max<int64_t>(1, std::min(parts, groups));
  std::vector<float> sums(parts * m * nf, 0.0f);
  team().run(int(parts), [&](int p) {
    const int64_t k1 = p + 1 == parts ? nx : groups * (p + 1) / parts * 4;
    column_part(sums.data() + p * m * nf, x, w, m, nx, nf, groups * p / parts * 4, k1);
  });
  std::copy(sums.begin(), sums.begin() + m * nf, y);
  for (int64_t p = 1; p < parts; ++p)
    for (int64_t i = 0; i < m * nf; ++i) y[i] += sums[p * m * nf + i];
}

// e^x for 16 floats x <= 0 (scores less their largest), within a few ulps (Cephes' expf: x =
// n ln 2 + r, e^r by a polynomial, scaled by 2^n); below -104, 0
TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// the masks of the four vectors of features f0 .. f0 + 63 (of d; none past d)
inline void features(__mmask16 (&in)[4], int64_t d, int64_t f0) {
  for (int i = 0; i < 4; ++i) in[i] = f0 + 16 * i < d ? lanes(d - f0 - 16 * i) : __mmask16(0);
}

// w[j] = q . key_j over features f0 .. f0 + 63 (added to w[j] unless `first`), for the n keys
// at `key` (each of d features, one after another)
TARGET void scores(float* w, const float* q, const float* key, int64_t n, int64_t d, int64_t f0, bool first) {
  __mmask16 in[4];
  features(in, d, f0);
  __m512 qs[4];
  for (int i = 0; i < 4; ++i) qs[i] = _mm512_maskz_loadu_ps(in[i], q + f0 + 16 * i);
  for (int64_t j = 0; j < n; ++j, key += d) {
    __m512 acc = _mm512_mul_ps(qs[0], _mm512_maskz_loadu_ps(in[0], key + f0));
    for (int i = 1; i < 4; ++i) acc = _mm512_fmadd_ps(qs[i], _mm512_maskz_loadu_ps(in[i], key + f0 + 16 * i), acc);
    const float s = _mm512_reduce_add_ps(acc);
    w[j] = first ? s : w[j] + s;
  }
}

// a[f0:f0+64] = sum of p[j] value_j over the n values at `value` (each of d features)
TARGET void weighted(float* a, const float* p, const float* value, int64_t n, int64_t d, int64_t f0) {
  __mmask16 in[4];
  features(in, d, f0);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < n; ++j, value += d) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(in[i], value + f0 + 16 * i), acc[i]);
  }
  for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(a + f0 + 16 * i, in[i], acc[i]);
}

// x rounded to bfloat16 where Round
template <bool Round>
TARGET inline __m512 held(__m512 x) {
  return Round ? rounded(x) : x;
}

// a[0:d] rounded to bfloat16 where Round
template <bool Round>
TARGET inline void round_all(float* a, int64_t d) {
  if (Round)
    for (int64_t f = 0; f < d; f += 16)
      _mm512_mask_storeu_ps(a + f, lanes(d - f), rounded(_mm512_maskz_loadu_ps(lanes(d - f), a + f)));
}

// One query row's attention over the positions first .. last of its cache row c, held in blocks
// of `length` positions (k[b], v[b]: [rows, length, d]), as `cache.cached_attn` computes it: each
// score q . k rounded to Q, scaled, softmax in float32 rounded to Q, each block's p . v rounded
// to Q and the blocks' sums added in order, each sum rounded to Q (Round: Q is bfloat16); the
// positions before `first` (a left-padded row's padding) weigh 0. w: room for last + 1 + d floats.
template <bool Round>
TARGET void attend(float* a, const float* q, float* const* k, float* const* v, int64_t length,
                   int64_t c, int64_t first, int64_t last, int64_t d, float scale, float* w) {
  const int64_t n = last + 1;
  for (int64_t f0 = 0; f0 < d; f0 += 64)
    for (int64_t b = first / length; b * length < n; ++b) {
      const int64_t j = std::max(first, b * length);
      scores(w + j, q, k[b] + (c * length + j - b * length) * d, std::min(n, b * length + length) - j, d, f0, f0 == 0);
    }
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = first; j < n; j += 16) {
    const __mmask16 in = lanes(n - j);
    const __m512 x = _mm512_mul_ps(held<Round>(_mm512_maskz_loadu_ps(in, w + j)), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(w + j, in, x);
    top = _mm512_mask_max_ps(top, in, top, x);
  }
  const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = first; j < n; j += 16) {
    const __mmask16 in = lanes(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, w + j), most));
    _mm512_mask_storeu_ps(w + j, in, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(in, e));
  }
  const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));
  for (int64_t j = first; j < n; j += 16) {
    const __mmask16 in = lanes(n - j);
    _mm512_mask_storeu_ps(w + j, in, held<Round>(_mm512_div_ps(_mm512_maskz_loadu_ps(in, w + j), sum)));
  }
  float* part = w + n;
  for (int64_t b = first / length; b * length < n; ++b) {  // (a block before `first` adds 0)
    const int64_t j = std::max(first, b * length);
    float* into = b == first / length ? a : part;
    for (int64_t f0 = 0; f0 < d; f0 += 64)
      weighted(into, w + j, v[b] + (c * length + j - b * length) * d, std::min(n, b * length + length) - j, d, f0);
    round_all<Round>(into, d);
    if (into == a) continue;
    for (int64_t f = 0; f < d; ++f) a[f] += part[f];
    round_all<Round>(a, d);
  }
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <typename Q>
inline Q from_float(float x);  // (a value already rounded to Q)
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline uint16_t from_float<uint16_t>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t(bits >> 16);
}

// Writes row i's new key and value (k_new[i], v_new[i]: [n, d] float32) at position last[i] of
// its cache row rows[i] (none past the blocks' end, as XLA drops such an update), then a [n, d]
// = the attention of q [n, d] (bfloat16 or float32) over that row from position first[i] to
// last[i] (at most the blocks' end). The blocks (k, then v: float32 [cache rows, length, d]) are
// updated in place: each result is its operand's buffer (XLA's output-operand aliasing).
template <typename Q>
xla::ffi::Error cached_attention(xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer rows, xla::ffi::AnyBuffer first,
                                 xla::ffi::AnyBuffer last, xla::ffi::AnyBuffer scale, xla::ffi::AnyBuffer k_new,
                                 xla::ffi::AnyBuffer v_new, xla::ffi::RemainingArgs blocks,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> out, xla::ffi::RemainingRets written,
                                 int64_t parts) {
  const int64_t n = q.dimensions()[0], d = q.dimensions()[1], count = int64_t(blocks.size()) / 2;
  std::vector<float*> k(count), v(count);
  int64_t length = 0, cache_rows = 0;
  for (int64_t b = 0; b < 2 * count; ++b) {
    auto block = blocks.get<xla::ffi::AnyBuffer>(b);
    if (!block.has_value()) return block.error();
    auto result = written.get<xla::ffi::AnyBuffer>(b);  // the block's own buffer (aliased)
    if (!result.has_value()) return result.error();
    (b < count ? k[b] : v[b - count]) = static_cast<float*>((*result)->untyped_data());
    cache_rows = block->dimensions()[0];
    length = block->dimensions()[1];
  }
  const auto* qs = static_cast<const Q*>(q.untyped_data());
  const auto* cs = static_cast<const int32_t*>(rows.untyped_data());
  const auto* fs = static_cast<const int32_t*>(first.untyped_data());
  const auto* ls = static_cast<const int32_t*>(last.untyped_data());
  const auto* kn = static_cast<const float*>(k_new.untyped_data());
  const auto* vn = static_cast<const float*>(v_new.untyped_data());
  const float s = *static_cast<const float*>(scale.untyped_data());
  for (int64_t i = 0; i < n; ++i)  // (nothing written before every row is known to fit)
    if (cs[i] < 0 || cs[i] >= cache_rows || fs[i] < 0 || fs[i] > ls[i])
      return xla::ffi::Error::InvalidArgument(
          "CachedAttention: row " + std::to_string(i) + " reads cache row " + std::to_string(cs[i]) + " of " +
          std::to_string(cache_rows) + ", positions " + std::to_string(fs[i]) + " to " + std::to_string(ls[i]));
  for (int64_t i = 0; i < n; ++i)
    if (ls[i] < count * length) {
      const int64_t at = (cs[i] * length + ls[i] % length) * d;
      std::copy(kn + i * d, kn + i * d + d, k[ls[i] / length] + at);
      std::copy(vn + i * d, vn + i * d + d, v[ls[i] / length] + at);
    }
  auto* as = static_cast<Q*>(out->untyped_data());
  parts = std::max<int64_t>(1, std::min(parts, n));
  team().run(int(parts), [&](int p) {
    thread_local std::vector<float> w, qf, af;  // this thread's: scores, q and a in float32
    w.resize(count * length + d);
    qf.resize(d);
    af.resize(d);
    for (int64_t i = n * p / parts; i < n * (p + 1) / parts; ++i) {
      for (int64_t f = 0; f < d; ++f) qf[f] = to_float(qs[i * d + f]);
      attend<std::is_same_v<Q, uint16_t>>(af.data(), qf.data(), k.data(), v.data(), length, cs[i], fs[i],
                                          std::min<int64_t>(ls[i], count * length - 1), d, s, w.data());
      for (int64_t f = 0; f < d; ++f) as[i * d + f] = from_float<Q>(af[f]);
    }
  });
  return xla::ffi::Error::Success();
}

// the handlers' one signature: x, w, y and the attribute `parts`
#define TFGPT2_BINDING                                                                                 \
  xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().Attr<int64_t>( \
      "parts")
XLA_FFI_DEFINE_HANDLER_SYMBOL(kRowsBf16, (product<uint16_t, float, rows_bf16>), TFGPT2_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kRowsF32, (product<float, float, rows_f32>), TFGPT2_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kRowsInt8, (product<int8_t, int32_t, rows_int8>), TFGPT2_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kColumnsF32, (product<float, float, columns_f32, true>), TFGPT2_BINDING);
#define TFGPT2_ATTENTION                   \
  xla::ffi::Ffi::Bind()                    \
      .Arg<xla::ffi::AnyBuffer>() /* q */  \
      .Arg<xla::ffi::AnyBuffer>()          \
      .Arg<xla::ffi::AnyBuffer>()          \
      .Arg<xla::ffi::AnyBuffer>()          \
      .Arg<xla::ffi::AnyBuffer>()          \
      .Arg<xla::ffi::AnyBuffer>()          \
      .Arg<xla::ffi::AnyBuffer>() /* v_new */ \
      .RemainingArgs()                     \
      .Ret<xla::ffi::AnyBuffer>()          \
      .RemainingRets()                     \
      .Attr<int64_t>("parts")
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttentionF32, cached_attention<float>, TFGPT2_ATTENTION);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAttentionBf16, cached_attention<uint16_t>, TFGPT2_ATTENTION);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBiasedBf16, biased_bf16,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("parts"));
// typed FFI handlers: a program holding them loads again from XLA's persistent cache (a custom call
// of the older untyped API crashed there)
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_rows_bf16", "Host", kRowsBf16);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_rows_f32", "Host", kRowsF32);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_rows_int8", "Host", kRowsInt8);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_columns_f32", "Host", kColumnsF32);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_biased_bf16", "Host", kBiasedBf16);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_attention_f32", "Host", kAttentionF32);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), "tfgpt2_attention_bf16", "Host", kAttentionBf16);

// the custom call of `target` on the op's inputs, giving [m, nf] of `type`
xla::XlaOp custom_call(tensorflow::XlaOpKernelContext* ctx, const char* target, xla::PrimitiveType type, int64_t m,
                       int64_t nf, int64_t parts) {
  std::vector<xla::XlaOp> inputs;
  for (int i = 0; i < ctx->num_inputs(); ++i) inputs.push_back(ctx->Input(i));
  return xla::CustomCall(ctx->builder(), target, inputs, xla::ShapeUtil::MakeShape(type, {m, nf}),
                         "{parts = " + std::to_string(parts) + " : i64}", /*has_side_effect=*/false,
                         /*output_operand_aliasing=*/{}, /*literal=*/nullptr, xla::CustomCallSchedule::SCHEDULE_NONE,
                         xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
}

class RowProduct : public tensorflow::XlaOpKernel {
 public:
  explicit RowProduct(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &type_));
    tensorflow::DataType out;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("U", &out));
    OP_REQUIRES(ctx, out == (type_ == tensorflow::DT_INT8 ? tensorflow::DT_INT32 : tensorflow::DT_FLOAT),
                absl::InvalidArgumentError("RowProduct: bfloat16 or float32 into float32, int8 into int32"));
    OP_REQUIRES(ctx, parts_ >= 1, absl::InvalidArgumentError("RowProduct: parts must be >= 1"));
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const tensorflow::TensorShape xs = ctx->InputShape(0), ws = ctx->InputShape(1);
    OP_REQUIRES(ctx, xs.dims() == 2 && ws.dims() == 2 && xs.dim_size(1) == ws.dim_size(1),
                absl::InvalidArgumentError("RowProduct: x [m, nx] and w [nf, nx]; got x " + xs.DebugString() +
                                           " and w " + ws.DebugString()));
    const bool int8 = type_ == tensorflow::DT_INT8;
    const char* target = int8 ? "tfgpt2_rows_int8" : type_ == tensorflow::DT_FLOAT ? "tfgpt2_rows_f32" : "tfgpt2_rows_bf16";
    ctx->SetOutput(0, custom_call(ctx, target, int8 ? xla::S32 : xla::F32, xs.dim_size(0), ws.dim_size(0), parts_));
  }

 private:
  int64_t parts_;
  tensorflow::DataType type_;
};

class BiasedRowProduct : public tensorflow::XlaOpKernel {
 public:
  explicit BiasedRowProduct(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES(ctx, parts_ >= 1, absl::InvalidArgumentError("BiasedRowProduct: parts must be >= 1"));
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const tensorflow::TensorShape xs = ctx->InputShape(0), ws = ctx->InputShape(1), bs = ctx->InputShape(2);
    OP_REQUIRES(ctx,
                xs.dims() == 2 && ws.dims() == 2 && xs.dim_size(1) == ws.dim_size(1) && bs.dims() == 1 &&
                    bs.dim_size(0) == ws.dim_size(0),
                absl::InvalidArgumentError("BiasedRowProduct: x [m, nx], w [nf, nx] and b [nf]; got x " +
                                           xs.DebugString() + ", w " + ws.DebugString() + " and b " + bs.DebugString()));
    ctx->SetOutput(0, custom_call(ctx, "tfgpt2_biased_bf16", xla::BF16, xs.dim_size(0), ws.dim_size(0), parts_));
  }

 private:
  int64_t parts_;
};

class ColumnProduct : public tensorflow::XlaOpKernel {
 public:
  explicit ColumnProduct(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES(ctx, parts_ >= 1, absl::InvalidArgumentError("ColumnProduct: parts must be >= 1"));
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    const tensorflow::TensorShape xs = ctx->InputShape(0), ws = ctx->InputShape(1);
    OP_REQUIRES(ctx, xs.dims() == 2 && ws.dims() == 2 && xs.dim_size(1) == ws.dim_size(0),
                absl::InvalidArgumentError("ColumnProduct: x [m, nx] and w [nx, nf]; got x " + xs.DebugString() +
                                           " and w " + ws.DebugString()));
    ctx->SetOutput(0, custom_call(ctx, "tfgpt2_columns_f32", xla::F32, xs.dim_size(0), ws.dim_size(1), parts_));
  }

 private:
  int64_t parts_;
};

class CachedAttention : public tensorflow::XlaOpKernel {
 public:
  explicit CachedAttention(tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("parts", &parts_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &type_));
    OP_REQUIRES(ctx, parts_ >= 1, absl::InvalidArgumentError("CachedAttention: parts must be >= 1"));
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    constexpr int kBlocks = 7;  // the inputs before the blocks
    const tensorflow::TensorShape qs = ctx->InputShape(0);
    const int blocks = (ctx->num_inputs() - kBlocks) / 2;
    bool fits = qs.dims() == 2;
    std::string got = "q " + qs.DebugString();
    const char* names[] = {"", ", rows ", ", first ", ", last ", ", scale ", ", k_new ", ", v_new "};
    for (int i = 1; i < kBlocks; ++i) {
      const tensorflow::TensorShape ns = ctx->InputShape(i);
      fits = fits && (i == 4 ? ns.dims() == 0 : i < 4 ? ns.dims() == 1 && ns.dim_size(0) == qs.dim_size(0) : ns == qs);
      got += names[i] + ns.DebugString();
    }
    std::vector<xla::Shape> shapes = {xla::ShapeUtil::MakeShape(type_ == tensorflow::DT_BFLOAT16 ? xla::BF16 : xla::F32,
                                                                {qs.dim_size(0), qs.dim_size(1)})};
    std::vector<std::pair<xla::ShapeIndex, std::pair<int64_t, xla::ShapeIndex>>> aliased;
    for (int i = kBlocks; i < ctx->num_inputs(); ++i) {
      const tensorflow::TensorShape bs = ctx->InputShape(i), one = ctx->InputShape(kBlocks);
      fits = fits && bs.dims() == 3 && bs == one && bs.dim_size(2) == qs.dim_size(1);
      got += std::string(i < kBlocks + blocks ? ", k " : ", v ") + bs.DebugString();
      shapes.push_back(xla::ShapeUtil::MakeShape(xla::F32, bs.dim_sizes()));
      aliased.push_back({xla::ShapeIndex{int64_t(shapes.size()) - 1}, {i, xla::ShapeIndex{}}});
    }
    OP_REQUIRES(ctx, fits,
                absl::InvalidArgumentError("CachedAttention: q, k_new and v_new [n, d], rows, first and last [n], "
                                           "scale [], k and v blocks all [rows, length, d]; got " + got));
    std::vector<xla::XlaOp> inputs;
    for (int i = 0; i < ctx->num_inputs(); ++i) inputs.push_back(ctx->Input(i));
    const char* target = type_ == tensorflow::DT_BFLOAT16 ? "tfgpt2_attention_bf16" : "tfgpt2_attention_f32";
    const xla::XlaOp call = xla::CustomCall(
        ctx->builder(), target, inputs, xla::ShapeUtil::MakeTupleShape(shapes),
        "{parts = " + std::to_string(parts_) + " : i64}", /*has_side_effect=*/false, aliased, /*literal=*/nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < int(shapes.size()); ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  int64_t parts_;
  tensorflow::DataType type_;
};

// Asks Linux to back the whole 2 MB pages inside a tensor's buffer by huge pages (transparent
// huge pages: MADV_HUGEPAGE, and MADV_COLLAPSE, which moves the pages there now): a weight read
// at each step then misses the TLB 512 times less often. The bytes moved (0 where Linux refuses).
class HugePages : public tensorflow::OpKernel {
 public:
  explicit HugePages(tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(tensorflow::OpKernelContext* ctx) override {
    constexpr uintptr_t kHuge = 2 << 20;
    const auto data = ctx->input(0).tensor_data();
    const uintptr_t start = reinterpret_cast<uintptr_t>(data.data());
    const uintptr_t first = (start + kHuge - 1) / kHuge * kHuge, end = (start + data.size()) / kHuge * kHuge;
    int64_t moved = 0;
    if (end > first && madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE) == 0 &&
        madvise(reinterpret_cast<void*>(first), end - first, 25 /* MADV_COLLAPSE, Linux 6.1 */) == 0)
      moved = int64_t(end - first);
    tensorflow::Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &out));
    out->scalar<int64_t>()() = moved;
  }
};

}  // namespace

REGISTER_OP("HugePages")
    .Input("t: T")
    .Output("moved: int64")
    .Attr("T: type")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("HugePages").Device(tensorflow::DEVICE_CPU), HugePages);

REGISTER_OP("RowProduct")
    .Input("x: T")
    .Input("w: T")
    .Output("y: U")
    .Attr("T: {bfloat16, float, int8}")
    .Attr("U: {float, int32}")
    .Attr("parts: int = 1")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 0)));
      return absl::OkStatus();
    });

// a kernel of XLA's CPU device, registered directly: REGISTER_XLA_OP's registry is read once,
// at the process's first XLA compile, which may come before this library is loaded
REGISTER_KERNEL_BUILDER(Name("RowProduct").Device(tensorflow::DEVICE_CPU_XLA_JIT), RowProduct);

REGISTER_OP("BiasedRowProduct")
    .Input("x: bfloat16")
    .Input("w: bfloat16")
    .Input("b: bfloat16")
    .Output("y: bfloat16")
    .Attr("parts: int = 1")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 0)));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("BiasedRowProduct").Device(tensorflow::DEVICE_CPU_XLA_JIT), BiasedRowProduct);

REGISTER_OP("ColumnProduct")
    .Input("x: float")
    .Input("w: float")
    .Output("y: float")
    .Attr("parts: int = 1")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->Dim(c->input(0), 0), c->Dim(c->input(1), 1)));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("ColumnProduct").Device(tensorflow::DEVICE_CPU_XLA_JIT), ColumnProduct);

REGISTER_OP("CachedAttention")
    .Input("q: T")
    .Input("rows: int32")
    .Input("first: int32")
    .Input("last: int32")
    .Input("scale: float")
    .Input("k_new: float")
    .Input("v_new: float")
    .Input("k: n * float")
    .Input("v: n * float")
    .Output("a: T")
    .Output("k_out: n * float")
    .Output("v_out: n * float")
    .Attr("T: {bfloat16, float}")
    .Attr("n: int >= 1")
    .Attr("parts: int = 1")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      for (int i = 1; i < c->num_outputs(); ++i) c->set_output(i, c->input(6 + i));
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("CachedAttention").Device(tensorflow::DEVICE_CPU_XLA_JIT), CachedAttention);
