// What the compiled kernels share (lean.cpp, few_rows.cpp, draft_step.cpp, block_pass.cpp).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lean {

// Cephes' expf: x = n ln 2 + r (ln 2 in two parts, the second added back), e^r a degree-6
// polynomial, 2^n by the exponent's bits; within 2 ulp of the true value.
namespace cephes_exp {
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace cephes_exp

// e^x for float32 in a form the compiler vectorises (std::exp is a call per value), for
// x <= 0 (attention's scores less their maximum). Below -87 it gives ~1e-38, not 0: against
// a sum of at least 1 that changes nothing.
inline float exp_nonpositive(float x) {
  using namespace cephes_exp;
  x = std::max(x, -87.0f);
  const float n = std::floor(x * kLog2e + 0.5f);
  x = x - n * kLn2High;
  x = x + n * kLn2Low;
  const float y = (((((kP0 * x + kP1) * x + kP2) * x + kP3) * x + kP4) * x + kP5) * (x * x) + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}
inline double exp_nonpositive(double x) { return std::exp(x); }  // float64: the tests' dtype

// bfloat16 by its bits, in forms the compiler vectorises (c10's conversions it did not): the
// value is the float with these 16 bits on top; a float is rounded to nearest, ties to even,
// as c10 rounds, and a NaN stays a NaN.
inline float bf16_to_float(uint16_t bits) { return __builtin_bit_cast(float, uint32_t(bits) << 16); }
inline uint16_t float_to_bf16(float y) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, y);
  return static_cast<uint16_t>(y != y ? 0x7fc0U : (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16);
}

template <typename T>
void norm_row(const T* x, T* out, const T* weight, const T* bias, int64_t c, double eps) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < c; ++i) sum += x[i];
  const T shift = sum / c;
  T squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < c; ++i) squares += (x[i] - shift) * (x[i] - shift);
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(squares) / c + eps));
#pragma omp simd
  for (int64_t i = 0; i < c; ++i) {
    T y = (x[i] - shift) * scale;
    if (weight) y = y * weight[i];
    if (bias) y = y + bias[i];
    out[i] = y;
  }
}

// A residual sum and its layer norm, one row: sum += other, then normed = LN(sum).
template <typename T>
void residual_row(T* sum, const T* other, T* normed, const T* weight, const T* bias, int64_t c, double eps) {
#pragma omp simd
  for (int64_t i = 0; i < c; ++i) sum[i] += other[i];
  norm_row(sum, normed, weight, bias, c, eps);
}

// Attention's weights for one query over `count` keys: seen(j, &bias) says whether key j is
// seen (and sets its additive bias), key(j) points to its vector, dot(k) is the query's dot
// product with one. Leaves score[j] = e^(factor · dot + bias − the largest) for the keys
// seen (allowed[j] true; the others are not read) and returns 1 / their sum: the factor
// that makes them a softmax; 0 where no key is seen (the sum is at least 1 otherwise).
template <typename T, typename Seen, typename Key, typename Dot>
T attention_weights(int64_t count, T factor, Seen seen, Key key, Dot dot, std::vector<T>& score,
                    std::vector<char>& allowed) {
  score.resize(count);
  allowed.resize(count);
  T best = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < count; ++j) {
    T bias = 0;
    allowed[j] = seen(j, &bias);
    if (!allowed[j]) continue;
    const T s = dot(key(j)) * factor + bias;
    score[j] = s;
    best = std::max(best, s);
  }
  if (best == -std::numeric_limits<T>::infinity()) return T(0);
  T total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < count; ++j) {
    const T e = allowed[j] ? exp_nonpositive(score[j] - best) : T(0);
    score[j] = e;
    total += e;
  }
  return T(1) / total;
}

