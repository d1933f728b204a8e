// The draft decoder's step at batch 1 in one call (fairseq_bpd/draft_step.py, decode_step).
//
// A chain's draft step at batch 1 is one row through a whole pre-norm layer: eight
// products, two attentions, four layer norms. Its products on int8 weights take ~60 µs in
// all here; run as torch's operations from Python the step takes three times that, its
// thirty-odd operations each paying dispatch and an allocation. This is the function of
// draft_step.py's decode_step on the same arranged weights (DraftWeights, all products on
// int8: Int8Product), one call: the entries' table rows and features product, their
// queries, keys and values written in the cache, and the last entry's layer. One difference:
// a first step's entries run on the int8 weights however many they are, where the Python
// step runs more than four rows on float32 products (there the faster ones); either
// rounding only changes proposals, which head 1 verifies.
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "lean.h"

namespace {

struct Int8Weights {  // product.Int8Product's packed copy, as int8_product takes it
  at::Tensor packed, scales, bias;  // bias: undefined where none
  int64_t C = 0, N = 0;

  void apply(const float* x, int64_t x_stride, int64_t M, const float* add, int64_t add_stride, bool relu,
             float* out, int64_t out_stride) const {
    lean::int8_rows(x, x_stride, M, packed.data_ptr<int8_t>(), C, N, scales.data_ptr<float>(),
                    bias.defined() ? bias.data_ptr<float>() : nullptr, add, add_stride, relu, out, out_stride);
  }
};

// One query row (heads side by side, H x d) over `count` positions: keys and values at
// key + j * position_stride + h * head_stride (d contiguous), an additive mask per position
// (-inf: not seen, and not read; null: none) -> out H x d. Scaled by 1/sqrt(d), as the
// draft's layer (torch's scaled_dot_product_attention's default).
void attend_one(const float* q, const float* keys, const float* values, int64_t position_stride,
                int64_t head_stride, int64_t count, const float* mask, int64_t heads, int64_t d, float* out,
                std::vector<float>& score, std::vector<char>& allowed) {
  const float factor = 1.0f / std::sqrt(static_cast<float>(d));
  auto seen = [&](int64_t j, float* bias) -> bool {
    if (!mask) return true;
    *bias = mask[j];
    return mask[j] != -std::numeric_limits<float>::infinity();
  };
  for (int64_t h = 0; h < heads; ++h) {
    const float* k = keys + h * head_stride;
    const float* v = values + h * head_stride;
    lean::attend_query<float>(q + h * d, d, count, factor, seen, [&](int64_t j) { return k + j * position_stride; },
                              [&](int64_t j) { return v + j * position_stride; }, out + h * d, score, allowed);
  }
}

}  // namespace

// DraftWeights' products, in the order of draft_step.DraftLayer: features_in (C x C, no bias:
// the table's row is added), qkv (C x 3C), self_out, source_query, source_out (C x C), ffn1
// (C x F, relu), ffn2 (F x C), fc_out (C x C: the features are added).
class DraftLayer {
 public:
  DraftLayer(at::Tensor table, const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& scales,
             const std::vector<at::Tensor>& biases, int64_t heads, std::vector<double> eps)
      : table_(table.contiguous()), heads_(heads), eps_(std::move(eps)) {
    TORCH_CHECK(packed.size() == 8 && scales.size() == 8 && biases.size() == 8, "DraftLayer: eight products");
    TORCH_CHECK(eps_.size() == 4, "DraftLayer: four layer norms' eps");
    TORCH_CHECK(table_.dim() == 2 && table_.scalar_type() == at::kFloat, "DraftLayer: a V x C float32 table");
    for (size_t i = 0; i < 8; ++i) {
      Int8Weights w;
      w.packed = packed[i], w.scales = scales[i];
      if (biases[i].numel() > 0) w.bias = biases[i];
      TORCH_CHECK(w.packed.dim() == 3, "DraftLayer: product ", i, " is not an Int8Product's packed copy");
      w.C = packed[i].size(1), w.N = scales[i].numel();
      lean::check_int8_weights(w.packed, w.scales, w.bias.defined() ? &w.bias : nullptr, w.C, "DraftLayer");
      products_.push_back(w);
    }
    const int64_t C = table_.size(1);
    const int64_t expected[8][2] = {{C, C}, {C, 3 * C}, {C, C}, {C, C}, {C, C}, {C, -1}, {-1, C}, {C, C}};
    for (int i = 0; i < 8; ++i)
      TORCH_CHECK((expected[i][0] < 0 || products_[i].C == expected[i][0]) &&
                      (expected[i][1] < 0 || products_[i].N == expected[i][1]),
                  "DraftLayer: product ", i, " has the wrong shape");
    TORCH_CHECK(products_[5].N == products_[6].C, "DraftLayer: the feed-forward's hidden widths differ");
    TORCH_CHECK(heads_ > 0 && C % heads_ == 0, "DraftLayer: C a multiple of the heads");
  }

