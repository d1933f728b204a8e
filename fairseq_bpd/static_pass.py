"""The decoder layers over a static cache (cache.StaticCache): the lean path's block pass.

Taken when block_layer understands every decoder layer (decoder.cache decides), so it
computes the same function as block_layer and fairseq's layers, in fewer operations:
per layer one product gives the block's queries, keys and values (the three
projections' weights side by side, transposed once, the query's scaling folded in),
made in the cache's own buffer (StaticCache.write), and the rows stay batch first
throughout, so no reshape between layers copies; where fc1's product runs packed (float32
on a CPU, where the packed copy was timed faster), a relu after it runs inside it
(Product.relu), bit for bit the separate operation, one fewer a layer. The weights are arranged once per decoding
(LeanWeights), not per invocation. The source's keys and values are computed on the
first call and kept by the cache. Attention over a block's few queries (float32) and each residual
add with its layer norm are one call each to the compiled kernels (fairseq_bpd/kernels.py)
where they are built; torch's operations otherwise. It rounds differently from fairseq's step, as any
block pass does, which is why exactness is tested in float64. At batch 1 in float32 the
whole loop is one call of the compiled kernels (BlockPass, csrc/block_pass.cpp: the same
weights, kernels and order, bit for bit this loop's function), where some forty Python
operations would each pay their dispatch (compiled).

A CUDA graph could replay this pass from the same cache: for a batch of B rows and a
block of n, everything between begin's outputs (the rows x, the self-attention mask and
the write index) and the features has fixed shapes once the cache is allocated for the
whole output (StaticCache(columns=...)) and attention reads all of its columns under
the mask (B x 1 x n x T, where begin slices to max(lengths) + n today); a graph per
(B, n) would capture the layers, the projection and log-softmax. The host round trips
(crop's lengths, the generator's checks) stay outside it.
"""
import torch
import torch.nn.functional as F

from . import kernels
from .block_layer import attend
from . import product as product_module
from .product import Product


def transposed(*linears, scale=None):
    """The linears' weights side by side, transposed and contiguous (C x sum of outputs), and
    their biases (zeros where none), as a Product; `scale` multiplies the first one's, as
    fairseq scales q."""
    weights, biases = [], []
    for i, module in enumerate(linears):
        factor = scale if scale is not None and i == 0 else 1.0
        weights.append(module.weight.detach() * factor)
        bias = module.bias.detach() if module.bias is not None else module.weight.new_zeros(module.out_features)
        biases.append(bias * factor)
    return Product(torch.cat(weights).t().contiguous(), torch.cat(biases).contiguous())


def norm_params(module):
    """What torch.layer_norm reads of a LayerNorm, as plain values: reading a module's
    parameters goes through nn.Module.__getattr__, a Python search paid on every read."""
    return module.normalized_shape, module.weight, module.bias, module.eps


def activation(function):
    """torch's own relu where fairseq's activation is F.relu (its Python wrapper checks
    for overrides on every call); any other activation as it is."""
    return torch.relu if function is F.relu else function


class LeanWeights:
    """What the lean pass reads of each layer, arranged once: products as x · Wᵀ (product.Product:
    a weight packed once; nn.Linear's x · Wᵀ on the out x C weight re-packs it per call),
    layer norms as their plain parameters (norm_params)."""

    def __init__(self, layers):
        self.layers = [self.arrange(layer) for layer in layers]
        self.compiled = None  # block_pass's, made on first use

    def __getstate__(self):  # copies and pickles make their own compiled pass (a C++ object)
        return {**self.__dict__, "compiled": None}

    def block_pass(self, kern):
        """The compiled kernels' batch-1 pass (csrc/block_pass.cpp) on these weights, or
        False where it does not apply: a layer without encoder attention or with a
        feed-forward other than relu, weights not float32 or not on the CPU."""
        if self.compiled is None:
            self.compiled = compiled_block_pass(kern, self.layers)
        return self.compiled

    @staticmethod
    def arrange(layer):
        cross = layer.encoder_attn
        w = {**self_attention_and_feed_forward(layer), "cross": None}
        if cross is not None:
            w.update(cross={"heads": cross.num_heads, "q": transposed(cross.q_proj, scale=cross.scaling),
                            "kv": transposed(cross.k_proj, cross.v_proj), "out": transposed(cross.out_proj)},
                     cross_norm=norm_params(layer.encoder_attn_layer_norm))
        return w


