// Products of a few float32 rows by packed weights, int8 or float32: the draft's step and,
// at a few rows, the decoder's layers and head 1's projection on a CPU.
//
// At one row to a few a product reads each weight once per call, so its cost is the
// weight's bytes and what is done with each. Here the weights are packed so that those of
// 64 outputs for one input channel lie side by side (by fairseq_bpd/product.py), the loop
// reads them front to back, and every row is multiplied in at once into float32 sums; the
// bias, a residual and relu are applied to the sums. The weights are split between torch's
// threads, each taking the same share every call.
//
// int8 weights (the draft's): each becomes a float exactly, and the sums are scaled per
// output. torch's weight-only int8 kernel rounds the rows to bf16, multiplies in bf16
// blocks and hands back bf16 that a bias add and a conversion make float32 (three
// operations, slower per byte than float32's product). What these round differs from the
// float32 product only by the weights' own rounding to int8 (the proposals they serve are
// verified in float32 by head 1).
//
// float32 weights: the same loop. A layer's products at batch 1 read their weights from
// beyond the cores' caches; MKL's small products there did not split them between the
// cores or fetch ahead, and these ran the layers' eighteen products in about three
// quarters of MKL's time at one to sixteen rows. They sum in their own order, so they
// round differently from MKL's, as any block pass does.
#include <torch/extension.h>

#include <algorithm>
#include <optional>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include "lean.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // outputs per packed block: 64 weights a channel
// Multiply-adds a thread's share must hold before a product is split between threads
// (below it the hand-off costs more than it saves; measured on 1-4 rows): int8 weights,
// four times fewer bytes a multiply-add, pay for it later than float32's.
template <typename W>
constexpr int64_t parallel_work() { return std::is_same_v<W, int8_t> ? (1 << 17) : (1 << 14); }
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

// sums[r][0..64) = Σ_c x[r][c] · w[c][0..64) for one block of outputs (w C x 64).
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

// Rows r.. (M of them, at most 4) of out's block `block`: their sums, scaled (scales: null
// for float32 weights), the bias, add and relu applied.
template <int M, typename W>
void block_rows(const float* x, int64_t x_stride, const W* packed, int64_t C, int64_t N, int64_t block,
                const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
                int64_t out_stride) {
  float sums[M * kBlock];
  const int64_t start = block * kBlock;
  block_sums<M>(x, x_stride, packed + start * C, C, sums);
  const int64_t width = std::min(kBlock, N - start);
  for (int r = 0; r < M; ++r) {
    float* y = out + r * out_stride + start;
    const float* a = add ? add + r * add_stride + start : nullptr;
    const float* s = sums + r * kBlock;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      float v = scales ? s[j] * scales[start + j] : s[j];
      if (bias) v += bias[start + j];
      if (a) v += a[j];
      if (relu) v = std::max(v, 0.0f);
      y[j] = v;
    }
  }
}

// out (M x N) = x (M x C) · W (+ bias) (+ add) (relu), W packed (N/64 blocks of C x 64); the
// blocks split between threads, each block's rows four at a time (a block read from memory
// once, then from the core's cache).
template <typename W>
void rows_product(const float* x, int64_t x_stride, int64_t M, const W* packed, int64_t C, int64_t N,
                  const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
                  int64_t out_stride) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Each thread takes the same blocks on every call (torch's even split), so its share of a
  // weight stays in its own core's cache from one call to the next where it fits there.
  const int64_t grain = std::max<int64_t>(1, parallel_work<W>() / (M * C * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t end) {
    for (int64_t block = first; block < end; ++block) {
      for (int64_t r = 0; r < M; r += 4) {
        const float* xr = x + r * x_stride;
        const float* ar = add ? add + r * add_stride : nullptr;
        float* yr = out + r * out_stride;
        auto rows = [&](auto group) {
          block_rows<decltype(group)::value>(xr, x_stride, packed, C, N, block, scales, bias, ar, add_stride, relu,
                                             yr, out_stride);
        };
        switch (std::min<int64_t>(4, M - r)) {
          case 1: rows(std::integral_constant<int, 1>()); break;
          case 2: rows(std::integral_constant<int, 2>()); break;
          case 3: rows(std::integral_constant<int, 3>()); break;
          default: rows(std::integral_constant<int, 4>()); break;
        }
      }
    }
  });
}

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
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              who, ": a bias of N float32");
  TORCH_CHECK(packed.device().is_cpu() && (!scales || scales->device().is_cpu()) && (!bias || bias->device().is_cpu()),
              who, ": tensors on the CPU");
}

void lean::check_int8_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor* bias, int64_t C,
                              const char* who) {
  check_packed_weights(packed, &scales, bias, C, scales.numel(), who);
}

void lean::int8_rows(const float* x, int64_t x_stride, int64_t M, const int8_t* packed, int64_t C, int64_t N,
                     const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu,
                     float* out, int64_t out_stride) {
  rows_product(x, x_stride, M, packed, C, N, scales, bias, add, add_stride, relu, out, out_stride);
}

void lean::float_rows(const float* x, int64_t x_stride, int64_t M, const float* packed, int64_t C, int64_t N,
                      const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
                      int64_t out_stride) {
  rows_product(x, x_stride, M, packed, C, N, nullptr, bias, add, add_stride, relu, out, out_stride);
}

namespace {

// int8_product and float_product: x (M x C float32, channels contiguous) by packed weights
// (N/64 blocks of C x 64, N rounded up to a block; output n's weight for channel c at
// [n/64][c][n%64]) -> out M x N = x · W (· scales, int8) (+ bias) (+ add) (relu), into
// `out` where given (M x N, channels contiguous; it may be `add` itself, and must overlap
// nothing else it reads).
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
