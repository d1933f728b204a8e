#!/usr/bin/env python
"""Shrink a fairseq checkpoint for the repository, and restore it.

pack: drop the optimizer state and store each weight matrix as int8 with one float
scale per row (about a quarter of float32); unpack: a loadable fairseq checkpoint
with float32 weights. The demo decodes with the unpacked model, so its greedy and
blockwise outputs are compared on the very same weights.

  .venv/bin/python scripts/pack_checkpoint.py pack CKPT OUT.pt
  .venv/bin/python scripts/pack_checkpoint.py unpack OUT.pt CKPT
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fairseq_bpd  # noqa: E402,F401  (allow-lists the checkpoint globals)


def pack(src, dst):
    state = torch.load(src, map_location="cpu")
    weights = {}
    for name, tensor in state["model"].items():
        tensor = tensor.float()
        if tensor.dim() == 2:
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            weights[name] = {"int8": torch.round(tensor / scale).to(torch.int8), "scale": scale.half()}
        else:
            weights[name] = {"half": tensor.half()}
    kept = {key: state[key] for key in ("cfg", "args", "optimizer_history") if key in state}
    for entry in kept.get("optimizer_history", []):
        entry.pop("lr_scheduler_state", None)
    torch.save({"packed_model": weights, **kept, "extra_state": {}}, dst)


def unpack(src, dst):
    state = torch.load(src, map_location="cpu")
    model = {}
    for name, stored in state.pop("packed_model").items():
        if "int8" in stored:
            model[name] = stored["int8"].float() * stored["scale"].float()
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
    args = ap.parse_args()
    if not os.path.isfile(args.src):
        raise SystemExit(f"error: not found: {args.src}")
    (pack if args.action == "pack" else unpack)(args.src, args.dst)
    print(f"{args.dst}: {os.path.getsize(args.dst) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
