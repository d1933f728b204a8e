"""The encoder over a batch in fewer operations, on weights packed once: the lean encoder pass.

At batch 1 a sentence's encoder forward is a sizeable share of its decoding: fairseq's
TransformerEncoder runs each layer through nn.Module calls and torch's
multi_head_attention_forward (three separate projections, shape checks, reshapes), and
every nn.Linear makes MKL re-pack its weight on each call. encode() computes the same
function for the encoders it understands (see unsupported) with each layer's queries, keys
and values from one product (the query's scaling folded in), products on weights packed
once for oneDNN where that was timed faster (product.Product, as static_pass does for the
decoder; float64 stays addmm), torch's fused attention, rows time first throughout (S*B x C, as fairseq lays out its
encoder output, so that nothing is transposed between layers) and, without padding,
positions from a table kept per weights. The weights are arranged once per change
(EncoderWeights, kept with what the decoder keeps and dropped with it by train()). It
returns fairseq's encoder-output dict, the one output that every decoder pass and
proposal of the batch reads. It rounds differently from fairseq's encoder, as any
reordering of the arithmetic does, which is why it is tested against it in float64.
Any other encoder, layer or input runs as fairseq's (encoder.forward_torchscript).
"""
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle
from fairseq.models.transformer import TransformerEncoder, TransformerEncoderBase
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerEncoderLayer, TransformerEncoderLayerBase

from .block_layer import uncalled_problem
from . import kernels
from .static_pass import feed_forward_hidden, norm_params, residual, self_attention_and_feed_forward

logger = logging.getLogger(__name__)
INPUTS = {"src_tokens", "src_lengths", "prev_output_tokens"}  # what fairseq's encoder is given in decoding


def encode(model, net_input):
    """The model's encoder output for `net_input` (fairseq's dict: encoder_out S x B x C, ...):
    the lean pass where unsupported() finds nothing, else fairseq's own forward (the log
    says once why)."""
    encoder = model.encoder
    problem, modules = decided(model, net_input)
    weights = encoder_weights(model, modules) if problem is None else None
    if weights is None:
        say_why_not_lean(encoder, problem or "weights that keep no version (made under inference_mode)")
        return encoder.forward_torchscript(net_input)
    return lean_encode(weights, net_input["src_tokens"])


def decided(model, net_input):
    """unsupported()'s answer for model.encoder and the encoder's modules (a list), kept on the
    decoder and decided again, as the decoder's lean_layers, after train() or eval() (the
    decoder's train() drops it), after any hook is registered anywhere (torch numbers every
    hook handle), when a module's training flag changes or other inputs come: walking the
    modules costs more per batch than the whole check kept. Another encoder in the model's
    place is decided anew."""
    encoder, decoder = model.encoder, model.decoder
    kept = getattr(decoder, "_encoder_decided", None)
    if kept is not None:
        (owner, hooks, inputs, modules), problem = kept
        if (owner is encoder and hooks == RemovableHandle.next_id and inputs == net_input.keys()
                and not any(m.training for m in modules)):
            return problem, modules
    modules = list(encoder.modules())
    problem = unsupported(encoder, net_input)
    decoder._encoder_decided = ((encoder, RemovableHandle.next_id, set(net_input), modules), problem)
    return problem, modules


def encoder_weights(model, modules=None):
    """The EncoderWeights of model.encoder, kept on its decoder with what decoding keeps of
    the decoder's weights (its train() drops them) and made again when a weight changes
    (decoder.weights_key over the tensors of `modules`, the encoder's: None, all of them);
    None for weights that keep no version (inference_mode's own), which would be arranged
    on every call."""
    from .decoder import own_tensors, weights_key  # the decoder module imports this one's users

    encoder, decoder = model.encoder, model.decoder
    key = weights_key(*own_tensors(list(encoder.modules()) if modules is None else modules))
    if key is None:
        return None
    kept = getattr(decoder, "_encoder_weights", None)
    if kept is None or kept[0] != key:
        kept = decoder._encoder_weights = (key, EncoderWeights(encoder))
    return kept[1]


