// A product of a few float32 rows by int8 weights: the draft's step on a CPU.
//
// At one row to four a product reads each weight once per row, so its cost is the weight's
// bytes and what is done with each: torch's weight-only int8 kernel rounds the rows to
// bf16, multiplies in bf16 blocks and hands back bf16 that a bias add and a conversion turn
// into float32 (three operations, ~13 µs for 256 x 768 on one thread, slower per byte than
// float32's product). Here each int8 weight becomes a float exactly and is multiplied into
// float32 sums, every row at once, from a layout in which the weights of 64 outputs for one
// input channel are 64 consecutive bytes (packed by fairseq_bpd/product.py), so the loop
// reads the weight front to back; the scale, bias, a residual and relu are applied to the
// sums. What it rounds differs from the float32 product only by the weights' own rounding
// to int8 (the proposals it serves are verified in float32 by head 1).
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

constexpr int64_t kBlock = 64;  // outputs per packed block: 64 int8 weights a channel
// Multiply-adds a thread's share must hold before a product is split between threads
// (below it the hand-off costs more than it saves; measured on 1-4 rows).
constexpr int64_t kParallelWork = 1 << 17;
// How far ahead of the loop the weight is fetched (bytes): a product's weight is usually
// not in the core's cache (the base's pass read 19 MB since the draft's last step), and
// the hardware's prefetcher stops at each 4 KB page. A fetch past the weight's end is harmless.
constexpr int64_t kPrefetchAhead = 2048;

// sums[r][0..64) = Σ_c x[r][c] · w[c][0..64) for one block of outputs (w C x 64 int8).
template <int M>
void block_sums(const float* x, int64_t x_stride, const int8_t* w, int64_t C, float* sums) {
#if defined(__AVX512F__)
  __m512 acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int8_t* wc = w + c * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetchAhead), _MM_HINT_T0);
    __m512 weights[4];
    for (int j = 0; j < 4; ++j)
      weights[j] =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 16 * j))));
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
    const int8_t* wc = w + c * kBlock;
    __builtin_prefetch(wc + kPrefetchAhead);
    for (int r = 0; r < M; ++r) {
      const float xv = x[r * x_stride + c];
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) acc[r][j] += xv * static_cast<float>(wc[j]);
    }
  }
  for (int r = 0; r < M; ++r) std::copy(acc[r], acc[r] + kBlock, sums + r * kBlock);
#endif
}

template <int M>
void rows_product(const float* x, int64_t x_stride, const int8_t* packed, int64_t C, int64_t N, const float* scales,
                  const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
                  int64_t out_stride) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Each thread takes the same blocks on every call (torch's even split), so its share of a
  // weight stays in its own core's cache from one draft step to the next.
  const int64_t grain = std::max<int64_t>(1, kParallelWork / (M * C * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t end) {
    float sums[M * kBlock];
    for (int64_t block = first; block < end; ++block) {
      const int64_t start = block * kBlock;
      block_sums<M>(x, x_stride, packed + start * C, C, sums);
      const int64_t width = std::min(kBlock, N - start);
      for (int r = 0; r < M; ++r) {
        float* y = out + r * out_stride + start;
        const float* a = add ? add + r * add_stride + start : nullptr;
        const float* s = sums + r * kBlock;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
          float v = s[j] * scales[start + j];
          if (bias) v += bias[start + j];
          if (a) v += a[j];
          if (relu) v = std::max(v, 0.0f);
          y[j] = v;
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

void lean::check_int8_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor* bias, int64_t C,
                              const char* who) {
  const int64_t N = scales.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == C && packed.size(2) == kBlock && packed.size(0) * kBlock >= N &&
                  (packed.size(0) - 1) * kBlock < N,
              who, ": packed weights N/64 x C x 64 int8, contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), who, ": N float32 scales");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              who, ": a bias of N float32");
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu() && (!bias || bias->device().is_cpu()), who,
              ": tensors on the CPU");
}

void lean::int8_rows(const float* x, int64_t x_stride, int64_t M, const int8_t* packed, int64_t C, int64_t N,
                     const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu,
                     float* out, int64_t out_stride) {
  for (int64_t r = 0; r < M; r += 4) {  // the weight read once per four rows
    const float* xr = x + r * x_stride;
    const float* ar = add ? add + r * add_stride : nullptr;
    float* yr = out + r * out_stride;
    switch (std::min<int64_t>(4, M - r)) {
      case 1: rows_product<1>(xr, x_stride, packed, C, N, scales, bias, ar, add_stride, relu, yr, out_stride); break;
      case 2: rows_product<2>(xr, x_stride, packed, C, N, scales, bias, ar, add_stride, relu, yr, out_stride); break;
      case 3: rows_product<3>(xr, x_stride, packed, C, N, scales, bias, ar, add_stride, relu, yr, out_stride); break;
      default: rows_product<4>(xr, x_stride, packed, C, N, scales, bias, ar, add_stride, relu, yr, out_stride); break;
    }
  }
}

// x (M x C float32, channels contiguous) by packed int8 weights (N/64 blocks of C x 64, N
// rounded up to a block; output n's weight for channel c at [n/64][c][n%64]) -> out M x N
// = x · Wᵀ · scales (+ bias) (+ add) (relu), into `out` where given (M x N, channels
// contiguous; it may be `add` itself, and must overlap nothing else it reads).
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add, bool relu,
                        std::optional<at::Tensor> out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "int8_product: x M x C float32, channels contiguous");
  const int64_t M = x.size(0), C = x.size(1), N = scales.numel();
  lean::check_int8_weights(packed, scales, bias ? &*bias : nullptr, C, "int8_product");
  TORCH_CHECK(!add || (add->scalar_type() == at::kFloat && add->dim() == 2 && add->size(0) == M &&
                       add->size(1) == N && add->stride(1) == 1),
              "int8_product: add M x N float32, channels contiguous");
  at::Tensor y = out ? *out : at::empty({M, N}, x.options());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.stride(1) == 1,
              "int8_product: out M x N float32, channels contiguous");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && (!add || add->device().is_cpu()),
              "int8_product: tensors on the CPU");
  at::assert_no_internal_overlap(y);
  TORCH_CHECK(!spans_meet(y, x), "int8_product: out must not overlap x");  // x is read while out is written
  TORCH_CHECK(!add || (add->data_ptr() == y.data_ptr() && add->strides() == y.strides()) || !spans_meet(y, *add),
              "int8_product: out must be add itself or not overlap it");
  if (M == 0) return y;
  lean::int8_rows(x.data_ptr<float>(), x.stride(0), M, packed.data_ptr<int8_t>(), C, N, scales.data_ptr<float>(),
                  bias ? bias->data_ptr<float>() : nullptr, add ? add->data_ptr<float>() : nullptr,
                  add ? add->stride(0) : 0, relu, y.data_ptr<float>(), y.stride(0));
  return y;
}
