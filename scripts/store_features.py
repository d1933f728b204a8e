#!/usr/bin/env python
"""Store a frozen base's features once, for head training under --stored-features.

Runs the base (a transformer_blockwise checkpoint or a plain fairseq transformer one) in
eval mode, float32, without autograd over each subset of DATA (fairseq-preprocess's
output), in batches of up to --max-tokens sorted by length, and writes per sentence its
encoder output at each source token and its decoder's top-layer features at each target
position (fairseq_bpd/stored_features.py has the format), then OUT_DIR/meta.json: the
checkpoint's sha256, the data files' sizes, the widths and the counts.

  .venv/bin/python scripts/store_features.py DATA BASE_CHECKPOINT OUT_DIR \
      [--subsets train valid] [--max-tokens 4096] [--train-subset train] [--cpu]

Subsets already in OUT_DIR from the same checkpoint are kept, the ones asked for too where
their data files are the ones they were made from (so a recipe may run it every time). Train with
scripts/train_heads.sh DATA BASE_CHECKPOINT SAVE K frozen --stored-features OUT_DIR.
"""
import argparse
import json
import os

import torch
from fairseq import utils

from fairseq_bpd.bench import load, pick_device
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.stored_features import (META, SENTENCES_AS_HELD, data_files, rows_problem, sha256, store_subset,
                                         widths)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", help="fairseq-preprocess's directory")
    ap.add_argument("checkpoint", help="the base the heads train on (--finetune-from-model)")
    ap.add_argument("out", help="where the features go")
    ap.add_argument("--subsets", nargs="+", default=["train", "valid"])
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens a batch, as fairseq's --max-tokens")
    ap.add_argument("--train-subset", default="train",
                    help="the subset read as fairseq-train reads its --train-subset (with train1, train2, ...)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU even where there is a GPU")
    args = ap.parse_args()
    if not os.path.isfile(args.checkpoint):
        raise SystemExit(f"error: checkpoint not found: {args.checkpoint}")
    digest = sha256(args.checkpoint)
    # The sentences as the data holds them, as training with --stored-features reads them,
    # whatever the base was trained with.
    model, task, _ = load(args.checkpoint, args.data, SENTENCES_AS_HELD)
    model = model.float().to(pick_device(args.cpu)).eval()
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, META)
    meta = {"checkpoint": args.checkpoint, "checkpoint_sha256": digest, "dtype": "float32",
            "source_lang": task.cfg.source_lang, "target_lang": task.cfg.target_lang,
            "encoder_dim": widths(model)[0], "decoder_dim": widths(model)[1], "subsets": {}}
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            before = json.load(f)
        if all(before.get(key) == meta[key] for key in meta if key not in ("checkpoint", "subsets")):
            meta["subsets"] = before["subsets"]
    data_path = utils.split_paths(task.cfg.data)[0]
    for subset in args.subsets:
        kept = meta["subsets"].get(subset)
        if kept and not rows_problem(args.out, subset, meta, kept["source_tokens"], kept["target_tokens"]) \
                and kept["combined"] == (subset == args.train_subset) \
                and kept["files"] == data_files(data_path, subset, task.cfg.source_lang, task.cfg.target_lang,
                                                kept["combined"]):
            print(f"{subset}: kept (stored from this checkpoint and these files)")
            continue
        # The subset leaves meta.json while its files are written: a run cut short leaves the
        # others usable and this one unlisted.
        meta["subsets"].pop(subset, None)
        write_meta(meta, meta_path)
        try:
            meta["subsets"][subset] = entry = store_subset(
                model, task, subset, args.out, args.max_tokens, combined=subset == args.train_subset)
        except (BlockwiseRequestError, FileNotFoundError, AssertionError) as error:  # no such subset; --max-tokens too small
            raise SystemExit(f"error: {subset}: {error}") from None
        print(f"{subset}: {entry['sentences']} sentences, {entry['source_tokens']} source and "
              f"{entry['target_tokens']} target tokens"
              + (f", {len(entry['unstored'])} too long for the base (not stored)" if entry["unstored"] else ""))
    write_meta(meta, meta_path)


def write_meta(meta, path):
    """meta.json, replaced whole (never a file cut short)."""
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    with torch.no_grad():
        main()
