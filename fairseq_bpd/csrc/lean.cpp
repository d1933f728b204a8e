// The decoding loop's small operations, each one call instead of several of torch's.
//
// At batch 1 a decoder layer's products are a few microseconds each, and torch's fused
// attention, its layer norm and a residual add cost as much again in dispatch, thread
// hand-offs and allocation (fused attention for one query over a few dozen keys: ~8 µs for
// ~8 k multiply-adds); verifying a chain under greedy's rule is some twenty operations over
// b x n x V log-probs. These loops do the same arithmetic on the CPU, in float32 and float64.
// attend and residual_norm sum in their own order (float32 rounding differs from torch's,
// as any block pass's does; fairseq rounds a float64 model's attention softmax in float32,
// so the decoder's pass leaves float64 attention to torch's operations, which the tests'
// float64 exactness checks need); exact_chain makes fairseq's own float adds and
// comparisons, bit for bit. fairseq_bpd/kernels.py builds and loads this file and says when
// it cannot.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "lean.h"

namespace {

// Attention of more query-key products than this (times d) goes to torch's fused kernel,
// whose blocked products outrun these loops there; below it these loops beat its dispatch
// and hand-offs, their queries split between torch's threads once a thread's share holds
// kAttentionParallelWork query-key products (times d). A residual norm of more elements
// than kLargestNorm goes to torch's add and layer norm; below it, one loop on the calling
// thread.
constexpr int64_t kLargestAttention = 1 << 16;
constexpr int64_t kAttentionParallelWork = 1 << 14;
constexpr int64_t kLargestNorm = 1 << 14;

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
  // Each query's sums are made in the same order on whichever thread: the same output.
  const int64_t grain = std::max<int64_t>(1, kAttentionParallelWork / std::max<int64_t>(1, keys * d));
  at::parallel_for(0, batch * heads * n, grain, [&](int64_t first, int64_t end) {
    std::vector<T> score;
    std::vector<char> allowed;
    for (int64_t i = first; i < end; ++i) {
      const int64_t b = i / (heads * n), h = (i / n) % heads, r = i % n;
      auto seen = [&](int64_t j, T* bias) -> bool {
        if (!mask_data) return true;
        const M m = mask_data[b * m0 + h * m1 + r * m2 + j * m3];
        if constexpr (std::is_same_v<M, bool>) {
          return m;
        } else {
          *bias = static_cast<T>(m);
          return m != -std::numeric_limits<M>::infinity();
        }
      };
      lean::attend_query<T>(Q.at(b, h, r), d, keys, factor, seen, [&](int64_t j) { return K.at(b, h, j); },
                            [&](int64_t j) { return V.at(b, h, j); }, o_data + ((b * n + r) * heads + h) * d, score,
                            allowed);
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
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == q.scalar_type(),
                "attend: a bool mask or an additive one of q's dtype");
    TORCH_CHECK(mask->dim() >= 2 && mask->dim() <= 4, "attend: a mask of 2 to 4 dimensions");
  }
  const double factor = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
  if (batch * heads * n * keys * d > kLargestAttention) {  // B x h x n x d, its rows laid out B x n x h x d
    return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, factor).transpose(1, 2);
  }
  auto out = at::empty({batch, n, heads, d}, q.options());
  std::optional<at::Tensor> expanded;
  if (mask) {
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
  TORCH_CHECK(rows < 2 || y.stride(0) >= c, "residual_norm: y's rows must not overlap (it is written)");
  for (const auto* param : {&weight, &bias}) {
    TORCH_CHECK(!*param || ((*param)->numel() == c && (*param)->is_contiguous() &&
                            (*param)->scalar_type() == y.scalar_type()),
                "residual_norm: weight and bias of C values, contiguous, y's dtype");
  }
  if (rows == 0 || c == 0) {
    if (pre) return {y.add_(x), at::layer_norm(y, {c}, weight, bias, eps)};
    return {y};
  }
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
    for (int64_t r = 0; r < rows; ++r) {
      lean::residual_row(ys + r * yr, xs + r * xr, ns + r * nr, w, b, c, eps);
    }
  });
  if (pre) return {y, normed};
  return {y};
}

