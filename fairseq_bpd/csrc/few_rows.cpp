// Products of a few float32 rows by packed weights, int8 or float32: the draft's step and,
// at a few rows, the decoder's layers and head 1's projection on a CPU.
//
// At one row to a few a product reads each weight once per call, so its cost is the
// weight's bytes and what is done with each. Here the weights are packed so that those of
// 64 outputs lie side by side (by fairseq_bpd/product.py), the loop reads them front to
// back, and every row is multiplied in at once; the bias, a residual and relu are applied
// to the sums. The weights are split between torch's threads, each taking the same share
// every call.
//
// int8 weights (the draft's): where the CPU has AVX512-VNNI each row is rounded to int8
// too (its largest magnitude at 127) and the products are exact integer sums, sixty-four
// multiply-adds an instruction (VNNI's dot product of unsigned bytes by signed ones: the
// weights are packed offset by 128, four channels of an output side by side, and each
// row's sum times 128 is taken back off), scaled per output and per row. Converting each
// weight to a float to meet float rows, the loop elsewhere, costs three instructions per
// sixteen weights: on the 2-core Intel Xeon those products took about twice VNNI's time.
// Either rounds differently from the float32 product, by the weights' rounding to int8
// and with VNNI the rows' too: they serve proposals, which head 1 verifies in float32.
// torch's weight-only int8 kernel (rows rounded to bf16, bf16 out) was slower than either.
//
// float32 weights: 64 outputs' weights for one input channel side by side; float sums. A
// layer's products at batch 1 read their weights from beyond the cores' caches; MKL's small
// products there did not split them between the cores or fetch ahead, and these ran the
// layers' eighteen products in about three quarters of MKL's time at one to sixteen rows.
// They sum in their own order, so they round differently from MKL's, as any block pass does.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include "lean.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // outputs per packed block: 64 weights a channel
#if defined(__AVX512VNNI__)
// int8 products meet int8 rows, packed for VNNI (int8_block_sums); else float rows meet
// each weight converted (block_sums), packed as float32's.
constexpr bool kInt8Rows = true;
#else
constexpr bool kInt8Rows = false;
#endif
// Multiply-adds a thread's share must hold before a product is split between threads
// (below it the hand-off costs more than it saves; measured on 1-4 rows). int8 weights,
// four times fewer bytes a multiply-add, pay for it later than float32's, and later still
// with VNNI's sixty-four multiply-adds an instruction.
constexpr int64_t kFloatParallelWork = 1 << 14;
constexpr int64_t kInt8ParallelWork = kInt8Rows ? (1 << 18) : (1 << 17);
// The int8 sums stay exact in int32 up to this many input channels (255 · 127 · C < 2^31).
constexpr int64_t kInt8MostChannels = 1 << 16;
// How far ahead of the loop the weight is fetched (bytes): a product's weight is usually
// not in the core's cache (the base's pass read 19 MB since the draft's last step), and
// the hardware's prefetcher stops at each 4 KB page. A fetch past the weight's end is harmless.
constexpr int64_t kPrefetchAhead = 2048;

#if defined(__AVX512F__)
inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
#endif

// sums[r][0..64) = Σ_c x[r][c] · w[c][0..64) in float32 for one block of outputs (w C x 64,
// float32, or int8 each converted to a float exactly).
template <int M, typename W>
void block_sums(const float* x, int64_t x_stride, const W* w, int64_t C, float* sums) {
  constexpr int64_t kLines = sizeof(W);  // cache lines of one channel's 64 weights
#if defined(__AVX512F__)
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const W* wc = w + c * kBlock;
    for (int64_t line = 0; line < kLines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(wc) + kPrefetchAhead + 64 * line, _MM_HINT_T0);
    __m512 weights[4];
    for (int j = 0; j < 4; ++j) weights[j] = load16(wc + 16 * j);
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + c]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, weights[j], acc[r][j]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + r * kBlock + 16 * j, acc[r][j]);
#else
  // Portable: the compiler vectorises the 64 outputs (-march=native).
  float acc[M][kBlock] = {};
  for (int64_t c = 0; c < C; ++c) {
    const W* wc = w + c * kBlock;
    for (int64_t line = 0; line < kLines; ++line)
      __builtin_prefetch(reinterpret_cast<const char*>(wc) + kPrefetchAhead + 64 * line);
    for (int r = 0; r < M; ++r) {
      const float xv = x[r * x_stride + c];
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) acc[r][j] += xv * static_cast<float>(wc[j]);
    }
  }
  for (int r = 0; r < M; ++r) std::copy(acc[r], acc[r] + kBlock, sums + r * kBlock);
