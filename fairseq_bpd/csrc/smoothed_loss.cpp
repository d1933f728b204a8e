// Label-smoothed cross-entropy of logit rows, forward and backward, for head training.
//
// Frozen head training's largest cost is the heads' loss over their shortlist: torch makes a
// float32 copy of the N x V logits, their log-softmax, a gather and a row sum, then as many
// passes again backward, each over all N x V values in memory. Here a row is read three
// times while it sits in the L1 cache (its maximum, then its sums; backward, its gradient),
// and only the gradient is written: fairseq's label_smoothed_nll_loss of the log-softmax,
// the same sums in another order.
#include "lean.h"

#include <ATen/Parallel.h>

namespace {

inline float as_float(float x) { return x; }
inline float as_float(uint16_t bits) { return lean::bf16_to_float(bits); }  // bfloat16

inline void store(float* out, float y) { *out = y; }
inline void store(uint16_t* out, float y) { *out = lean::float_to_bf16(y); }

struct Smoothing {
  float on_target;  // 1 - eps - eps / (V - 1): the nll's weight in fairseq's label smoothing
  float each;       // eps / (V - 1): every token's
};

// What a row's passes give: its maximum, the sum of its values and where the first maximum is.
struct RowTop {
  float top, total;
  int64_t first;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Sixteen values at a time by hand: the compiler left the exponential's loops scalar when
// they sum into one value or read bfloat16 (mixed widths).
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1U << left) - 1U); }
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const uint16_t* x, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* out, __m512 y, __mmask16 m) { _mm512_mask_storeu_ps(out, m, y); }
inline void store16(uint16_t* out, __m512 y, __mmask16 m) {  // as store() rounds, lane by lane
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(out, m, _mm512_cvtepi32_epi16(rounded));
}
// lean::exp_nonpositive, sixteen at once (x <= 0).
inline __m512 exp16(__m512 x) {
  using namespace lean::cephes_exp;
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), x);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kP0), x, _mm512_set1_ps(kP1));
  for (const float p : {kP2, kP3, kP4, kP5}) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(p));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(scale));
}

template <typename S>
RowTop row_top(const S* x, int64_t v) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), total = _mm512_setzero_ps();
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 m = lanes(v - j);
    const __m512 y = load16(x + j, m);
    top = _mm512_mask_max_ps(top, m, top, y);
    total = _mm512_add_ps(total, y);  // masked lanes load 0
  }
  RowTop r{_mm512_reduce_max_ps(top), _mm512_reduce_add_ps(total), v};
  const __m512 best = _mm512_set1_ps(r.top);
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes(v - j), load16(x + j, lanes(v - j)), best, _CMP_EQ_OQ);
    if (hit) {
      r.first = j + __builtin_ctz(hit);
      break;
    }
  }
  return r;
}

template <typename S>
float sum_exp(const S* x, int64_t v, float shift) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(shift);
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 m = lanes(v - j);
    sum = _mm512_mask_add_ps(sum, m, sum, exp16(_mm512_sub_ps(load16(x + j, m), s)));
  }
  return _mm512_reduce_add_ps(sum);
}

// grad_j = g exp(x_j - l) - shift over the row.
template <typename S>
void softmax_less(const S* x, S* grad, int64_t v, float g, float l, float shift) {
  const __m512 gs = _mm512_set1_ps(g), ls = _mm512_set1_ps(l), ss = _mm512_set1_ps(shift);
  for (int64_t j = 0; j < v; j += 16) {
    const __mmask16 m = lanes(v - j);
    store16(grad + j, _mm512_fmsub_ps(gs, exp16(_mm512_sub_ps(load16(x + j, m), ls)), ss), m);
  }
}
#else
template <typename S>
RowTop row_top(const S* x, int64_t v) {
  RowTop r{-std::numeric_limits<float>::infinity(), 0.0f, v};
  for (int64_t j = 0; j < v; ++j) {
    const float y = as_float(x[j]);
    if (y > r.top) r.top = y, r.first = j;
    r.total += y;
  }
  return r;
}

template <typename S>
float sum_exp(const S* x, int64_t v, float shift) {
  float sum = 0.0f;
  for (int64_t j = 0; j < v; ++j) sum += lean::exp_nonpositive(as_float(x[j]) - shift);
  return sum;
}

template <typename S>
void softmax_less(const S* x, S* grad, int64_t v, float g, float l, float shift) {
  for (int64_t j = 0; j < v; ++j) store(grad + j, g * lean::exp_nonpositive(as_float(x[j]) - l) - shift);
}
#endif