def self_attention_and_feed_forward(layer):
    """What a lean pass reads of a fairseq layer's self-attention and feed-forward (encoder's
    or decoder's): the queries', keys' and values' products side by side (the query scaled,
    as fairseq scales it), the output and feed-forward products, the two layer norms."""
    attention = layer.self_attn
    return {
        "pre": layer.normalize_before, "heads": attention.num_heads,
        "activation": activation(layer.activation_fn),
        "qkv": transposed(attention.q_proj, attention.k_proj, attention.v_proj, scale=attention.scaling),
        "out": transposed(attention.out_proj), "self_norm": norm_params(layer.self_attn_layer_norm),
        "fc1": transposed(layer.fc1), "fc2": transposed(layer.fc2),
        "final_norm": norm_params(layer.final_layer_norm),
    }


def compiled_block_pass(kern, layers):
    """kern.BlockPass on the arranged layers (LeanWeights.block_pass), or False."""
    products = [(w["qkv"], w["out"], w["cross"] and w["cross"]["q"], w["cross"] and w["cross"]["out"], w["fc1"],
                 w["fc2"]) for w in layers]
    if any(w["cross"] is None or w["activation"] is not torch.relu for w in layers) or any(
            p[0].dtype != torch.float32 or p[0].device.type != "cpu" for layer in products for p in layer):
        return False
    norms = [(w["self_norm"], w["cross_norm"], w["final_norm"]) for w in layers]
    return kern.BlockPass([[t for p in layer for t in (p.blocks(), p[1])] for layer in products],
                          [[t for n in layer for t in n[1:3]] for layer in norms],
                          [[n[3] for n in layer] for layer in norms],
                          [w["pre"] for w in layers], [w["heads"] for w in layers])


def product(x, weights):
    return weights(x)


def normed(params, x):
    """The layer norm whose norm_params these are: x ... x C -> ... x C."""
    return torch.layer_norm(x, *params)