#endif
}

#if defined(__AVX512VNNI__)
// sums[r][0..64) = Σ_c q[r][c] · w[c][0..64) in int32 for one block of outputs: q M rows of
// C int8 (row stride C), w the block's unsigned weights (each offset by 128), C/4 x 64 x 4:
// for each four channels, each output's four weights side by side (a 32-bit lane of VNNI's
// dot product). The sums are of the offset weights: Σ_c q[r][c] · 128 is the caller's to
// take off.
template <int M>
void int8_block_sums(const int8_t* q, int64_t C, const uint8_t* w, int32_t* sums) {
  __m512i acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < C / 4; ++g) {
    const uint8_t* wg = w + g * 4 * kBlock;
    for (int64_t line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchAhead + 64 * line, _MM_HINT_T0);
    __m512i weights[4];
    for (int j = 0; j < 4; ++j) weights[j] = _mm512_loadu_si512(wg + 64 * j);
    for (int r = 0; r < M; ++r) {
      int32_t four;
      std::memcpy(&four, q + r * C + 4 * g, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], weights[j], xv);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(sums + r * kBlock + 16 * j, acc[r][j]);
}
#endif

// What is done with a block's sums for one row: y[j] = value(j) (+ bias) (+ add) (relu) for
// the block's `width` outputs from `start`.
template <typename Value>
inline void finish_row(Value value, int64_t start, int64_t width, const float* bias, const float* add, bool relu,
                       float* y) {
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) {
    float v = value(j);
    if (bias) v += bias[start + j];
    if (add) v += add[j];
    if (relu) v = std::max(v, 0.0f);
    y[j] = v;
  }
}

// Calls each(block, r, group) for every block of 64 outputs and every four rows from r (group:
// how many, a compile-time 1 to 4); the blocks are split between threads once a thread's
// share holds `work` multiply-adds. Each thread takes the same blocks on every call (torch's
// even split), so its share of a weight stays in its own core's cache from one call to the
// next where it fits there; each block is read from memory once, then from the core's cache.
template <typename Each>
void for_blocks(int64_t M, int64_t C, int64_t N, int64_t work, Each each) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, work / (M * C * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t end) {
    for (int64_t block = first; block < end; ++block) {
      for (int64_t r = 0; r < M; r += 4) {
        switch (std::min<int64_t>(4, M - r)) {
          case 1: each(block, r, std::integral_constant<int, 1>()); break;
          case 2: each(block, r, std::integral_constant<int, 2>()); break;
          case 3: each(block, r, std::integral_constant<int, 3>()); break;
          default: each(block, r, std::integral_constant<int, 4>()); break;
        }
      }
    }
  });
}

// out (M x N) = x (M x C) · W (· scales) (+ bias) (+ add) (relu) with float sums, W packed as
// N/64 blocks of C x 64 (float32, or int8 with N scales).
template <typename W>
void float_sums_product(const float* x, int64_t x_stride, int64_t M, const W* packed, int64_t C, int64_t N,
                        const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu,
                        float* out, int64_t out_stride, int64_t work) {
  for_blocks(M, C, N, work, [&](int64_t block, int64_t r, auto group) {
    constexpr int G = decltype(group)::value;
    float sums[G * kBlock];
    const int64_t start = block * kBlock, width = std::min(kBlock, N - start);
    block_sums<G>(x + r * x_stride, x_stride, packed + start * C, C, sums);
    for (int i = 0; i < G; ++i) {
      const float* s = sums + i * kBlock;
      const float* a = add ? add + (r + i) * add_stride + start : nullptr;
      float* y = out + (r + i) * out_stride + start;
      if (scales) {
        finish_row([&](int64_t j) { return s[j] * scales[start + j]; }, start, width, bias, a, relu, y);
      } else {
        finish_row([&](int64_t j) { return s[j]; }, start, width, bias, a, relu, y);
      }
    }
  });
}