// One query's attention over `count` keys: seen, key as attention_weights's, value(j) points
// to value j (d contiguous). out (d) = softmax(factor · q · kᵀ + bias) · v over the keys
// seen, none of the others read; zeros where no key is seen, as torch's fused attention
// gives. score, allowed: scratch.
template <typename T, typename Seen, typename Key, typename Value>
void attend_query_any(const T* q, int64_t d, int64_t count, T factor, Seen seen, Key key, Value value, T* out,
                      std::vector<T>& score, std::vector<char>& allowed) {
  auto dot = [&](const T* k) {
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < d; ++c) s += q[c] * k[c];
    return s;
  };
  const T scale = attention_weights(count, factor, seen, key, dot, score, allowed);
  std::fill(out, out + d, T(0));
  if (scale == T(0)) return;
  for (int64_t j = 0; j < count; ++j) {
    if (!allowed[j]) continue;
    const T p = score[j] * scale;
    const T* v = value(j);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) out[c] += p * v[c];
  }
}

#if defined(__AVX512F__)
// attend_query for float32 vectors of 64 (the shipped model's heads): the query and the
// weighted sum of values held in registers, each key's dot product in two independent
// chains; about half attend_query_any's time, whose loops the compiler leaves to memory
// (out might alias a value) and to one chain.
template <typename Seen, typename Key, typename Value>
void attend_query_64(const float* q, int64_t count, float factor, Seen seen, Key key, Value value, float* out,
                     std::vector<float>& score, std::vector<char>& allowed) {
  const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
               q3 = _mm512_loadu_ps(q + 48);
  auto dot = [&](const float* k) {
    const __m512 a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), _mm512_mul_ps(q0, _mm512_loadu_ps(k)));
    const __m512 b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16)));
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  };
  const float scale = attention_weights(count, factor, seen, key, dot, score, allowed);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t j = 0; scale != 0.0f && j < count; ++j) {
    if (!allowed[j]) continue;
    const __m512 p = _mm512_set1_ps(score[j] * scale);
    const float* v = value(j);
    s0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v), s0);
    s1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16), s1);
    s2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 32), s2);
    s3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 48), s3);
  }
  _mm512_storeu_ps(out, s0);
  _mm512_storeu_ps(out + 16, s1);
  _mm512_storeu_ps(out + 32, s2);
  _mm512_storeu_ps(out + 48, s3);
}
#endif

template <typename T, typename Seen, typename Key, typename Value>
void attend_query(const T* q, int64_t d, int64_t count, T factor, Seen seen, Key key, Value value, T* out,
                  std::vector<T>& score, std::vector<char>& allowed) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (d == 64) return attend_query_64(q, count, factor, seen, key, value, out, score, allowed);
  }
#endif
  attend_query_any(q, d, count, factor, seen, key, value, out, score, allowed);
}

// Refuses (naming `who`) what is not a product's packed copy for C input channels and N
// outputs: packed N/64 x C x 64, int8 with N float32 scales or float32 (scales null), a
// bias of N float32 or none, on the CPU; int8 for VNNI (int8_channel_group() 4) with C a
// multiple of 4, at most 65536.
void check_packed_weights(const at::Tensor& packed, const at::Tensor* scales, const at::Tensor* bias, int64_t C,
                          int64_t N, const char* who);
void check_int8_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor* bias, int64_t C,
                        const char* who);

// How the int8 products group input channels in their packed weights: 4 where they run on
// VNNI (rows rounded to int8, weights offset by 128: product.int8_blocked), else 1 (as
// float32's).
int64_t int8_channel_group();

// out (M x N, row stride out_stride) = x (M x C, row stride x_stride) · Wᵀ · scales
// (+ bias) (+ add) (relu), W int8 packed as int8_channel_group() says (few_rows.cpp); any
// M, four rows at a time; add may be out itself; bias and add may be null. With VNNI the
// rows are rounded to int8 first.
void int8_rows(const float* x, int64_t x_stride, int64_t M, const int8_t* packed, int64_t C, int64_t N,
               const float* scales, const float* bias, const float* add, int64_t add_stride, bool relu, float* out,
               int64_t out_stride);

// The same with float32 weights packed alike (no scales).
void float_rows(const float* x, int64_t x_stride, int64_t M, const float* packed, int64_t C, int64_t N,
                const float* bias, const float* add, int64_t add_stride, bool relu, float* out, int64_t out_stride);

}  // namespace lean

// lean.cpp's attention and residual norm (their comments there), which block_pass.cpp calls
// as static_pass.py does.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask, std::optional<double> scale);
std::vector<at::Tensor> residual_norm(const at::Tensor& x, at::Tensor& y, const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps, bool pre);