def say_why_not_lean(encoder, problem):
    """Log, once per encoder and reason, that its forward runs as fairseq's."""
    if getattr(encoder, "_blockwise_said", None) != problem:
        encoder._blockwise_said = problem
        logger.info(f"blockwise: fairseq's own encoder forward, not the lean pass ({problem})")


def unsupported(encoder, net_input=None):
    """What the lean pass does not reproduce of this encoder (or its input), in words, or None.

    Only fairseq's TransformerEncoder itself, in inference, given tokens and lengths alone:
    no layerdrop (its module list draws random numbers even in eval, which a sampler seeded
    alike would then not draw), no quantization noise, no dropout at inference, no hooks, a
    plain nn.Embedding, no fused or other layer norms, and layers that encoder_layer_problem
    accepts (pre- or post-norm alike).
    """
    if type(encoder) not in (TransformerEncoderBase, TransformerEncoder):
        return f"a {type(encoder).__name__}"
    if net_input is not None and not set(net_input) <= INPUTS:
        return f"inputs {sorted(set(net_input) - INPUTS)}"
    if any(m.training for m in encoder.modules()):
        return "training mode"
    if encoder.encoder_layerdrop > 0:
        return "layerdrop"
    if encoder.quant_noise is not None:
        return "quantization noise"
    embedding = encoder.embed_tokens
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return "an embedding that is no plain nn.Embedding"
    norms = [m for m in (encoder.layernorm_embedding, encoder.layer_norm) if m is not None]
    if not all(type(m) is nn.LayerNorm for m in norms):
        return "a layer norm that is no plain nn.LayerNorm"
    for i, layer in enumerate(encoder.layers):
        problem = encoder_layer_problem(layer)
        if problem:
            return f"layer {i}: {problem}"
    # Hooks anywhere (the encoder's own included) would not run: the pass calls no module.
    return uncalled_problem(encoder)


def encoder_layer_problem(layer):
    """What the lean pass does not reproduce of one encoder layer, in words, or None: it takes
    fairseq's own layer (no checkpoint or other wrapper) with fairseq's attention on plain
    linears (no bias_kv, zero attention, xformers or unequal key and value widths)."""
    if type(layer) not in (TransformerEncoderLayerBase, TransformerEncoderLayer):
        return f"a {type(layer).__name__}"
    attention = layer.self_attn
    if type(attention) is not MultiheadAttention:
        return f"a {type(attention).__name__}"
    if attention.bias_k is not None or attention.add_zero_attn:
        return "bias_kv or zero attention"
    if (getattr(attention, "use_xformers", False) or not attention.qkv_same_dim
            or getattr(attention, "skip_embed_dim_check", False)):
        return "xformers or keys and values of another width"
    linears = [layer.fc1, layer.fc2, attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj]
    norms = [layer.self_attn_layer_norm, layer.final_layer_norm]
    if not all(type(m) is nn.Linear for m in linears) or not all(type(m) is nn.LayerNorm for m in norms):
        return "a projection or layer norm that is no plain nn.Linear or nn.LayerNorm"
    return None


class EncoderWeights:
    """What the lean pass reads of an encoder, arranged once: each layer's products
    (product.Product: the queries', keys' and values' side by side, the query scaled), its
    layer norms as plain parameters, and the embedding's parts."""

    def __init__(self, encoder):
        self.embedding, self.scale = encoder.embed_tokens.weight.detach(), encoder.embed_scale
        self.padding_idx, self.positions = encoder.padding_idx, encoder.embed_positions
        self.max_positions = encoder.max_positions()  # a learned table's rows
        self.embedding_norm = norm_params(encoder.layernorm_embedding) if encoder.layernorm_embedding else None
        self.final_norm = norm_params(encoder.layer_norm) if encoder.layer_norm is not None else None
        self.table = None  # the positions of an unpadded row, made on first use (position_table)
        self.layers = [self_attention_and_feed_forward(layer) for layer in encoder.layers]

    def position_table(self, length, like):
        """Positions of a row of `length` tokens without padding (what the module gives any such
        row): length x C, from a table kept from the module's own output, grown in powers of two."""
        if self.table is None or self.table.size(0) < length:
            rows = max(min(1 << max(length - 1, 63).bit_length(), self.max_positions), length)
            dummy = torch.full((1, rows), self.padding_idx + 1, dtype=torch.long, device=like.device)
            self.table = self.positions(dummy)[0].detach()
        return self.table[:length]