// One row's loss, log-sum-exp and best token (the first of tied maxima, as max's index).
// A row with a NaN, a +inf or nothing above -inf has log-probs all NaN under torch's
// log-softmax: its loss and gradient are NaN here too, its best token 0 (max's over NaNs).
// A -inf logit alone is a token of probability 0, as there (the smoothing term infinite).
template <typename S>
void forward_row(const S* x, int64_t v, int64_t target, bool ignored, Smoothing w, float* loss, float* lse,
                 int64_t* best) {
  const RowTop r = row_top(x, v);
  if (std::isnan(r.total) || std::isinf(r.top)) {
    *best = 0;
    *lse = std::numeric_limits<float>::quiet_NaN();
    *loss = ignored ? 0.0f : *lse;
    return;
  }
  *best = r.first;
  const float l = r.top + std::log(sum_exp(x, v, r.top));
  *lse = l;
  const float nll = l - as_float(x[target]);
  const float smooth = static_cast<float>(v) * l - r.total;  // -(the row's log-probs' sum)
  *loss = ignored ? 0.0f : w.on_target * nll + w.each * smooth;
}

// d loss / d x_j = g (p_j - each - on_target [j = target]), p the row's softmax.
template <typename S>
void backward_row(const S* x, S* grad, int64_t v, int64_t target, bool ignored, Smoothing w, float g, float l) {
  if (ignored) g = 0.0f;
  if (std::isnan(l)) {
    for (int64_t j = 0; j < v; ++j) store(grad + j, ignored ? 0.0f : l);
    return;
  }
  softmax_less(x, grad, v, g, l, g * w.each);
  // The target's again, whole (not its rounded value less the rest: bfloat16 would round twice).
  store(grad + target, g * lean::exp_nonpositive(as_float(x[target]) - l) - g * w.each - g * w.on_target);
}

constexpr int64_t kRowGrain = 8;

Smoothing smoothing(double eps, int64_t v) {
  const double each = eps / static_cast<double>(v - 1);
  return {static_cast<float>(1.0 - eps - each), static_cast<float>(each)};
}

void check(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "smoothed_nll: contiguous N x V logits on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "smoothed_nll: float32 or bfloat16 logits");
  TORCH_CHECK(logits.size(1) > 1, "smoothed_nll: two logits a row at least");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.is_contiguous() &&
                  target.size(0) == logits.size(0),
              "smoothed_nll: a contiguous int64 target per row");
}

template <typename F>
void dispatch(const at::Tensor& logits, F&& f) {
  if (logits.scalar_type() == at::kFloat)
    f(logits.data_ptr<float>());
  else
    f(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()));
}

}  // namespace

// (loss N, log-sum-exp N, best token N) of logits N x V against target N: fairseq's
// label_smoothed_nll_loss(log_softmax(logits), target, eps, ignore_index, reduce=False),
// float32; rows whose target is ignore_index lose 0.
std::vector<at::Tensor> smoothed_nll_forward(const at::Tensor& logits, const at::Tensor& target, double eps,
                                             int64_t ignore_index) {
  check(logits, target);
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto* t = target.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < v), "smoothed_nll: target ", t[i], " out of [0, ", v, ")");
  auto options = logits.options().dtype(at::kFloat);
  auto loss = at::empty({n}, options), lse = at::empty({n}, options);
  auto best = at::empty({n}, options.dtype(at::kLong));
  float *loss_out = loss.data_ptr<float>(), *lse_out = lse.data_ptr<float>();
  int64_t* best_out = best.data_ptr<int64_t>();
  const Smoothing w = smoothing(eps, v);
  dispatch(logits, [&](const auto* x) {
    at::parallel_for(0, n, kRowGrain, [&](int64_t first, int64_t end) {
      for (int64_t i = first; i < end; ++i) {
        const bool ignored = t[i] == ignore_index;
        forward_row(x + i * v, v, ignored ? 0 : t[i], ignored, w, loss_out + i, lse_out + i, best_out + i);
      }
    });
  });
  return {loss, lse, best};
}

// The logits' gradient, in their dtype, given the loss's (grad N, float32) and the forward's lse.
at::Tensor smoothed_nll_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                                 const at::Tensor& lse, double eps, int64_t ignore_index) {
  check(logits, target);
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.numel() == n &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == n,
              "smoothed_nll_backward: float32 grad and lse, one a row");
  auto out = at::empty_like(logits);
  const auto* t = target.data_ptr<int64_t>();
  const float *g = grad.data_ptr<float>(), *l = lse.data_ptr<float>();
  const Smoothing w = smoothing(eps, v);
  dispatch(logits, [&](const auto* x) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    S* result = reinterpret_cast<S*>(out.data_ptr());
    at::parallel_for(0, n, kRowGrain, [&](int64_t first, int64_t end) {
      for (int64_t i = first; i < end; ++i) {
        const bool ignored = t[i] == ignore_index;
        backward_row(x + i * v, result + i * v, v, ignored ? 0 : t[i], ignored, w, g[i], l[i]);
      }
    });
  });
  return out;
}