namespace {

// Row r's maximum of (lprob + running) over V values, the first index where it is, and
// whether it is in doubt: a NaN anywhere, or the maximum not the only one (all -inf included,
// as torch's reductions find them). The sums are the float adds fairseq makes.
template <typename T>
void row_best(const T* row, int64_t V, T running, T* value, int64_t* index, bool* doubt) {
  T best = -std::numeric_limits<T>::infinity();
  int nans = 0;
#pragma omp simd reduction(max : best) reduction(+ : nans)
  for (int64_t k = 0; k < V; ++k) {
    const T v = row[k] + running;
    nans += v != v;
    best = v > best ? v : best;
  }
  const bool nan = nans > 0;
  // The hits counted in vectorised chunks; the first one looked for only in its chunk.
  constexpr int64_t kChunk = 64;
  int64_t hits = 0, first = -1;
  for (int64_t start = 0; start < V; start += kChunk) {
    const int64_t end = std::min(V, start + kChunk);
    int found = 0;
#pragma omp simd reduction(+ : found)
    for (int64_t k = start; k < end; ++k) found += (row[k] + running) == best;
    if (found && first < 0) {
      first = start;
      while ((row[first] + running) != best) ++first;
    }
    hits += found;
  }
  *value = best;
  *index = first < 0 ? 0 : first;
  *doubt = nan || hits != 1;
}

}  // namespace

// Greedy's own rule on a chain, verify, accept and commit fused (acceptance.exact_chain
// computes the same with torch's operations, whose sums and comparisons these are, bit for
// bit): lprobs b x n x V (head 1's, after each block token), block b x n (the last token,
// then the proposals), score b (the running score), limit b or None (the most outputs a
// sentence may add), eos. Returns kept b, candidates b x n (head 1's choice after each
// block token), values b x n (its running score), added b, finished b, and doubt (0-dim
// bool: the maximum of a row whose choice is read was not its only one, or a score there
// was NaN; the choice is then not to be trusted, and the caller decides as torch's topk
// would).
std::vector<at::Tensor> exact_chain(const at::Tensor& lprobs, const at::Tensor& block, const at::Tensor& score,
                                    const std::optional<at::Tensor>& limit, int64_t eos) {
  TORCH_CHECK(lprobs.dim() == 3 && lprobs.stride(2) == 1, "exact_chain: lprobs b x n x V, rows contiguous");
  TORCH_CHECK(block.dim() == 2 && block.scalar_type() == at::kLong, "exact_chain: block b x n, long");
  const int64_t b = lprobs.size(0), n = lprobs.size(1), V = lprobs.size(2);
  TORCH_CHECK(block.size(0) == b && block.size(1) == n && n >= 1, "exact_chain: a b x n block, n >= 1");
  TORCH_CHECK(score.dim() == 1 && score.size(0) == b, "exact_chain: b running scores");
  TORCH_CHECK(!limit || (limit->dim() == 1 && limit->size(0) == b), "exact_chain: b limits");
  auto block_c = block.contiguous();
  auto running_in = score.to(lprobs.scalar_type()).contiguous();
  auto long_opts = block.options();
  auto candidates = at::empty({b, n}, long_opts);
  auto values = at::empty({b, n}, lprobs.options());
  auto kept = at::empty({b}, long_opts), added = at::empty({b}, long_opts);
  auto finished = at::empty({b}, block.options().dtype(at::kBool));
  std::vector<char> doubts(b * n, 0);
  bool any_doubt = false;
  std::optional<at::Tensor> limits;
  if (limit) limits = limit->to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES(lprobs.scalar_type(), "exact_chain", [&] {
    const scalar_t* lp = lprobs.data_ptr<scalar_t>();
    const int64_t s0 = lprobs.stride(0), s1 = lprobs.stride(1);
    const int64_t* tokens = block_c.data_ptr<int64_t>();
    const scalar_t* score_in = running_in.data_ptr<scalar_t>();
    int64_t* cand = candidates.data_ptr<int64_t>();
    scalar_t* vals = values.data_ptr<scalar_t>();
    // The running score before each block token, in fairseq's order: one add a node.
    std::vector<scalar_t> running(b * n);
    for (int64_t i = 0; i < b; ++i) {
      running[i * n] = score_in[i];
      for (int64_t j = 1; j < n; ++j)
        TORCH_CHECK(tokens[i * n + j] >= 0 && tokens[i * n + j] < V, "exact_chain: a proposal outside the vocabulary");
      for (int64_t j = 1; j < n; ++j)
        running[i * n + j] = running[i * n + j - 1] + lp[i * s0 + (j - 1) * s1 + tokens[i * n + j]];
    }
    for (int64_t r = 0; r < b * n; ++r) {
      const int64_t i = r / n, j = r % n;
      bool doubt = false;
      row_best(lp + i * s0 + j * s1, V, running[r], vals + r, cand + r, &doubt);
      doubts[r] = doubt;
    }
    const int64_t* lim = limits ? limits->data_ptr<int64_t>() : nullptr;
    for (int64_t i = 0; i < b; ++i) {
      int64_t k = 1;  // the last token, then each proposal that is head 1's choice with a finite score
      while (k < n && cand[i * n + k - 1] == tokens[i * n + k] &&
             vals[i * n + k - 1] > -std::numeric_limits<scalar_t>::infinity())
        ++k;
      if (lim) k = std::min(k, lim[i]);
      // Only the kept rows' choices are read (the outputs, up to head 1's choice after the last
      // kept token): a doubt past them (a row all -inf after a forbidden proposal) is no one's.
      for (int64_t j = 0; j < k; ++j) any_doubt = any_doubt || doubts[i * n + j];
      int64_t before_eos = 0;
      while (before_eos < n && cand[i * n + before_eos] != eos) ++before_eos;
      kept.data_ptr<int64_t>()[i] = k;
      added.data_ptr<int64_t>()[i] = std::min(k, before_eos + 1);
      finished.data_ptr<bool>()[i] = before_eos < k;
    }
  });
  return {kept, candidates, values, added, finished, at::scalar_tensor(any_doubt, block.options().dtype(at::kBool))};
}

