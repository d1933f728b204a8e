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
first call and kept by the cache. It rounds differently from fairseq's step, as any
block pass does, which is why exactness is tested in float64.

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

from .block_layer import attend
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
    attn = None
    for i, w in enumerate(lean.layers):
        pre, heads = w["pre"], w["heads"]
        # Self-attention: the block's keys and values go into the cache, in place.
        y = normed(w["self_norm"], x) if pre else x
        qkv, k, v = cache.write(i, y, w["qkv"], heads)  # B*n x 3C, made in the cache
        q = split_heads(qkv, rows, n, heads, 0, channels)  # B x h x n x d
        x = x + product(merge_heads(attend(q, k, v, mask)[0], rows, n), w["out"])
        if not pre:
            x = normed(w["self_norm"], x)
        cross = w["cross"]
        if cross is not None and encoder_out is not None:
            y = normed(w["cross_norm"], x) if pre else x
            y, layer_attn = cross_attention(cross, cache, i, y, rows, n, encoder_out, padding_mask,
                                            i == alignment_layer)
            x = x + y
            if not pre:
                x = normed(w["cross_norm"], x)
            if layer_attn is not None:
                attn = layer_attn
        y = normed(w["final_norm"], x) if pre else x
        x = x + product(feed_forward_hidden(w, y), w["fc2"])
        if not pre:
            x = normed(w["final_norm"], x)
    x = x.view(rows, n, channels)
    if cache.rows is not None:  # the finished rows' outputs are no one's
        x = x.index_select(0, cache.rows)
        attn = attn.index_select(0, cache.rows) if attn is not None else None
    return x, attn


def feed_forward_hidden(w, y):
    """The feed-forward's hidden units of y (B*n x C): B*n x F, relu inside fc1's product
    where the activation is relu (Product.relu)."""
    if w["activation"] is torch.relu:
        return w["fc1"].relu(y)
    return w["activation"](product(y, w["fc1"]))


def cross_attention(w, cache, i, y, rows, n, encoder_out, padding_mask, need_attn):
    """Attention of the block (B*n x C) to the source, its keys and values kept by the cache
    from the first call: B*n x C, and the attention B x n x S averaged over heads (need_attn)."""
    heads, channels = w["heads"], y.size(1)
    source = cache.source(i)
    if source is None:
        length, batch, _ = encoder_out.shape
        kv = product(encoder_out.reshape(length * batch, channels), w["kv"]).view(length, batch, 2, heads, -1)
        source = (kv[:, :, 0].permute(1, 2, 0, 3).contiguous(), kv[:, :, 1].permute(1, 2, 0, 3).contiguous())
        cache.keep_source(i, *source, padding_mask)
    q = split_heads(product(y, w["q"]), rows, n, heads)
    out, weights = attend(q, *source, cache.source_mask, need_attn)
    out = product(merge_heads(out, rows, n), w["out"])
    return out, weights.mean(dim=1) if need_attn else None
