#!/usr/bin/env python
"""Images from fairseq-generate's output on a superres data-bin, their error, and a PNG grid.

  .venv/bin/python scripts/superres_grid.py --data data/digits-bin --out grid.png \
      --column greedy=greedy.txt --column "E=1"=e1.txt --column "E=2"=e2.txt [--ids 0 1 2 3]

Each FILE is what fairseq-generate printed (its S-, T- and H- lines). The grid has a
row per image: the low-resolution input (S-), each --column's output (H-), and the
ground truth (T-), on one intensity scale.
"""
import argparse
import json
import math
import os

import numpy as np


def read_generate(path):
    """fairseq-generate's S-, T- and H- lines: {"S"|"T"|"H": {id: intensity list}}."""
    found = {"S": {}, "T": {}, "H": {}}
    with open(path) as f:
        for line in f:
            kind, _, rest = line.partition("-")
            if kind not in found or "\t" not in rest:
                continue
            fields = rest.rstrip("\n").split("\t")
            found[kind][int(fields[0])] = [int(float(v)) for v in fields[-1].split()]
    return found


def image_info(data):
    with open(os.path.join(data, "image.json")) as f:
        return json.load(f)


def pixel_error(outputs, truths, levels):
    """Mean absolute intensity difference and PSNR (peak: the top level) over all pixels.

    outputs, truths: {id: intensity list}, the same ids and lengths.
    """
    if sorted(outputs) != sorted(truths):
        raise ValueError("outputs and ground truth cover different images")
    diff = np.array([np.subtract(outputs[i], truths[i]) for i in sorted(truths)], dtype=float)
    mse = float((diff ** 2).mean())
    peak = levels - 1
    return {"mae": float(np.abs(diff).mean()), "psnr": 10 * math.log10(peak ** 2 / mse) if mse else math.inf}


def grid(path, rows, columns, shapes, levels, title=None):
    """rows: ids; columns: [(name, {id: intensities}, "low"|"high")]; one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), len(columns), figsize=(1.3 * len(columns), 1.3 * len(rows)),
                             squeeze=False)
    for r, image_id in enumerate(rows):
        for c, (name, images, size) in enumerate(columns):
            ax = axes[r][c]
            ax.imshow(np.reshape(images[image_id], shapes[size]), cmap="gray_r", vmin=0, vmax=levels - 1,
                      interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the data-bin (for image.json)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--column", action="append", required=True, metavar="NAME=FILE",
                        help="a fairseq-generate output (FILE without '='); the first also gives "
                        "inputs and ground truth")
    parser.add_argument("--ids", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    args = parser.parse_args(argv)
    info = image_info(args.data)
    shapes = {"low": info["low"], "high": info["high"]}
    columns, first = [], None
    for spec in args.column:
        name, sep, path = spec.rpartition("=")  # names may hold "=" ("E=1"), FILEs may not
        if not sep or not os.path.isfile(path):
            raise SystemExit(f"error: --column wants NAME=FILE with an existing FILE, got {spec!r}")
        found = read_generate(path)
        missing = [i for i in args.ids if i not in found["H"]]
        if missing:
            raise SystemExit(f"error: {path} has no H- line for image(s) {missing}")
        first = first or found
        columns.append((name, found["H"], "high"))
    columns = [("input", first["S"], "low"), *columns, ("truth", first["T"], "high")]
    grid(args.out, args.ids, columns, shapes, info["levels"])
    for name, images, size in columns[1:-1]:
        error = pixel_error(images, {i: first["T"][i] for i in images}, info["levels"])
        print(f"{name}: MAE {error['mae']:.3f}, PSNR {error['psnr']:.2f} dB over {len(images)} images")


if __name__ == "__main__":
    main()