def lean_encode(w, src_tokens):
    """fairseq's encoder output for src_tokens B x S, computed by the lean pass on `w`
    (EncoderWeights): the same dict, its tensors S x B x C and B x S (x C)."""
    bsz, length = src_tokens.shape
    padding = src_tokens.eq(w.padding_idx)  # B x S, True at padding
    has_pads = bool(padding.any())
    embed = w.scale * torch.embedding(w.embedding, src_tokens.t())  # S x B x C
    x = embed
    if w.positions is not None:
        if has_pads:  # the module places positions after left (or right) padding itself
            x = x + w.positions(src_tokens).transpose(0, 1)
        else:
            x = x + w.position_table(length, src_tokens)[:, None]
    if w.embedding_norm is not None:
        x = torch.layer_norm(x, *w.embedding_norm)
    mask = None
    if has_pads:
        x = x.masked_fill(padding.t()[..., None], 0.0)
        mask = x.new_zeros(padding.shape).masked_fill_(padding, -float("inf"))[:, None, None]  # B x 1 x 1 x S
    channels = x.size(-1)
    x = x.reshape(length * bsz, channels)
    kern = kernels.serve(x)
    for layer in w.layers:
        x = encoder_layer(layer, x, bsz, length, mask, kern)
    if w.final_norm is not None:
        x = torch.layer_norm(x, *w.final_norm)
    return {
        "encoder_out": [x.view(length, bsz, channels)],  # S x B x C
        "encoder_padding_mask": [padding],  # B x S
        "encoder_embedding": [embed.transpose(0, 1)],  # B x S x C
        "encoder_states": [],
        "fc_results": [],
        "src_tokens": [],
        "src_lengths": [src_tokens.ne(w.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()],
    }


def encoder_layer(w, x, bsz, length, mask, kern=None):
    """One encoder layer on the rows x (S*B x C, time first), pre- or post-norm: S*B x C.
    mask: B x 1 x 1 x S additive (-inf at padding), or None. kern: the compiled kernels
    (kernels.serve), whose residual norm is one call for each sum and its norm, as in the
    decoder's pass (static_pass.residual); relu runs inside fc1's product where it can."""
    pre = w["pre"]
    y = torch.layer_norm(x, *w["self_norm"]) if pre else x
    qkv = w["qkv"](y)  # S*B x 3C
    y = w["out"](self_attention(qkv, bsz, length, w["heads"], mask))
    x, y = residual(kern, x, y, w["self_norm"], w["final_norm"], pre)
    x, _ = residual(kern, x, w["fc2"](feed_forward_hidden(w, y)), w["final_norm"], None, pre)
    return x


def self_attention(qkv, bsz, length, heads, mask):
    """Attention over the rows' queries, keys and values side by side (qkv S*B x 3C, the query
    scaled, rows time first): S*B x C, before the output projection."""
    step, channels = qkv.stride(0), qkv.size(1) // 3
    d = channels // heads
    shape, strides = (bsz, heads, length, d), (step, d, bsz * step, 1)
    q, k, v = (qkv.as_strided(shape, strides, qkv.storage_offset() + i * channels) for i in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # B x h x S x d
    return out.permute(2, 0, 1, 3).reshape(length * bsz, channels)
