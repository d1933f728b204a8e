// Dropout for head training whose mask is a hash of each element's index and a seed.
//
// torch's CPU dropout draws every element from one Mersenne twister, one element after
// another on one thread: in a draft's training step its masks cost about as much as the
// layer's products. A counter-based mask (each element's keep bit a function of the seed
// and its index, as Philox gives GPUs) splits between threads, vectorises, and needs no
// mask kept for backward: the gradient passes through the same function of the same seed.
#include "lean.h"

#include <ATen/Parallel.h>

namespace {

// Wellons' lowbias32: a 32-bit integer hash whose output bits each flip with probability
// close to 1/2 when any input bit flips; two rounds, the seed's halves between them.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline uint32_t element_hash(uint32_t index, uint32_t seed_low, uint32_t seed_high) {
  return lowbias32(lowbias32(index * 0x9e3779b9U + seed_low) ^ seed_high);
}

constexpr int kChunk = 256;  // elements whose hashes are made together

// The hashes of elements first .. first + kChunk - 1, in a loop of integer operations
// alone, which the compiler vectorises (with the multiply beside them it did not).
inline void hash_chunk(uint32_t* hash, uint32_t first, uint32_t low, uint32_t high) {
#pragma omp simd
  for (int j = 0; j < kChunk; ++j) hash[j] = element_hash(first + static_cast<uint32_t>(j), low, high);
}

// out[i] = x[i] * scale where element i is kept (its hash at or above `dropped`), else x[i] * 0
// (a NaN or an infinity dropped stays NaN, as in torch's dropout).
template <typename T>
void keep_scaled(const T* x, T* out, int64_t first, int64_t end, uint32_t low, uint32_t high, uint32_t dropped,
                 double scale) {
  using Math = std::conditional_t<std::is_same_v<T, double>, double, float>;  // bfloat16, half: float
  const Math kept_scale = static_cast<Math>(scale);
  uint32_t hash[kChunk];
  for (int64_t start = first; start < end; start += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, end - start));
    hash_chunk(hash, static_cast<uint32_t>(start), low, high);
#pragma omp simd
    for (int j = 0; j < n; ++j)
      out[start + j] = static_cast<T>(static_cast<Math>(x[start + j]) * (hash[j] >= dropped ? kept_scale : Math(0)));
  }
}

// bfloat16 by its bits (lean::bf16_to_float, lean::float_to_bf16), which the compiler vectorises.
template <>
void keep_scaled<at::BFloat16>(const at::BFloat16* x, at::BFloat16* out, int64_t first, int64_t end, uint32_t low,
                               uint32_t high, uint32_t dropped, double scale) {
  const float kept_scale = static_cast<float>(scale);
  const auto* in = reinterpret_cast<const uint16_t*>(x);
  auto* result = reinterpret_cast<uint16_t*>(out);
  uint32_t hash[kChunk];
  for (int64_t start = first; start < end; start += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, end - start));
    hash_chunk(hash, static_cast<uint32_t>(start), low, high);
#pragma omp simd
    for (int j = 0; j < n; ++j) {
      const float kept = hash[j] >= dropped ? kept_scale : 0.0f;
      result[start + j] = lean::float_to_bf16(lean::bf16_to_float(in[start + j]) * kept);
    }
  }
}

constexpr int64_t kDropoutGrain = 1 << 15;  // elements a thread's share holds at least

}  // namespace

// x's elements kept with probability 1 - p and scaled by 1 / (1 - p), the rest zero, by a
// mask that seed and the element's index (x contiguous, under 2^32 elements) decide alone.
at::Tensor hash_dropout(const at::Tensor& x, double p, int64_t seed) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "hash_dropout: a contiguous CPU tensor");
  TORCH_CHECK(x.numel() < (int64_t(1) << 32), "hash_dropout: under 2^32 elements");
  TORCH_CHECK(p >= 0.0 && p < 1.0, "hash_dropout: p in [0, 1)");
  auto out = at::empty_like(x);
  // Dropped where the hash, uniform on [0, 2^32), falls below p * 2^32.
  const auto dropped = static_cast<uint32_t>(std::min<int64_t>(std::llround(p * 4294967296.0), 4294967295));
  const double scale = 1.0 / (1.0 - p);
  const auto low = static_cast<uint32_t>(static_cast<uint64_t>(seed));
  const auto high = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hash_dropout", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* result = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kDropoutGrain, [&](int64_t first, int64_t end) {
      keep_scaled(in, result, first, end, low, high, dropped, scale);
    });
  });
  return out;
}