// Rows rounded to int8 for VNNI's products: row r's values times 127 / its largest
// magnitude, rounded to the nearest integer (ties to even, as torch.round); scale[r] = the
// largest magnitude / 127, what the integer sums are multiplied by; offset[r] = 128 · Σ_c
// q[r][c], the packed weights' offset to take off. A row of zeros, or one too small for
// 127 / its largest magnitude to be finite, is zeros with scale 0; a row with an infinity
// or a NaN, zeros with a NaN scale (its products NaN, as float32's are).
void quantize_rows(const float* x, int64_t x_stride, int64_t M, int64_t C, int8_t* q, float* scale,
                   int32_t* offset) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * x_stride;
    int8_t* qr = q + r * C;
    float largest = 0.0f;
    bool finite = true;
    for (int64_t c = 0; c < C; ++c) {
      largest = std::max(largest, std::fabs(xr[c]));
      finite = finite && std::isfinite(xr[c]);
    }
    const float factor = 127.0f / largest;
    if (!finite || !std::isfinite(factor)) {
      std::fill(qr, qr + C, int8_t(0));
      scale[r] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      offset[r] = 0;
      continue;
    }
    int32_t total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < C; ++c) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[c] * factor)));
      qr[c] = static_cast<int8_t>(v);
      total += static_cast<int32_t>(v);
    }
    scale[r] = largest / 127.0f;
    offset[r] = 128 * total;
  }
}

}  // namespace

// lean.h's: on int8 weights with VNNI the rows rounded to int8 first and the sums made in
// int32 (int8_block_sums' packing), else float rows by each weight converted (block_sums'
// packing).
void lean::int8_rows(const float* x, int64_t x_stride, int64_t M, const int8_t* packed, int64_t C, int64_t N,
                     const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu,
                     float* out, int64_t out_stride) {
#if defined(__AVX512VNNI__)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> row_scale;
  thread_local std::vector<int32_t> offset;
  q.resize(M * C), row_scale.resize(M), offset.resize(M);
  quantize_rows(x, x_stride, M, C, q.data(), row_scale.data(), offset.data());
  const int8_t* rows = q.data();
  const float* row_scales = row_scale.data();
  const int32_t* offsets = offset.data();
  const uint8_t* weights = reinterpret_cast<const uint8_t*>(packed);
  for_blocks(M, C, N, kInt8ParallelWork, [&](int64_t block, int64_t r, auto group) {
    constexpr int G = decltype(group)::value;
    int32_t sums[G * kBlock];
    const int64_t start = block * kBlock, width = std::min(kBlock, N - start);
    int8_block_sums<G>(rows + r * C, C, weights + start * C, sums);
    for (int i = 0; i < G; ++i) {
      const int32_t* s = sums + i * kBlock;
      const int32_t taken = offsets[r + i];
      const float row = row_scales[r + i];
      const float* column = scales + start;
      finish_row([&](int64_t j) { return static_cast<float>(s[j] - taken) * column[j] * row; }, start, width,
                 bias, add ? add + (r + i) * add_stride + start : nullptr, relu,
                 out + (r + i) * out_stride + start);
    }
  });
#else
  float_sums_product(x, x_stride, M, packed, C, N, scales, bias, add, add_stride, relu, out, out_stride,
                     kInt8ParallelWork);
#endif
}

