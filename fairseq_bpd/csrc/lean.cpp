// The lean pass's small operations, each one call instead of several of torch's.
//
// At batch 1 a decoder layer's products are a few microseconds each, and torch's fused
// attention, its layer norm and a residual add cost as much again in dispatch, thread
// hand-offs and allocation (fused attention for one query over a few dozen keys: ~15 µs
// for ~30 k multiply-adds). These loops do the same arithmetic on the CPU for float32 and
// float64, summing in their own order (float32 rounding differs from torch's, as any
// block pass's does; the tests check exactness in float64). fairseq_bpd/kernels.py builds
// and loads this file and says when it cannot.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// Work below this many multiply-adds stays on one thread: a thread hand-off costs more.
constexpr int64_t kGrainWork = 1 << 15;
// Attention of more query-key products than this (times d) goes to torch's fused kernel,
// whose blocked products outrun these loops there; below it these loops, on one thread,
// beat its dispatch and hand-offs. Likewise a residual norm of more elements than
// kLargestNorm goes to torch's add and layer norm.
constexpr int64_t kLargestAttention = 1 << 16;
constexpr int64_t kLargestNorm = 1 << 14;

// e^x for float32 in a form the compiler vectorises (std::exp is a call per value): Cephes'
// expf (range reduction by ln 2, a degree-6 polynomial; within 2 ulp of the true value), for
// x <= 0 (attention's scores less their maximum). Below -87 it gives ~1e-38, not 0: against
// a sum of at least 1 that changes nothing.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f;
  x = x + n * 2.12194440e-4f;
  const float y = (((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
                    1.6666665459e-1f) * x + 5.0000001201e-1f) * (x * x) + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}
inline double exp_nonpositive(double x) { return std::exp(x); }  // float64: the tests' dtype

template <typename T>
struct Strided4 {  // a 4-d tensor's data and strides (in elements)
  const T* data;
  int64_t s0, s1, s2, s3;
  explicit Strided4(const at::Tensor& t)
      : data(t.data_ptr<T>()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), s3(t.stride(3)) {}
  const T* at(int64_t a, int64_t b, int64_t c) const { return data + a * s0 + b * s1 + c * s2; }
};

// Softmax(scale · q · kᵀ + mask) · v for each query row.
// A row whose keys are all masked gets zeros, as torch's fused attention gives.
template <typename T, typename M>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& mask, double scale_by, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), d = q.size(3), keys = k.size(2);
  const Strided4<T> Q(q), K(k), V(v);
  const T factor = static_cast<T>(scale_by);
  const M* mask_data = nullptr;
  int64_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;
  if (mask) {
    mask_data = mask->data_ptr<M>();
    m0 = mask->stride(0), m1 = mask->stride(1), m2 = mask->stride(2), m3 = mask->stride(3);
  }
  T* o_data = out.data_ptr<T>();  // batch x n x heads x d, contiguous
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, keys * d));
  at::parallel_for(0, batch * heads * n, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> score(keys);
    std::vector<char> allowed(keys);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (heads * n), h = (i / n) % heads, r = i % n;
      const T* qi = Q.at(b, h, r);
      T* o = o_data + ((b * n + r) * heads + h) * d;
      T best = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < keys; ++j) {
        T bias = 0;
        if (mask_data) {
          const M m = mask_data[b * m0 + h * m1 + r * m2 + j * m3];
          if constexpr (std::is_same_v<M, bool>) {
            allowed[j] = m;
          } else {
            allowed[j] = m != -std::numeric_limits<M>::infinity();
            bias = static_cast<T>(m);
          }
        } else {
          allowed[j] = 1;
        }
        if (!allowed[j]) continue;
        const T* kj = K.at(b, h, j);
        T s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < d; ++c) s += qi[c] * kj[c];
        s = s * factor + bias;
        score[j] = s;
        best = std::max(best, s);
      }
      std::fill(o, o + d, T(0));
      if (best == -std::numeric_limits<T>::infinity()) continue;
      T total = 0;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < keys; ++j) {
        const T e = allowed[j] ? exp_nonpositive(score[j] - best) : T(0);
        score[j] = e;
        total += e;
      }
      const T scale = T(1) / total;
      for (int64_t j = 0; j < keys; ++j) {
        if (!allowed[j]) continue;
        const T p = score[j] * scale;
        const T* vj = V.at(b, h, j);
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) o[c] += p * vj[c];
      }
    }
  });
}

}  // namespace