  // Entries m (features m x C float32, tokens m) in columns start.. of the cache (1 x L x 3C,
  // contiguous: their queries, keys and values written there); the last entry's layer, over
  // the cache's columns up to its own and the source (keys, values 1 x H x S x d; mask:
  // additive, 1 x 1 x 1 x S, or None) -> its drafted features 1 x C.
  at::Tensor step(const at::Tensor& features, const at::Tensor& tokens, at::Tensor& cache, int64_t start,
                  const at::Tensor& source_keys, const at::Tensor& source_values,
                  const std::optional<at::Tensor>& source_mask) {
    const int64_t C = table_.size(1), m = features.size(0);
    check(features, tokens, cache, start, source_keys, source_values, source_mask, m);
    const at::Tensor mask = source_mask ? source_mask->contiguous() : at::Tensor();  // kept while read
    at::Tensor drafted = at::empty({1, C}, features.options());
    run(features.data_ptr<float>(), features.stride(0), tokens.data_ptr<int64_t>(), m, cache.data_ptr<float>(), start,
        source_keys, source_values, mask, drafted.data_ptr<float>());
    return drafted;
  }

  // A chain's proposals at batch 1: step() of the entries, then `count` times the drafted
  // features' best token on the proposal projection (an Int8Product's packed copy, its
  // scales and bias or None: torch.argmax's choice) and, but after the last, the
  // step of that features and token in the next column. Returns the first step's drafted
  // features (1 x C) and the count tokens (long). What the Python loop computes from
  // step() and the projection, in one call. extra_packed, extra_scales and extra_ids
  // (a ProposalVocabulary's extras: an Int8Product over their columns and their token ids,
  // increasing, all past the projection's N): their logits follow the N (token ids[j - N]
  // for column j), as the Python loop concatenates them.
  std::vector<at::Tensor> chain(const at::Tensor& features, const at::Tensor& tokens, at::Tensor& cache, int64_t start,
                                const at::Tensor& source_keys, const at::Tensor& source_values,
                                const std::optional<at::Tensor>& source_mask, const at::Tensor& packed,
                                const at::Tensor& scales, const std::optional<at::Tensor>& bias, int64_t count,
                                const std::optional<at::Tensor>& extra_packed,
                                const std::optional<at::Tensor>& extra_scales,
                                const std::optional<at::Tensor>& extra_ids) {
    const int64_t C = table_.size(1), m = features.size(0);
    TORCH_CHECK(count >= 1, "DraftLayer.chain: at least one proposal");
    check(features, tokens, cache, start, source_keys, source_values, source_mask, m + count - 1);
    lean::check_int8_weights(packed, scales, bias ? &*bias : nullptr, C, "DraftLayer.chain");
    const int64_t N = scales.numel();
    TORCH_CHECK(N > 0 && N <= table_.size(0), "DraftLayer.chain: a projection onto at most the vocabulary");
    int64_t E = 0;
    const int64_t* ids = nullptr;
    TORCH_CHECK(extra_packed.has_value() == extra_scales.has_value() && extra_packed.has_value() == extra_ids.has_value(),
                "DraftLayer.chain: the extras' packed weights, scales and ids together");
    if (extra_packed) {
      lean::check_int8_weights(*extra_packed, *extra_scales, nullptr, C, "DraftLayer.chain (extras)");
      E = extra_scales->numel();
      TORCH_CHECK(extra_ids->dtype() == at::kLong && extra_ids->dim() == 1 && extra_ids->numel() == E &&
                      extra_ids->is_contiguous(),
                  "DraftLayer.chain: one contiguous long id per extra column");
      ids = extra_ids->data_ptr<int64_t>();
      for (int64_t j = 0; j < E; ++j)
        TORCH_CHECK(ids[j] >= N && ids[j] < table_.size(0) && (j == 0 || ids[j] > ids[j - 1]),
                    "DraftLayer.chain: extra ids increasing, past the projection's and within the vocabulary");
    }
    const at::Tensor mask = source_mask ? source_mask->contiguous() : at::Tensor();  // kept while read
    at::Tensor root = at::empty({1, C}, features.options());
    at::Tensor proposals = at::empty({count}, tokens.options());
    int64_t* chosen = proposals.data_ptr<int64_t>();
    float* spare[2] = {buffer(5, C).data(), buffer(7, C).data()};  // each later step's drafted features, in turn
    std::vector<float>& logits = buffer(6, N + E);
    float* cache_data = cache.data_ptr<float>();
    run(features.data_ptr<float>(), features.stride(0), tokens.data_ptr<int64_t>(), m, cache_data, start, source_keys,
        source_values, mask, root.data_ptr<float>());
    const float* current = root.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      lean::int8_rows(current, C, 1, packed.data_ptr<int8_t>(), C, N, scales.data_ptr<float>(),
                      bias ? bias->data_ptr<float>() : nullptr, nullptr, 0, false, logits.data(), N);
      if (E) {
        lean::int8_rows(current, C, 1, extra_packed->data_ptr<int8_t>(), C, E, extra_scales->data_ptr<float>(),
                        nullptr, nullptr, 0, false, logits.data() + N, E);
      }
      chosen[i] = best(logits);
      if (chosen[i] >= N) chosen[i] = ids[chosen[i] - N];
      if (i + 1 == count) break;
      run(current, C, chosen + i, 1, cache_data, start + m + i, source_keys, source_values, mask, spare[i % 2]);
      current = spare[i % 2];
    }
    return {root, proposals};
  }

 private:
  // torch.argmax's choice: the first NaN where there is one, else the first of the largest.
  static int64_t best(const std::vector<float>& logits) {
    int64_t chosen = 0;
    for (int64_t j = 0; j < static_cast<int64_t>(logits.size()); ++j) {
      if (std::isnan(logits[j])) return j;
      if (logits[j] > logits[chosen]) chosen = j;
    }
    return chosen;
  }

  // Refuses what step and chain would misread: `columns` entries written from column start.
  void check(const at::Tensor& features, const at::Tensor& tokens, const at::Tensor& cache, int64_t start,
             const at::Tensor& source_keys, const at::Tensor& source_values,
             const std::optional<at::Tensor>& source_mask, int64_t columns) const {
    const int64_t C = table_.size(1), m = features.size(0), H = heads_, d = C / H;
    TORCH_CHECK(features.dim() == 2 && features.size(1) == C && features.scalar_type() == at::kFloat &&
                    features.stride(1) == 1 && m >= 1,
                "DraftLayer.step: features m x C float32, channels contiguous");
    TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == m && tokens.scalar_type() == at::kLong &&
                    tokens.is_contiguous(),
                "DraftLayer.step: m long tokens, contiguous");
    const std::initializer_list<const at::Tensor*> inputs{&features, &tokens, &cache, &source_keys, &source_values};
    for (const at::Tensor* t : inputs)
      TORCH_CHECK(t->device().is_cpu(), "DraftLayer.step: tensors on the CPU");
    TORCH_CHECK(cache.dim() == 3 && cache.size(0) == 1 && cache.size(2) == 3 * C && cache.is_contiguous() &&
                    cache.scalar_type() == at::kFloat && start >= 0 && columns <= cache.size(1) &&
                    start <= cache.size(1) - columns,  // not start + columns: it could overflow
                "DraftLayer.step: a 1 x L x 3C float32 cache with room for the entries");
    TORCH_CHECK(source_keys.dim() == 4 && source_keys.size(0) == 1 && source_keys.size(1) == H &&
                    source_keys.size(3) == d && source_keys.stride(3) == 1 &&
                    source_values.sizes() == source_keys.sizes() && source_values.strides() == source_keys.strides() &&
                    source_keys.scalar_type() == at::kFloat && source_values.scalar_type() == at::kFloat,
                "DraftLayer.step: source keys and values 1 x H x S x d float32, alike");
    TORCH_CHECK(!source_mask || (source_mask->numel() == source_keys.size(2) &&
                                 source_mask->scalar_type() == at::kFloat && source_mask->device().is_cpu()),
                "DraftLayer.step: an additive float32 source mask of S");
    const int64_t* ids = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r)
      TORCH_CHECK(ids[r] >= 0 && ids[r] < table_.size(0), "DraftLayer.step: a token outside the vocabulary");
  }

  // The step itself, on checked arguments: entries (features at a row stride, ids) written
  // at columns start.. of the cache, the last one's drafted features into out (C).
  void run(const float* features, int64_t feature_stride, const int64_t* ids, int64_t m, float* columns,
           int64_t start, const at::Tensor& source_keys, const at::Tensor& source_values, const at::Tensor& mask,
           float* drafted) {
    const int64_t C = table_.size(1), H = heads_, d = C / H, S = source_keys.size(2);
    const float* table = table_.data_ptr<float>();
    // The entries: z = f · W_fᵀ + table[x], their norms, their q, k and v in the cache.
    std::vector<float>& z = buffer(0, m * C);
    std::vector<float>& normed = buffer(1, m * C);
    for (int64_t r = 0; r < m; ++r) std::copy(table + ids[r] * C, table + (ids[r] + 1) * C, z.data() + r * C);
    products_[0].apply(features, feature_stride, m, z.data(), C, false, z.data(), C);
    for (int64_t r = 0; r < m; ++r)
      lean::norm_row<float>(z.data() + r * C, normed.data() + r * C, nullptr, nullptr, C, eps_[0]);
    products_[1].apply(normed.data(), C, m, nullptr, 0, false, columns + start * 3 * C, 3 * C);
    // The last entry's layer.
    float* zl = z.data() + (m - 1) * C;
    float* nl = normed.data();
    std::vector<float>& y = buffer(2, C);
    std::vector<float>& out = buffer(3, C);
    std::vector<float>& hidden = buffer(4, products_[5].N);
    const float* q = columns + (start + m - 1) * 3 * C;
    attend_one(q, columns + C, columns + 2 * C, 3 * C, d, start + m, nullptr, H, d, y.data(), score_, allowed_);
    products_[2].apply(y.data(), C, 1, nullptr, 0, false, out.data(), C);
    lean::residual_row<float>(zl, out.data(), nl, nullptr, nullptr, C, eps_[1]);
    products_[3].apply(nl, C, 1, nullptr, 0, false, out.data(), C);
    attend_one(out.data(), source_keys.data_ptr<float>(), source_values.data_ptr<float>(), source_keys.stride(2),
               source_keys.stride(1), S, mask.defined() ? mask.data_ptr<float>() : nullptr, H, d, y.data(), score_,
               allowed_);
    products_[4].apply(y.data(), C, 1, nullptr, 0, false, out.data(), C);
    lean::residual_row<float>(zl, out.data(), nl, nullptr, nullptr, C, eps_[2]);
    products_[5].apply(nl, C, 1, nullptr, 0, true, hidden.data(), products_[5].N);
    products_[6].apply(hidden.data(), products_[5].N, 1, nullptr, 0, false, out.data(), C);
    lean::residual_row<float>(zl, out.data(), nl, nullptr, nullptr, C, eps_[3]);
    const float* last = features + (m - 1) * feature_stride;
    products_[7].apply(nl, C, 1, last, C, false, drafted, C);
  }

  std::vector<float>& buffer(int i, int64_t size) {
    buffers_[i].resize(size);
    return buffers_[i];
  }

  at::Tensor table_;
  std::vector<Int8Weights> products_;
  int64_t heads_;
  std::vector<double> eps_;
  std::vector<float> buffers_[8], score_;
  std::vector<char> allowed_;
};

void bind_draft_layer(pybind11::module& m) {
  pybind11::class_<DraftLayer>(m, "DraftLayer")
      .def(pybind11::init<at::Tensor, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, int64_t, std::vector<double>>())
      .def("step", &DraftLayer::step, "a batch-1 draft step: entries in the cache, the last one's layer")
      .def("chain", &DraftLayer::chain, "a batch-1 chain's proposals: steps and their best tokens",
           py::arg("features"), py::arg("tokens"), py::arg("cache"), py::arg("start"), py::arg("source_keys"),
           py::arg("source_values"), py::arg("source_mask"), py::arg("packed"), py::arg("scales"), py::arg("bias"),
           py::arg("count"), py::arg("extra_packed") = py::none(), py::arg("extra_scales") = py::none(),
           py::arg("extra_ids") = py::none());
}
