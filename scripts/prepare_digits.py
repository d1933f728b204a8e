#!/usr/bin/env python
"""scikit-learn's 8x8 handwritten digits -> a fairseq super-resolution data-bin.

  .venv/bin/python scripts/prepare_digits.py --out data/digits-bin [--factor 2]
      [--valid 100] [--test 150] [--seed 1] [--limit N]

Why these images: they ship inside scikit-learn (1,797 scans, nothing downloaded),
they are real images, and their 17 intensity levels (0..16) are an ordinal
vocabulary small enough for a CPU, the setting of the paper's approximate acceptance.
The low-resolution input is the average over factor x factor squares, rounded to the
nearest level (half up), so both sides share the dictionary 0..16. Pixels are tokens
in raster order; the split is by image (seeded shuffle). OUT receives
  raw/<split>.lr, raw/<split>.hr   one image a line, the text fed to fairseq-preprocess,
  raw/<split>.label                the digit each image shows,
  dict.txt                         the 17 levels in numeric order (index = 4 + level),
  image.json                       shapes and levels, read by --task superres_blockwise,
and fairseq-preprocess's binaries (languages lr -> hr).
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

LEVELS = 17  # load_digits: intensities 0..16
SPLITS = ("train", "valid", "test")


def low_resolution(images, factor):
    """Average pooling to the nearest level: N x H x W ints -> N x H/f x W/f ints."""
    n, height, width = images.shape
    if height % factor or width % factor:
        raise SystemExit(f"error: --factor {factor} does not divide the {height}x{width} images")
    pooled = images.reshape(n, height // factor, factor, width // factor, factor).mean(axis=(2, 4))
    return np.floor(pooled + 0.5).astype(int)


def raster(image):
    """One image as a line of intensity tokens in raster order."""
    return " ".join(str(int(v)) for v in image.reshape(-1))


def split_ids(n, valid, test, seed):
    """Image indices per split, by a seeded shuffle: {split: sorted ids}."""
    if valid + test >= n:
        raise SystemExit(f"error: --valid {valid} + --test {test} leave no training images of {n}")
    order = np.random.RandomState(seed).permutation(n)
    ids = {"test": order[:test], "valid": order[test : test + valid], "train": order[test + valid :]}
    return {split: np.sort(i) for split, i in ids.items()}


def write_text(out, images, labels, ids, factor):
    """raw/<split>.{lr,hr,label}; returns the training images' level counts."""
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    low = low_resolution(images, factor)
    for split in SPLITS:
        with open(f"{raw}/{split}.lr", "w") as lr, open(f"{raw}/{split}.hr", "w") as hr, \
                open(f"{raw}/{split}.label", "w") as label:
            for i in ids[split]:
                lr.write(raster(low[i]) + "\n")
                hr.write(raster(images[i]) + "\n")
                label.write(f"{labels[i]}\n")
    train = np.concatenate([images[ids["train"]].reshape(-1), low[ids["train"]].reshape(-1)])
    return np.bincount(train, minlength=LEVELS)


def preprocess(out, counts):
    """Binarise with one numeric dictionary for both sides (no fillers: --padding-factor 1)."""
    dictionary = os.path.join(out, "dict.txt")
    with open(dictionary, "w") as f:
        for level, count in enumerate(counts):
            f.write(f"{level} {count}\n")
    raw = os.path.join(out, "raw")
    bin_dir = os.path.dirname(sys.executable)
    subprocess.run(
        [os.path.join(bin_dir, "fairseq-preprocess"), "--source-lang", "lr", "--target-lang", "hr",
         "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
         "--srcdict", dictionary, "--tgtdict", dictionary, "--padding-factor", "1",
         "--destdir", out, "--workers", "1"],
        check=True, stdout=subprocess.DEVNULL,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--factor", type=int, default=2, help="pooling factor (default 2: 4x4 inputs)")
    parser.add_argument("--valid", type=int, default=100)
    parser.add_argument("--test", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N images")
    args = parser.parse_args(argv)
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images.astype(int)[: args.limit], digits.target[: args.limit]
    ids = split_ids(len(images), args.valid, args.test, args.seed)
    counts = write_text(args.out, images, labels, ids, args.factor)
    preprocess(args.out, counts)
    high = list(images.shape[1:])
    info = {"low": [h // args.factor for h in high], "high": high, "levels": LEVELS,
            "factor": args.factor, "images": {split: len(i) for split, i in ids.items()}}
    with open(os.path.join(args.out, "image.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"{args.out}: {info['images']} images, {info['low']} -> {info['high']}")


if __name__ == "__main__":
    main()
