#!/usr/bin/env python
"""What a greedy step costs at the least in eager torch on this machine, on a checkpoint's weights.

One sentence's greedy step with nothing but its arithmetic: the decoder layers (self-attention
over a cache preallocated for the whole output and written in place, encoder attention over
keys and values made once, feed-forward, layer norms), the output projection, log-softmax and
the best token; no fairseq modules, no bookkeeping, no checks. It is the floor under fairseq's
greedy step and under the plugin's width-1 invocation (scripts/profile_invocation.py prints
both), beside which their overhead can be read.

  .venv/bin/python scripts/step_floor.py --data DATA --path CKPT [--max-sentences 20] [--threads 2]

Prints the milliseconds per step (the median over the sentences' steps, each sentence decoded
once unmeasured first) and the count of sentences whose greedy output matches fairseq's
`--beam 1` (float32 rounding may part them on a near-tie).
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from fairseq_bpd import bench

MAX_LEN_B = 200  # fairseq-generate's default --max-len-b, for both decoders


class FloorStep:
    """A greedy step of `model`'s decoder for one sentence whose encoder output is given.

    The plain fairseq Transformer decoder (pre- or post-norm layers, any activation,
    sinusoidal or learned positions), one sentence with no source padding; anything else is
    refused. The tests check it against fairseq's SequenceGenerator in float64.
    """

    def __init__(self, model, encoder_out, max_len):
        decoder = model.decoder
        extras = [name for name in ("project_in_dim", "project_out_dim", "layernorm_embedding", "quant_noise")
                  if getattr(decoder, name, None) is not None]
        if extras:
            raise ValueError(f"FloorStep computes the plain Transformer decoder, not one with {', '.join(extras)}")
        enc = encoder_out["encoder_out"][0]  # S x 1 x C
        self.scale, self.embed = decoder.embed_scale, decoder.embed_tokens.weight.detach()
        self.final_norm = decoder.layer_norm
        self.out = decoder.output_projection.weight.detach().t().contiguous()  # C x V
        self.positions = None
        if decoder.embed_positions is not None:  # positions 0..max_len, as a whole prefix gets them
            tokens = torch.full((1, max_len + 1), decoder.padding_idx + 1, dtype=torch.long)
            self.positions = decoder.embed_positions(tokens)[0].detach()
        self.layers = [self.arrange(layer, enc, max_len) for layer in decoder.layers]
        self.length = 0

    @staticmethod
    def arrange(layer, enc, max_len):
        """One layer's weights as x · W + b products, its caches and the source's keys and values."""
        def product(*linears, scale=1.0):
            weight = torch.cat([m.weight.detach() for m in linears]).t().contiguous()
            bias = torch.cat([m.bias.detach() for m in linears])
            if scale != 1.0:  # fairseq scales q after its bias
                width = linears[0].out_features
                weight[:, :width] *= scale
                bias = torch.cat([bias[:width] * scale, bias[width:]])
            return weight, bias

        attention, cross = layer.self_attn, layer.encoder_attn
        heads, channels = attention.num_heads, attention.embed_dim
        d = channels // heads
        source = cross.k_proj(enc), cross.v_proj(enc)  # S x 1 x C each
        keys, values = (x.view(-1, heads, d).transpose(0, 1)[None].contiguous() for x in source)  # 1 x H x S x d
        return {
            "pre": layer.normalize_before, "heads": heads, "activation": layer.activation_fn,
            "qkv": product(attention.q_proj, attention.k_proj, attention.v_proj, scale=attention.scaling),
            "out": product(attention.out_proj), "q": product(cross.q_proj, scale=cross.scaling),
            "cross_out": product(cross.out_proj), "fc1": product(layer.fc1), "fc2": product(layer.fc2),
            "norms": (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm),
            "keys": torch.zeros(1, heads, max_len + 1, d, dtype=enc.dtype),
            "values": torch.zeros(1, heads, max_len + 1, d, dtype=enc.dtype),
            "source": (keys, values),
        }

    def __call__(self, token):
        """token: the last output (a 1-element long tensor) -> log-probs 1 x V after it."""
        t = self.length
        x = self.scale * self.embed[token]  # 1 x C
        if self.positions is not None:
            x = x + self.positions[t]
        for w in self.layers:
            x = self.layer(w, x, t)
        if self.final_norm is not None:
            x = F.layer_norm(x, x.shape[-1:], self.final_norm.weight, self.final_norm.bias, self.final_norm.eps)
        self.length += 1
        return torch.log_softmax(x @ self.out, dim=-1, dtype=torch.float32)

    @staticmethod
    def layer(w, x, t):
        heads, (n1, n2, n3) = w["heads"], w["norms"]
        channels = x.size(-1)

        def norm(m, y):
            return F.layer_norm(y, (channels,), m.weight, m.bias, m.eps)

        y = norm(n1, x) if w["pre"] else x
        q, k, v = torch.addmm(w["qkv"][1], y, w["qkv"][0]).view(3, heads, 1, -1).unbind(0)
        w["keys"][0, :, t] = k[:, 0]
        w["values"][0, :, t] = v[:, 0]
        # scale 1: q is scaled already, as fairseq scales it (SDPA's default would scale it again)
        y = F.scaled_dot_product_attention(q[None], w["keys"][:, :, : t + 1], w["values"][:, :, : t + 1], scale=1.0)
        x = x + torch.addmm(w["out"][1], y.reshape(1, channels), w["out"][0])
        x = x if w["pre"] else norm(n1, x)
        y = norm(n2, x) if w["pre"] else x
        q = torch.addmm(w["q"][1], y, w["q"][0]).view(1, heads, 1, -1)
        y = F.scaled_dot_product_attention(q, *w["source"], scale=1.0)
        x = x + torch.addmm(w["cross_out"][1], y.reshape(1, channels), w["cross_out"][0])
        x = x if w["pre"] else norm(n2, x)
        y = norm(n3, x) if w["pre"] else x
        y = torch.addmm(w["fc2"][1], w["activation"](torch.addmm(w["fc1"][1], y, w["fc1"][0])), w["fc2"][0])
        x = x + y
        return x if w["pre"] else norm(n3, x)


def floor_greedy(model, sample, tgt_dict, max_len):
    """Each sentence of `sample` decoded greedily by FloorStep, by fairseq's rules (no pad, no
    EOS first, EOS forced after max_len tokens): a list of token lists (EOS last), and each
    sentence's seconds per step."""
    net_input, eos, pad = sample["net_input"], tgt_dict.eos(), tgt_dict.pad()
    outputs, seconds = [], []
    for row in range(net_input["src_tokens"].size(0)):
        src = net_input["src_tokens"][row : row + 1]
        src = src[:, src[0].ne(model.encoder.padding_idx)]  # one sentence: no padding
        encoder_out = model.encoder(src, src_lengths=torch.tensor([src.size(1)]))
        floor = FloorStep(model, encoder_out, max_len)
        token, out = torch.tensor([eos]), []
        start = time.perf_counter()
        while not out or out[-1] != eos:
            lprobs = floor(token)
            lprobs[:, pad] = -math.inf
            if not out:  # fairseq's min_len of 1
                lprobs[:, eos] = -math.inf
            token = lprobs.argmax(-1) if len(out) < max_len else torch.tensor([eos])
            out.append(int(token))
        seconds.append((time.perf_counter() - start) / len(out))
        outputs.append(out)
    return outputs, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_data_args(parser)
    parser.add_argument("--max-sentences", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.cpu = True  # FloorStep's caches are made on the CPU: the floor is the CPU's
    model, task, _, _ = bench.setup(args)  # sets the threads, refuses a missing --path or --data
    samples = bench.batches(task, args.subset, 1, args.max_sentences)
    tgt = task.target_dictionary
    greedy = SequenceGenerator([model], tgt, beam_size=1, max_len_a=0, max_len_b=MAX_LEN_B)
    max_len = min(MAX_LEN_B, model.max_decoder_positions() - 1)  # SequenceGenerator's own bound
    with torch.inference_mode():
        references = [greedy.generate([model], s)[0][0]["tokens"].tolist() for s in samples]
        for s in samples:  # warm-up
            floor_greedy(model, s, tgt, max_len)
        per_step, same = [], 0
        for s, reference in zip(samples, references):
            out, seconds = floor_greedy(model, s, tgt, max_len)
            same += out[0] == reference
            per_step += seconds
    print(f"{1000 * statistics.median(per_step):.3f} ms a step (median over {len(samples)} sentences, "
          f"{torch.get_num_threads()} threads), {same}/{len(samples)} outputs as --beam 1's")


if __name__ == "__main__":
    main()