// few_rows.cpp
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add, bool relu,
                        std::optional<at::Tensor> out);
at::Tensor float_product(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& add, bool relu,
                         std::optional<at::Tensor> out);

// dropout.cpp
at::Tensor hash_dropout(const at::Tensor& x, double p, int64_t seed);

// smoothed_loss.cpp
std::vector<at::Tensor> smoothed_nll_forward(const at::Tensor& logits, const at::Tensor& target, double eps,
                                             int64_t ignore_index);
at::Tensor smoothed_nll_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                                 const at::Tensor& lse, double eps, int64_t ignore_index);

// draft_step.cpp, block_pass.cpp
void bind_draft_layer(pybind11::module& m);
void bind_block_pass(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact_chain", &exact_chain, "greedy's rule on a chain: verify, accept and commit fused");
  m.def("attend", &attend, "softmax(q kᵀ + mask) v, B x n x h x d");
  m.def("residual_norm", &residual_norm, "y = x + y, then its layer norm");
  m.def("int8_channel_group", &lean::int8_channel_group, "how the int8 products' packed weights group channels");
  m.def("int8_product", &int8_product, "x · Wᵀ · scales (+ bias) (+ add) (relu) on packed int8 weights",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias") = py::none(), py::arg("add") = py::none(),
        py::arg("relu") = false, py::arg("out") = py::none());
  m.def("float_product", &float_product, "x · W (+ bias) (+ add) (relu) on packed float32 weights", py::arg("x"),
        py::arg("packed"), py::arg("outputs"), py::arg("bias") = py::none(), py::arg("add") = py::none(),
        py::arg("relu") = false, py::arg("out") = py::none());
  m.def("hash_dropout", &hash_dropout, "dropout whose mask hashes each element's index with a seed");
  m.def("smoothed_nll_forward", &smoothed_nll_forward, "label-smoothed nll of logit rows: loss, lse, best token");
  m.def("smoothed_nll_backward", &smoothed_nll_backward, "the logits' gradient of smoothed_nll_forward's loss");
  bind_draft_layer(m);
  bind_block_pass(m);
}
