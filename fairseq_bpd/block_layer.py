"""One decoder layer over a block, in fewer tensor operations than fairseq's incremental path.

A decoder invocation runs each layer once on a handful of rows, so its cost is mostly
per-operation overhead, not arithmetic: fairseq's MultiheadAttention spends it on shape
checks, time-first/batch-first reshapes, a float copy of the key padding mask, and
head-averaged attention weights for every layer. block_layer computes the same function
for the layers it understands (the standard pre- or post-norm Transformer decoder layer
in inference, see `understands`) with torch's fused attention, reading the layer's own
weights and reaching its cache only through the cache's own methods (cache.py), which
keep fairseq's format, so reorder_incremental_state and fairseq's own step read it as
before. Any other layer runs as fairseq's. It rounds differently from fairseq's step, as
any block pass does, which is why exactness is tested in float64.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayer, TransformerDecoderLayerBase


def understands(layer):
    """Whether block_layer reproduces this fairseq decoder layer: a bool (see unsupported)."""
    return unsupported(layer) is None


def unsupported(layer):
    """What block_layer does not reproduce in this fairseq decoder layer, in words, or None.

    No extras (head scaling, attention or FFN layer norms, residual scaling,
    cross-self-attention), plain linear projections (no quantization noise), no forward
    hooks on any of its modules, fairseq's own attention without bias_kv or zero
    attention, and no dropout at work. lean_layers decides it again after train()/eval()
    and after any hook is registered.
    """
    if type(layer) not in (TransformerDecoderLayerBase, TransformerDecoderLayer):
        return f"a {type(layer).__name__}"
    if layer.training:
        return "training mode"
    if layer.cross_self_attention:
        return "cross-self-attention"
    extras = [name for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid") if getattr(layer, name, None) is not None]
    if extras:
        return extras[0]
    linears = [layer.fc1, layer.fc2]
    for attention in (layer.self_attn, layer.encoder_attn):
        if attention is None:
            continue
        if type(attention) is not MultiheadAttention:
            return f"a {type(attention).__name__}"
        if attention.bias_k is not None or attention.add_zero_attn:
            return "bias_kv or zero attention"
        if getattr(attention, "use_xformers", False) or not attention.qkv_same_dim:
            return "xformers or keys and values of another width"
        linears += [attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj]
    norms = [layer.self_attn_layer_norm, layer.final_layer_norm]
    if layer.encoder_attn is not None:
        norms.append(layer.encoder_attn_layer_norm)
    if not all(type(m) is nn.Linear for m in linears) or not all(type(m) is nn.LayerNorm for m in norms):
        return "a projection or layer norm that is no plain nn.Linear or nn.LayerNorm"
    # No hooks anywhere in the layer: block_layer calls its linears and layer norms, but not
    # the layer, its attention or dropout modules, whose hooks would silently not run.
    return uncalled_problem(layer)


def uncalled_problem(root):
    """What a lean pass that calls none of root's modules would miss, in words, or None:
    torch's global hooks, a forward hook on any of its modules, dropout at inference."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module hooks"
    modules = list(root.modules())
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return "a forward hook"
    if any(getattr(m, "apply_during_inference", False) for m in modules):
        return "dropout at inference"
    return None


def block_layer(layer, x, encoder_out, encoder_padding_mask, cache, self_attn_mask, need_attn):
    """The layer over a block: x n x b x C (time first, as fairseq) -> n x b x C, attention.

    cache: the decoder's IncrementalCache (cache.py). self_attn_mask: n x W+n additive
    (W cached entries, then the block), or None (a block of one sees everything).
    encoder_out: S x b x C; encoder_padding_mask: b x S or None.
    The attention returned (need_attn) is the encoder attention averaged over heads,
    b x n x S, else None.
    """
    pre = layer.normalize_before
    residual = x
    y = norm(layer.self_attn_layer_norm, x) if pre else x
    x = residual + self_attention(layer.self_attn, y, cache, self_attn_mask)
    if not pre:
        x = norm(layer.self_attn_layer_norm, x)
    attn = None
    if layer.encoder_attn is not None and encoder_out is not None:
        residual = x
        y = norm(layer.encoder_attn_layer_norm, x) if pre else x
        y, attn = encoder_attention(layer.encoder_attn, y, encoder_out, encoder_padding_mask, cache, need_attn)
        x = residual + y
        if not pre:
            x = norm(layer.encoder_attn_layer_norm, x)
    residual = x
    y = norm(layer.final_layer_norm, x) if pre else x
    x = residual + linear(layer.fc2, layer.activation_fn(linear(layer.fc1, y)))
    if not pre:
        x = norm(layer.final_layer_norm, x)
    return x, attn


# The modules' own functions, called directly: understands() made sure no hook is there
# to run, and nn.Module's call machinery, paid dozens of times an invocation, costs more
# than these small products on a handful of rows.
def linear(module, x):
    return F.linear(x, module.weight, module.bias)


def norm(module, x):
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def heads_first(x, heads):
    """n x b x C -> b x h x n x d."""
    n, b, _ = x.shape
    return x.view(n, b, heads, -1).permute(1, 2, 0, 3)


def time_first(x):
    """b x h x n x d -> n x b x C."""
    b, h, n, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(n, b, h * d)


def self_attention(attention, x, cache, mask):
    """Self-attention of a block after the cached prefix, the cache extended by it: n x b x C."""
    h = attention.num_heads
    q = heads_first(linear(attention.q_proj, x) * attention.scaling, h)
    k = heads_first(linear(attention.k_proj, x), h)
    v = heads_first(linear(attention.v_proj, x), h)
    k, v, mask = cache.append(attention, k, v, mask)
    return linear(attention.out_proj, time_first(attend(q, k, v, mask)[0]))


def encoder_attention(attention, x, encoder_out, padding_mask, cache, need_attn):
    """Attention of a block to the source, its keys and values cached on the first call:
    n x b x C, and the attention b x n x S averaged over heads (need_attn) or None."""
    h = attention.num_heads
    source = cache.source(attention)
    if source is None:
        source = (heads_first(linear(attention.k_proj, encoder_out), h),
                  heads_first(linear(attention.v_proj, encoder_out), h))
        cache.keep_source(attention, *source, padding_mask)
    k, v = source
    q = heads_first(linear(attention.q_proj, x) * attention.scaling, h)
    mask = None
    if padding_mask is not None:  # b x 1 x 1 x S, -inf at padding
        mask = q.new_zeros(padding_mask.shape).masked_fill_(padding_mask.bool(), -math.inf)[:, None, None, :]
    out, weights = attend(q, k, v, mask, need_attn)
    return linear(attention.out_proj, time_first(out)), weights.mean(dim=1) if need_attn else None


def attend(q, k, v, mask, need_weights=False):
    """Scaled dot-product attention, q already scaled: q b x h x n x d, k, v b x h x T x d,
    mask additive, broadcast to b x h x n x T, or None. Returns b x h x n x d and, if
    need_weights, the weights b x h x n x T.

    torch's fused kernel where it can (float32, no weights wanted); else fairseq's own
    order of operations, its softmax in float32 whatever the dtype (fairseq.utils.softmax),
    so that a float64 model rounds where fairseq's does.
    """
    if q.dtype == torch.float32 and not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0), None
    scores = q @ k.transpose(2, 3)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if weights.dtype != q.dtype:
        weights = weights.to(q)
    return weights @ v, weights