// q: B x h x n x d; k, v: B x h x T x d (any strides, each vector contiguous); mask: None,
// additive (q's dtype, -inf: not allowed) or bool (True: allowed), broadcastable to
// B x h x n x T; scale: what q · kᵀ is multiplied by, None: 1/sqrt(d) (torch's default;
// fairseq's layers scale q themselves and pass 1). Returns B x n x h x d: the heads side by
// side per row, contiguous (so that B*n x C is a view for the output projection) unless
// torch's fused kernel made it (large blocks and batches) and laid it out otherwise.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: 4-d q, k, v");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attend: contiguous vectors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "attend: one dtype");
  const int64_t batch = q.size(0), heads = q.size(1), n = q.size(2), d = q.size(3), keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(1) == heads && k.size(3) == d && v.sizes() == k.sizes(),
              "attend: k and v must be B x h x T x d as q's");
  const double factor = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
  if (batch * heads * n * keys * d > kLargestAttention) {  // B x h x n x d, its rows laid out B x n x h x d
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, factor).transpose(1, 2);
  }
  auto out = at::empty({batch, n, heads, d}, q.options());
  std::optional<at::Tensor> expanded;
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == q.scalar_type(),
                "attend: a bool mask or an additive one of q's dtype");
    auto m = *mask;
    while (m.dim() < 4) m = m.unsqueeze(0);
    expanded = m.expand({batch, heads, n, keys});
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attend", [&] {
    if (expanded && expanded->scalar_type() == at::kBool) {
      attend_rows<scalar_t, bool>(q, k, v, expanded, factor, out);
    } else {
      attend_rows<scalar_t, scalar_t>(q, k, v, expanded, factor, out);
    }
  });
  return out;
}

namespace {

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

}  // namespace

// The residual stream after a sublayer: y (R x C, a sublayer's fresh output) becomes x + y
// in place; then the layer norm of it (weight, bias: C or None): into y itself where `pre`
// is false (a post-norm layer's stream is the normed sum), else into a new tensor (a
// pre-norm layer's stream is the sum; the norm feeds the next sublayer). Returns y, or
// (y, the norm).
std::vector<at::Tensor> residual_norm(const at::Tensor& x, at::Tensor& y, const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps, bool pre) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.sizes() == y.sizes(), "residual_norm: x and y R x C alike");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "residual_norm: contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "residual_norm: one dtype");
  const int64_t rows = x.size(0), c = x.size(1);
  if (rows * c > kLargestNorm) {
    y.add_(x);
    auto normed = at::layer_norm(y, {c}, weight, bias, eps);
    if (pre) return {y, normed};
    y.copy_(normed);
    return {y};
  }
  at::Tensor normed = pre ? at::empty({rows, c}, y.options()) : y;
  AT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "residual_norm", [&] {
    const scalar_t* w = weight ? weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b = bias ? bias->data_ptr<scalar_t>() : nullptr;
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* ys = y.data_ptr<scalar_t>();
    scalar_t* ns = normed.data_ptr<scalar_t>();
    const int64_t xr = x.stride(0), yr = y.stride(0), nr = normed.stride(0);
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainWork / (4 * c)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = ys + r * yr;
        const scalar_t* add = xs + r * xr;
        for (int64_t i = 0; i < c; ++i) row[i] += add[i];
        norm_row(row, ns + r * nr, w, b, c, eps);
      }
    });
  });
  if (pre) return {y, normed};
  return {y};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "softmax(q kᵀ + mask) v, B x n x h x d");
  m.def("residual_norm", &residual_norm, "y = x + y, then its layer norm");
}
