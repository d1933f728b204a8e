#!/usr/bin/env python
"""Shrink a fairseq checkpoint for the repository, and restore it.

pack: drop the optimizer state and store each weight matrix in 4 bits, with one
float16 scale per group of 64 weights in a row (about a seventh of float32), the proposal
heads' in --head-bits (4 or 8); unpack:
a loadable fairseq checkpoint with float32 weights. The demo decodes with the unpacked model, so its greedy and
blockwise outputs are compared on the very same weights.

  .venv/bin/python scripts/pack_checkpoint.py pack CKPT OUT.pt [--head-vocab N] [--head-bits 8]
  .venv/bin/python scripts/pack_checkpoint.py unpack OUT.pt CKPT

--head-vocab N records N as the packed model's --head-vocab: the shortlist its heads propose
over by default. Heads trained over the whole dictionary (--head-vocab 0) learn the rarer
tokens too, which --blockwise-proposal-lexicon then proposes past a shortlist that keeps a
batch-1 draft step cheap.

--head-bits 8 stores the proposal heads' matrices (decoder.heads.*) in 8 bits, each group
of 64 with its float16 scale. 4 bits change nothing that exactness promises for the base
(greedy is the unpacked base's, whatever its weights), but in the heads they cost a draft
decoder about 1.5% of its accepted block (models/demo/), and the heads are a tenth of the
weights. A tensor the heads share with the base keeps the base's 4 bits.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fairseq_bpd  # noqa: E402,F401  (allow-lists the checkpoint globals)
from fairseq_bpd.heads import shortlist_problem  # noqa: E402


GROUP = 64
# The proposal heads' weights: what --head-bits stores in other bits than the base's 4.
HEADS = "decoder.heads."


def quantize(weight):
    """rows x cols float -> (packed uint8 rows x cols/2, float16 scales rows x cols/GROUP)."""
    groups = weight.view(weight.size(0), -1, GROUP)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 7
    q = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.uint8).view(weight.size(0), -1)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale.squeeze(2).half()


def dequantize(packed, scale):
    q = torch.stack([packed & 15, packed >> 4], dim=2).view(packed.size(0), -1).float() - 8
    return (q.view(q.size(0), -1, GROUP) * scale.float().unsqueeze(2)).view(q.size(0), -1)


def quantize8(weight):
    """rows x cols float -> (int8 rows x cols, float16 scales rows x cols/GROUP; a normal
    float16 at the least, so that a group of tiny weights keeps its scale's precision)."""
    groups = weight.view(weight.size(0), -1, GROUP)
    scale = (groups.abs().amax(dim=2, keepdim=True) / 127).clamp(min=2**-14)
    q = torch.round(groups / scale).clamp(-127, 127).to(torch.int8)
    return q.view(weight.size(0), -1), scale.squeeze(2).half()


def dequantize8(q, scale):
    return (q.float().view(q.size(0), -1, GROUP) * scale.float().unsqueeze(2)).view(q.size(0), -1)


class ProjectionRows:
    """What shortlist_problem reads of a dictionary, from the output projection's rows: its
    length, and fairseq's four special symbols (<s>, <pad>, </s>, <unk>) before the words."""

    nspecial = 4

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows


def head_vocab_of(model, head_vocab):
    """`head_vocab` where the model accepts it as --head-vocab when it loads (shortlist_problem,
    on the output projection's rows); else SystemExit, before anything is written."""
    rows = next((model[name].size(0) for name in ("decoder.output_projection.weight", "decoder.embed_tokens.weight")
                 if name in model), None)
    if rows is None:
        raise SystemExit("error: --head-vocab: the checkpoint has no decoder output projection")
    problem = shortlist_problem("--head-vocab", head_vocab, ProjectionRows(rows))
    if problem:
        raise SystemExit(f"error: {problem}")
    return head_vocab


def pack(src, dst, head_vocab=None, head_bits=4):
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits must be 4 or 8, not {head_bits!r}")
    state = torch.load(src, map_location="cpu")
    # A tensor stored once for several names: in 8 bits only where every name is a head's.
    names = {}
    for name, tensor in state["model"].items():
        names.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    if head_vocab is not None:
        state["cfg"]["model"].head_vocab = head_vocab_of(state["model"], head_vocab)
    weights = {}
    for name, tensor in state["model"].items():
        # shared embeddings appear under several names but are one tensor: store it once
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if names[key][0] != name:
            weights[name] = {"same_as": names[key][0]}
            continue
        tensor = tensor.float()
        heads_only = all(n.startswith(HEADS) for n in names[key])
        if tensor.dim() == 2 and tensor.size(1) % GROUP == 0 and head_bits == 8 and heads_only:
            q, scale = quantize8(tensor)
            weights[name] = {"int8": q, "scale": scale}
        elif tensor.dim() == 2 and tensor.size(1) % GROUP == 0:
            packed, scale = quantize(tensor)
            weights[name] = {"int4": packed, "scale": scale}
        else:
            weights[name] = {"half": tensor.half()}
    kept = {key: state[key] for key in ("cfg", "args", "optimizer_history") if key in state}
    torch.save({"packed_model": weights, **kept, "extra_state": {}}, dst)


def unpack(src, dst):
    state = torch.load(src, map_location="cpu")
    model = {}
    for name, stored in state.pop("packed_model").items():
        if "same_as" in stored:
            model[name] = model[stored["same_as"]]
        elif "int4" in stored:
            model[name] = dequantize(stored["int4"], stored["scale"])
        elif "int8" in stored:
            model[name] = dequantize8(stored["int8"], stored["scale"])
        else:
            model[name] = stored["half"].float()
    state["model"] = model
    state["last_optimizer_state"] = None
    tmp = dst + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, dst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--head-vocab", type=int, help="pack: the model's --head-vocab from now on (0: the whole dictionary)")
    ap.add_argument("--head-bits", type=int, choices=(4, 8), help="pack: the bits of the proposal heads' matrices, decoder.heads.* (default 4, as the base's)")
    args = ap.parse_args()
    if not os.path.isfile(args.src):
        raise SystemExit(f"error: not found: {args.src}")
    if args.head_vocab is not None and (args.action != "pack" or args.head_vocab < 0):
        raise SystemExit("error: --head-vocab goes with pack, and is 0 or more")
    if args.head_bits is not None and args.action != "pack":
        raise SystemExit("error: --head-bits goes with pack")
    if args.action == "pack":
        pack(args.src, args.dst, args.head_vocab, args.head_bits or 4)
    else:
        unpack(args.src, args.dst)
    print(f"{args.dst}: {os.path.getsize(args.dst) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
