// The decoder's layers over a block at batch 1 in one call (fairseq_bpd/static_pass.py).
//
// At batch 1 a block pass is some forty operations over three layers, and their products
// are a few microseconds each: from Python each operation pays as much again in dispatch
// and argument parsing. This is static_pass's loop on the same arranged weights
// (LeanWeights) and the same kernels, called from C++: each product few_rows.cpp's on the
// Product's packed copy (as Product runs it at a few rows), attention lean.cpp's attend,
// each residual sum and norm lean.cpp's residual_norm, a pre-norm layer's first norm
// torch's layer_norm; so the two are bit for bit the same function. Float32 on the CPU,
// relu feed-forwards, every layer with encoder attention, no attention weights asked for,
// at most COMPILED_MOST_ROWS rows: static_pass decides.
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "lean.h"

namespace {

struct Norm {  // a LayerNorm as torch.layer_norm reads it
  std::optional<at::Tensor> weight, bias;
  double eps = 1e-5;
};

struct Weights {  // a Product's packed copy (N/64 x C x 64 float32: product.blocked) and its N biases
  at::Tensor packed, bias;
  int64_t C = 0, N = 0;
};

struct Layer {
  bool pre = false;
  int64_t heads = 1;
  Weights qkv, out, query, source_out, fc1, fc2;
  Norm self_norm, cross_norm, final_norm;
};

// B*n x C rows as B x h x n x d (static_pass.split_heads): columns start.. of x's rows.
at::Tensor split_heads(const at::Tensor& x, int64_t n, int64_t heads, int64_t start, int64_t channels) {
  const int64_t step = x.stride(0), d = channels / heads;
  return x.as_strided({1, heads, n, d}, {n * step, d, step, 1}, x.storage_offset() + start);
}

// x (n x C, channels contiguous) · W + bias (relu) into out (n x N, channels contiguous).
void product_into(const at::Tensor& x, const Weights& w, at::Tensor& out, bool relu = false) {
  lean::float_rows(x.data_ptr<float>(), x.stride(0), x.size(0), w.packed.data_ptr<float>(), w.C, w.N,
                   w.bias.data_ptr<float>(), nullptr, 0, relu, out.data_ptr<float>(), out.stride(0));
}

at::Tensor product(const at::Tensor& x, const Weights& w, bool relu = false) {
  at::Tensor out = at::empty({x.size(0), w.N}, x.options());
  product_into(x, w, out, relu);
  return out;
}

}  // namespace

class BlockPass {
 public:
  // Per layer: products (qkv, out, query, source_out, fc1, fc2: each a Product's packed
  // copy and its bias: twelve tensors), norms (self, cross, final: weight, bias each: six,
  // None where none), eps (three), pre and heads.
  BlockPass(const std::vector<std::vector<at::Tensor>>& products,
            const std::vector<std::vector<std::optional<at::Tensor>>>& norms, const std::vector<std::vector<double>>& eps,
            const std::vector<bool>& pre, const std::vector<int64_t>& heads) {
    const size_t count = products.size();
    TORCH_CHECK(count > 0 && norms.size() == count && eps.size() == count && pre.size() == count &&
                    heads.size() == count,
                "BlockPass: products, norms, eps, pre and heads for each layer");
    for (size_t i = 0; i < count; ++i) {
      const auto& p = products[i];
      TORCH_CHECK(p.size() == 12 && norms[i].size() == 6 && eps[i].size() == 3,
                  "BlockPass: twelve product tensors, six norm tensors and three eps a layer");
      Layer w;
      w.pre = pre[i], w.heads = heads[i];
      Weights* targets[6] = {&w.qkv, &w.out, &w.query, &w.source_out, &w.fc1, &w.fc2};
      for (int j = 0; j < 6; ++j) {
        const at::Tensor &packed = p[2 * j], &bias = p[2 * j + 1];
        TORCH_CHECK(packed.dim() == 3, "BlockPass: product ", j, " is not a packed copy (N/64 x C x 64)");
        lean::check_packed_weights(packed, nullptr, &bias, packed.size(1), bias.numel(), "BlockPass");
        *targets[j] = Weights{packed, bias, packed.size(1), bias.numel()};
      }
      const int64_t C = w.qkv.C;
      TORCH_CHECK(w.qkv.N == 3 * C && w.heads > 0 && C % w.heads == 0, "BlockPass: qkv C x 3C, C a multiple of the heads");
      for (const Weights* t : {&w.out, &w.query, &w.source_out})
        TORCH_CHECK(t->C == C && t->N == C, "BlockPass: attention products C x C");
      TORCH_CHECK(w.fc1.C == C && w.fc2.C == w.fc1.N && w.fc2.N == C, "BlockPass: fc1 C x F, fc2 F x C");
      TORCH_CHECK(i == 0 || C == layers_[0].qkv.C, "BlockPass: every layer of one width");
      Norm* norm_targets[3] = {&w.self_norm, &w.cross_norm, &w.final_norm};
      for (int j = 0; j < 3; ++j) {
        Norm* target = norm_targets[j];
        target->weight = norms[i][2 * j], target->bias = norms[i][2 * j + 1], target->eps = eps[i][j];
        for (const auto* t : {&target->weight, &target->bias})
          TORCH_CHECK(!*t || ((*t)->numel() == C && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous()),
                      "BlockPass: layer norm weights and biases of C float32, contiguous");
      }
      layers_.push_back(std::move(w));
    }
  }