def split_heads(x, rows, n, heads, start=0, channels=None):
    """Columns start..start+C of x (B*n x W, columns contiguous, rows at any one stride) as
    B x h x n x d: one strided view (a slice, view and transpose would be three operations,
    each paid per layer)."""
    step = x.stride(0)
    channels = channels or x.size(1)
    return x.as_strided((rows, heads, n, channels // heads), (n * step, channels // heads, step, 1),
                        x.storage_offset() + start)


def merge_heads(out, rows, n):
    """Attention's output B x h x n x d -> B*n x C: a view where its heads already lie side
    by side per row (a single token; fused attention's own layout), else a copy."""
    b, h, _, d = out.shape
    if n == 1 or (out.stride(1) == d and out.stride(2) == h * d and out.stride(3) == 1):
        return out.as_strided((rows * n, h * d), (h * d, 1), out.storage_offset())
    return out.transpose(1, 2).reshape(rows * n, h * d)


def static_pass(lean, cache, x, encoder_out, padding_mask, block_mask, alignment_layer):
    """The layers over a block: x b x n x C (batch first) -> b x n x C, and the alignment
    layer's encoder attention averaged over heads, b x n x S (or None).

    lean: LeanWeights; cache: the StaticCache; encoder_out: S x b x C (read on the first
    call only: the cache keeps its keys); padding_mask: b x S or None; block_mask: n x n
    additive (the chain's causal mask or a tree's).
    """
    x, mask = cache.begin(x, block_mask)
    rows, n, channels = x.shape
    x = x.view(rows * n, channels)
    kern = kernels.serve(x)
    if (rows == 1 and cache.equal and n <= product_module.COMPILED_MOST_ROWS and kern is not None and x.dtype == torch.float32
            and alignment_layer is None and encoder_out is not None and lean.block_pass(kern)):
        return compiled(lean, cache, x, encoder_out, padding_mask, mask).view(rows, n, channels), None
    attn = None
    for i, w in enumerate(lean.layers):
        pre, heads = w["pre"], w["heads"]
        cross = w["cross"] if encoder_out is not None else None
        # Self-attention: the block's keys and values go into the cache, in place.
        y = normed(w["self_norm"], x) if pre else x
        qkv, k, v = cache.write(i, y, w["qkv"], heads)  # B*n x 3C, made in the cache
        q = split_heads(qkv, rows, n, heads, 0, channels)  # B x h x n x d
        y = product(attended(kern, q, k, v, mask, rows, n), w["out"])
        x, y = residual(kern, x, y, w["self_norm"], (w["cross_norm"] if cross is not None else w["final_norm"]), pre)
        if cross is not None:
            y, layer_attn = cross_attention(cross, cache, i, y, rows, n, encoder_out, padding_mask,
                                            i == alignment_layer, kern)
            x, y = residual(kern, x, y, w["cross_norm"], w["final_norm"], pre)
            if layer_attn is not None:
                attn = layer_attn
        y = product(feed_forward_hidden(w, y), w["fc2"])
        x, _ = residual(kern, x, y, w["final_norm"], None, pre)
    x = x.view(rows, n, channels)
    if cache.rows is not None:  # the finished rows' outputs are no one's
        x = x.index_select(0, cache.rows)
        attn = attn.index_select(0, cache.rows) if attn is not None else None
    return x, attn


def compiled(lean, cache, x, encoder_out, padding_mask, mask):
    """The layers over a block at batch 1 in one call (csrc/block_pass.cpp): x n x C -> n x C;
    the source's keys and values made first where the cache has none yet."""
    sources = cache.source_lists()
    if sources is None:
        for i, w in enumerate(lean.layers):
            source_keys_values(w["cross"], cache, i, encoder_out, padding_mask)
        sources = cache.source_lists()
    return lean.compiled.run(x, cache.kv, cache.longest, mask, *sources, cache.source_mask)


def attended(kern, q, k, v, mask, rows, n):
    """Attention's output as B*n x C (q B x h x n x d, k and v B x h x T x d, mask additive
    broadcastable to B x h x n x T, or None): the compiled kernel's in float32 (its output
    is B x n x h x d, so this is a view), else block_layer.attend's (float64: fairseq's
    softmax in float32, which the float64 exactness checks need to round alike)."""
    if kern is not None and q.dtype == torch.float32:
        return kern.attend(q, k, v, mask, 1.0).reshape(rows * n, -1)  # q is scaled (as fairseq scales it)
    return merge_heads(attend(q, k, v, mask)[0], rows, n)


def residual(kern, x, y, norm, next_norm, pre):
    """The residual stream after a sublayer whose output is y (B*n x C, fresh: the kernel
    writes into it), and the next sublayer's input: post-norm, norm(x + y) twice (the
    stream is its input); pre-norm, x + y and next_norm of it (None: no next sublayer in
    the layer; the next layer norms it itself)."""
    if kern is not None and (not pre or next_norm is not None):
        out = kern.residual_norm(x, y, *(next_norm if pre else norm)[1:], pre)
        return (out[0], out[1]) if pre else (out[0], out[0])
    x = x + y
    if pre:
        return x, normed(next_norm, x) if next_norm is not None else None
    x = normed(norm, x)
    return x, x


def feed_forward_hidden(w, y):
    """The feed-forward's hidden units of y (B*n x C): B*n x F, relu inside fc1's product
    where the activation is relu (Product.relu)."""
    if w["activation"] is torch.relu:
        return w["fc1"].relu(y)
    return w["activation"](product(y, w["fc1"]))


def cross_attention(w, cache, i, y, rows, n, encoder_out, padding_mask, need_attn, kern=None):
    """Attention of the block (B*n x C) to the source, its keys and values kept by the cache
    from the first call: B*n x C, and the attention B x n x S averaged over heads (need_attn)."""
    heads = w["heads"]
    source = cache.source(i) or source_keys_values(w, cache, i, encoder_out, padding_mask)
    q = split_heads(product(y, w["q"]), rows, n, heads)
    if need_attn and kern is None:
        out, weights = attend(q, *source, cache.source_mask, need_attn)
        return product(merge_heads(out, rows, n), w["out"]), weights.mean(dim=1)
    out = product(attended(kern, q, *source, cache.source_mask, rows, n), w["out"])
    if need_attn:  # the alignment layer's weights, by torch's operations; the output stays the kernel's
        return out, attend(q, *source, cache.source_mask, need_attn)[1].mean(dim=1)
    return out, None


def source_keys_values(w, cache, i, encoder_out, padding_mask):
    """Layer i's keys and values of the source (B x h x S x d each), made from encoder_out
    (S x B x C) on a batch's first pass and kept by the cache."""
    length, batch, channels = encoder_out.shape
    kv = product(encoder_out.reshape(length * batch, channels), w["kv"]).view(length, batch, 2, w["heads"], -1)
    source = (kv[:, :, 0].permute(1, 2, 0, 3).contiguous(), kv[:, :, 1].permute(1, 2, 0, 3).contiguous())
    cache.keep_source(i, *source, padding_mask)
    return source
