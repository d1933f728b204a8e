#!/usr/bin/env python
"""Hold out a slice of distilled pairs as the validation split, so that the training log's
`block` estimate is made on sources the heads never saw.

  python scripts/hold_out.py PAIRS OUT [--one-in 57] [--train-pairs N [--seed 1]] [--data data/bible-bin] [--src de --tgt en]

PAIRS is a scripts/self_distill.sh folder (its text/train.bpe.SRC and .TGT). A pair is held
out when the MD5 of its source line is 0 modulo ONE_IN: about one pair in ONE_IN, and the
same sources whatever else PAIRS holds (a larger distillation of the same text holds out
the same sentences, and more). --train-pairs N trains on N of the other pairs, drawn at
random (--seed), in PAIRS's order, the held-out split unchanged: acceptance against the
number of distilled sources at an equal update budget. OUT gets the split `train` (the
other pairs) and `valid` (the held-out ones), binarised with DATA's dictionaries; DATA's
test split is linked (human references), never trained on.
"""
import argparse
import hashlib
import os
import random
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def held_out(source_line, one_in):
    """Whether a pair is held out: by its source text alone."""
    return int(hashlib.md5(source_line.encode("utf-8")).hexdigest(), 16) % one_in == 0


def split(sources, targets, one_in):
    """{"train": [(src, tgt), ...], "valid": [...]}, in PAIRS's order."""
    if len(sources) != len(targets):
        raise SystemExit(f"error: {len(sources)} source lines but {len(targets)} target lines")
    splits = {"train": [], "valid": []}
    for pair in zip(sources, targets):
        splits["valid" if held_out(pair[0], one_in) else "train"].append(pair)
    for name, pairs in splits.items():
        if not pairs:
            raise SystemExit(f"error: no {name} pairs (of {len(sources)}) with --one-in {one_in}")
    return splits


def draw(pairs, count, seed):
    """`count` of `pairs` drawn at random by `seed`, in their order."""
    if not 0 < count <= len(pairs):
        raise SystemExit(f"error: --train-pairs must be 1 to the {len(pairs)} training pairs (got {count})")
    return [pairs[i] for i in sorted(random.Random(seed).sample(range(len(pairs)), count))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs")
    parser.add_argument("out")
    parser.add_argument("--one-in", type=int, default=57, help="hold out about one pair in N (default 57)")
    parser.add_argument("--train-pairs", type=int, help="train on N of the pairs not held out, drawn at random")
    parser.add_argument("--seed", type=int, default=1, help="the draw's seed (default 1)")
    parser.add_argument("--data", default="data/bible-bin", help="the corpus: dictionaries and test split")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    args = parser.parse_args(argv)
    if args.one_in < 2:
        raise SystemExit(f"error: --one-in must be 2 or more (got {args.one_in})")
    text = {}
    for lang in (args.src, args.tgt):
        path = os.path.join(args.pairs, "text", f"train.bpe.{lang}")
        if not os.path.isfile(path):
            raise SystemExit(f"error: not found: {path} (PAIRS is a scripts/self_distill.sh folder)")
        with open(path, encoding="utf-8") as f:
            text[lang] = f.read().splitlines()
    splits = split(text[args.src], text[args.tgt], args.one_in)
    if args.train_pairs is not None:
        splits["train"] = draw(splits["train"], args.train_pairs, args.seed)
    os.makedirs(os.path.join(args.out, "text"), exist_ok=True)
    for name, pairs in splits.items():
        for i, lang in enumerate((args.src, args.tgt)):
            with open(os.path.join(args.out, "text", f"{name}.bpe.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(pair[i] + "\n" for pair in pairs)
    for f in os.listdir(args.out):  # fairseq-preprocess refuses to overwrite dictionaries
        if f.startswith("dict."):
            os.remove(os.path.join(args.out, f))
    prefix = os.path.join(args.out, "text")
    subprocess.run(
        [os.path.join(BIN, "fairseq-preprocess"), "--source-lang", args.src, "--target-lang", args.tgt,
         "--trainpref", f"{prefix}/train.bpe", "--validpref", f"{prefix}/valid.bpe",
         "--srcdict", os.path.join(args.data, f"dict.{args.src}.txt"),
         "--tgtdict", os.path.join(args.data, f"dict.{args.tgt}.txt"),
         "--destdir", args.out, "--workers", "2"],
        check=True, stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.out, "preprocess.log"), "w"),
    )
    for lang in (args.src, args.tgt):
        for ext in ("bin", "idx"):
            name = f"test.{args.src}-{args.tgt}.{lang}.{ext}"
            link, target = os.path.join(args.out, name), os.path.join(args.data, name)
            if os.path.exists(target) and not os.path.lexists(link):
                os.symlink(os.path.realpath(target), link)
    print(f"{len(splits['train'])} train and {len(splits['valid'])} held-out (valid) pairs in {args.out}")


if __name__ == "__main__":
    main()