  // x: the block's n rows (n x C float32, contiguous); kv: the StaticCache's buffer (L x 1 x
  // T x 3C, each row's columns contiguous: a compacted cache is a slice of its rows), the block's queries, keys and values written at columns
  // longest..longest+n; mask: the block's self-attention mask over the first longest+n
  // columns (n x W additive, or 1 x 1 x n x W; None: every column seen); keys, values: each layer's source
  // keys and values (1 x h x S x d); source_mask: additive, broadcastable to 1 x h x n x S,
  // or None. Returns the last layer's output, n x C.
  at::Tensor run(const at::Tensor& input, at::Tensor& kv, int64_t longest, const std::optional<at::Tensor>& mask,
                 const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                 const std::optional<at::Tensor>& source_mask) {
    const int64_t L = static_cast<int64_t>(layers_.size()), C = layers_[0].qkv.C;
    TORCH_CHECK(input.dim() == 2 && input.size(1) == C && input.scalar_type() == at::kFloat && input.is_contiguous() &&
                    input.device().is_cpu() && input.size(0) > 0,
                "BlockPass.run: x n x C float32 on the CPU, contiguous");
    const int64_t n = input.size(0);
    TORCH_CHECK(kv.dim() == 4 && kv.size(0) == L && kv.size(1) == 1 && kv.size(3) == 3 * C && kv.stride(3) == 1 &&
                    kv.stride(2) == 3 * C &&
                    kv.scalar_type() == at::kFloat && kv.device().is_cpu() && longest >= 0 && n <= kv.size(2) &&
                    longest <= kv.size(2) - n,
                "BlockPass.run: a L x 1 x T x 3C float32 cache, columns contiguous, with room for the block");
    // n x W, or 1 x 1 x n x W (StaticCache.begin's where the batch's lengths once differed)
    const bool leading_ones = mask && mask->dim() >= 2 && mask->dim() <= 4 &&
                              std::all_of(mask->sizes().begin(), mask->sizes().end() - 2, [](int64_t s) { return s == 1; });
    TORCH_CHECK(!mask || (leading_ones && mask->size(-2) == n && mask->size(-1) == longest + n &&
                          mask->scalar_type() == at::kFloat && mask->device().is_cpu()),
                "BlockPass.run: a self-attention mask n x (longest + n), additive float32");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == L && static_cast<int64_t>(values.size()) == L,
                "BlockPass.run: the source's keys and values for each layer");
    at::Tensor x = input;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& w = layers_[i];
      // Self-attention: the block's queries, keys and values made in the cache, in place.
      at::Tensor y = w.pre ? layer_norm(x, w.self_norm) : x;
      at::Tensor columns = kv.select(0, i).select(0, 0);  // T x 3C
      at::Tensor qkv = columns.narrow(0, longest, n);
      product_into(y, w.qkv, qkv);
      const int64_t d = C / w.heads, width = longest + n, step = columns.stride(0);
      at::Tensor q = split_heads(qkv, n, w.heads, 0, C);
      at::Tensor k = columns.as_strided({1, w.heads, width, d}, {0, d, step, 1}, columns.storage_offset() + C);
      at::Tensor v = columns.as_strided({1, w.heads, width, d}, {0, d, step, 1}, columns.storage_offset() + 2 * C);
      y = product(attended(q, k, v, mask, n, C), w.out);
      std::tie(x, y) = residual(x, y, w.self_norm, &w.cross_norm, w.pre);
      // Encoder attention, then the feed-forward.
      q = split_heads(product(y, w.query), n, w.heads, 0, C);
      y = product(attended(q, keys[i], values[i], source_mask, n, C), w.source_out);
      std::tie(x, y) = residual(x, y, w.cross_norm, &w.final_norm, w.pre);
      y = product(product(y, w.fc1, true), w.fc2);
      std::tie(x, y) = residual(x, y, w.final_norm, nullptr, w.pre);
    }
    return x;
  }

 private:
  static at::Tensor layer_norm(const at::Tensor& x, const Norm& norm) {
    return at::layer_norm(x, {x.size(1)}, norm.weight, norm.bias, norm.eps);
  }

  // static_pass.attended: attention's output as n x C.
  static at::Tensor attended(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, int64_t n, int64_t C) {
    return attend(q, k, v, mask, 1.0).reshape({n, C});  // q is scaled (as fairseq scales it)
  }

  // static_pass.residual: the stream after a sublayer whose fresh output is y, and the next
  // sublayer's input.
  static std::pair<at::Tensor, at::Tensor> residual(const at::Tensor& x, at::Tensor& y, const Norm& norm,
                                                    const Norm* next, bool pre) {
    if (!pre) {
      auto out = residual_norm(x, y, norm.weight, norm.bias, norm.eps, false);
      return {out[0], out[0]};
    }
    if (next) {
      auto out = residual_norm(x, y, next->weight, next->bias, next->eps, true);
      return {out[0], out[1]};
    }
    return {x + y, at::Tensor()};
  }

  std::vector<Layer> layers_;
};

void bind_block_pass(pybind11::module& m) {
  pybind11::class_<BlockPass>(m, "BlockPass")
      .def(pybind11::init<const std::vector<std::vector<at::Tensor>>&,
                          const std::vector<std::vector<std::optional<at::Tensor>>>&,
                          const std::vector<std::vector<double>>&, const std::vector<bool>&,
                          const std::vector<int64_t>&>())
      .def("run", &BlockPass::run, "the decoder's layers over a block at batch 1");
}
