#!/usr/bin/env python
"""Measure the width table that --blockwise alone chooses each block's width from (fairseq_bpd/widths.py).

Decodes the first --sentences of a held-out split (valid by default) at each --batch-sizes
(one batch of that size where it is larger), every batch at every width 1..k on its own
(the checkpoint's k), the widths taking turns batch by batch and the rounds repeated
--repeats times, so that every width sees the same load on a shared machine. Times every
block at the batch size still decoding, and every whole decode. Writes, per width, the
tokens a block adds per sentence, the lower quartile of a block's seconds by pooled batch
size and the tokens per second of whole decodes at each batch size, to this model's table
on this machine (where --blockwise looks: fairseq_bpd/widths.py table_path) and to --out if
given. On a CPU of more than one torch thread (--threads), the table's widths then decode
every batch at one thread and at torch's, in turn, and the faster count is kept by batch
size: --blockwise alone decodes each batch under it. Measure again after changing the
machine, torch, its threads or the plugin: the costs are theirs.

  .venv/bin/python scripts/calibrate_widths.py --data DATA --path CKPT \\
      [--batch-sizes 1 8 32 128] [--sentences 48] [--repeats 2] [--threads N] [--out FILE] [--if-missing]
"""
import argparse
import os

from fairseq_bpd import bench
from fairseq_bpd.calibration import REPEATS, SENTENCES, calibrate
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.widths import load_table, save_table, table_path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_data_args(ap, subset="valid")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--sentences", type=int, default=SENTENCES, help="N sentences spread over --subset (at least a batch)")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="rounds over each batch size's batches")
    ap.add_argument("--out", help="also write the table here (e.g. beside the checkpoint)")
    ap.add_argument("--if-missing", action="store_true", help="measure only if this model has no table here yet")
    bench.add_device_args(ap)
    args = ap.parse_args()
    for flag, values in (("--batch-sizes", args.batch_sizes), ("--sentences", [args.sentences]),
                         ("--repeats", [args.repeats])):
        if min(values) < 1:
            ap.error(f"{flag} must be at least 1 (got {min(values)})")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be at least 1 (got {args.threads})")
    if args.out and not writable_file(args.out):
        ap.error(f"--out {args.out}: not a file that can be written (a folder, or under a file)")
    model, task, device, _ = bench.setup(args)
    check_subset(task, args.subset, args.data)
    cached = cached_table(model, device) if args.if_missing else None
    if cached is not None:
        print(f"this model's width table on this machine: {table_path(model, device)}")
        if args.out:
            save_table(cached, args.out)
            print(f"wrote {args.out}")
        return
    table = calibrate(model, task, args.subset, sorted(args.batch_sizes), device, args.sentences, args.repeats)
    print("tokens per block by width: " + " ".join(f"{e:.2f}" for e in table.expected))
    for path in filter(None, (table_path(model, device), args.out)):
        save_table(table, path)
        print(f"wrote {path}")
    chosen = {b: table.width(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)}
    print("width chosen by batch size: " + " ".join(f"{b}:{w}" for b, w in chosen.items()))
    if table.threads:
        print("torch threads by batch size: " + " ".join(f"{b}:{t}" for b, t in table.threads.items()))


def cached_table(model, device):
    """This model's table in the cache, or None where there is none or it is broken or of
    another k (--if-missing then measures it again, as decoding's warning says)."""
    path = table_path(model, device)
    if not os.path.exists(path):
        return None
    try:
        table = load_table(path)
    except BlockwiseRequestError as error:
        print(f"{error}: measuring it again")
        return None
    return table if len(table.expected) == bench.full_width(model) else None


def writable_file(path):
    """Whether `path` is a file or can become one: not a folder, and its nearest existing
    parent a folder (checked before minutes of measuring, not after)."""
    if os.path.isdir(path) or path.endswith(("/", os.sep)):  # a trailing slash names a folder
        return False
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent)


def check_subset(task, subset, data):
    """Load `subset` of the task's data, or refuse on one line naming it and the splits `data` holds."""
    try:
        task.load_dataset(subset)
    except FileNotFoundError:
        held = sorted({name.split(".")[0] for name in os.listdir(data) if name.endswith(".idx")})
        raise SystemExit(f"error: --subset {subset}: {data} holds no such split (it holds: {', '.join(held)})") from None


if __name__ == "__main__":
    main()