namespace {

// Whether the memory spans of two tensors (first to last element) meet: a cautious test of
// overlap (ATen's passes views with gaps between their rows unchecked).
bool spans_meet(const at::Tensor& a, const at::Tensor& b) {
  auto span = [](const at::Tensor& t) {
    const char* first = static_cast<const char*>(t.data_ptr());
    int64_t last = 0;
    for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

int64_t lean::int8_channel_group() { return kInt8Rows ? 4 : 1; }

void lean::check_packed_weights(const at::Tensor& packed, const at::Tensor* scales, const at::Tensor* bias, int64_t C,
                                int64_t N, const char* who) {
  const char* kind = scales ? "int8" : "float32";
  TORCH_CHECK(C > 0, who, ": at least one input channel");
  TORCH_CHECK(packed.scalar_type() == (scales ? at::kChar : at::kFloat) && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(1) == C && packed.size(2) == kBlock &&
                  packed.size(0) * kBlock >= N && (packed.size(0) - 1) * kBlock < N,
              who, ": packed weights N/64 x C x 64 ", kind, ", contiguous");
  TORCH_CHECK(!scales || (scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == N),
              who, ": N float32 scales");
  TORCH_CHECK(!scales || !kInt8Rows || (C % 4 == 0 && C <= kInt8MostChannels), who,
              ": int8 weights take input channels in fours, at most ", kInt8MostChannels);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              who, ": a bias of N float32");
  TORCH_CHECK(packed.device().is_cpu() && (!scales || scales->device().is_cpu()) && (!bias || bias->device().is_cpu()),
              who, ": tensors on the CPU");
}

void lean::check_int8_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor* bias, int64_t C,
                              const char* who) {
  check_packed_weights(packed, &scales, bias, C, scales.numel(), who);
}

void lean::float_rows(const float* x, int64_t x_stride, int64_t M, const float* packed, int64_t C, int64_t N,
                      const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
                      int64_t out_stride) {
  float_sums_product(x, x_stride, M, packed, C, N, nullptr, bias, add, add_stride, relu, out, out_stride,
                     kFloatParallelWork);
}

namespace {

// int8_product and float_product: x (M x C float32, channels contiguous) by packed weights
// (N/64 blocks of C x 64, N rounded up to a block; output n's weight for channel c at
// [n/64][c][n%64], or for VNNI's int8 products (int8_channel_group() 4) at
// [n/64][c/4][n%64][c%4] plus 128, C a multiple of 4) -> out M x N = x · W (· scales, int8)
// (+ bias) (+ add) (relu), into `out` where given (M x N, channels contiguous; it may be
// `add` itself, and must overlap nothing else it reads).
at::Tensor checked_product(const char* who, const at::Tensor& x, const at::Tensor& packed, const at::Tensor* scales,
                           int64_t N, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add,
                           bool relu, std::optional<at::Tensor> out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, who,
              ": x M x C float32, channels contiguous");
  const int64_t M = x.size(0), C = x.size(1);
  lean::check_packed_weights(packed, scales, bias ? &*bias : nullptr, C, N, who);
  TORCH_CHECK(!add || (add->scalar_type() == at::kFloat && add->dim() == 2 && add->size(0) == M &&
                       add->size(1) == N && add->stride(1) == 1),
              who, ": add M x N float32, channels contiguous");
  at::Tensor y = out ? *out : at::empty({M, N}, x.options());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.stride(1) == 1,
              who, ": out M x N float32, channels contiguous");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && (!add || add->device().is_cpu()), who,
              ": tensors on the CPU");
  at::assert_no_internal_overlap(y);
  TORCH_CHECK(!spans_meet(y, x), who, ": out must not overlap x");  // x is read while out is written
  TORCH_CHECK(!add || (add->data_ptr() == y.data_ptr() && add->strides() == y.strides()) || !spans_meet(y, *add),
              who, ": out must be add itself or not overlap it");
  if (M == 0) return y;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* a = add ? add->data_ptr<float>() : nullptr;
  const int64_t a_stride = add ? add->stride(0) : 0;
  if (scales) {
    lean::int8_rows(x.data_ptr<float>(), x.stride(0), M, packed.data_ptr<int8_t>(), C, N, scales->data_ptr<float>(), b,
                    a, a_stride, relu, y.data_ptr<float>(), y.stride(0));
  } else {
    lean::float_rows(x.data_ptr<float>(), x.stride(0), M, packed.data_ptr<float>(), C, N, b, a, a_stride, relu,
                     y.data_ptr<float>(), y.stride(0));
  }
  return y;
}

}  // namespace

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add, bool relu,
                        std::optional<at::Tensor> out) {
  return checked_product("int8_product", x, packed, &scales, scales.numel(), bias, add, relu, std::move(out));
}

// N: the outputs (the packed copy's last block may hold fewer).
at::Tensor float_product(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add, bool relu,
                         std::optional<at::Tensor> out) {
  return checked_product("float_product", x, packed, nullptr, N, bias, add, relu, std::move(out));
}
