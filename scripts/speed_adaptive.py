#!/usr/bin/env python
"""Greedy, fixed block widths and --blockwise-adaptive, side by side at several batch sizes.

For each batch size every decoder runs once over the same sentences per repeat, in turn,
after a warm-up batch each; the table gives medians over --repeats. Each adaptive run
starts from nothing (rates and costs learnt during the run, as in a fresh
fairseq-generate), so its calibration is inside the time. Writes OUT.json and OUT.md.

  .venv/bin/python scripts/speed_adaptive.py --data DATA --path CKPT \
      [--batch-sizes 1 8 32 128] [--block-sizes 2 4 8] [--max-sentences 256] [--repeats 3] --out work/speed/adaptive
"""
import argparse
import json
import os
import statistics
import sys

from fairseq.sequence_generator import SequenceGenerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import add_data_args, add_device_args, batches, decode, describe, prepare  # noqa: E402

COLUMNS = ("batch", "decoder", "seconds", "speedup", "invocations", "mean accepted block",
           "widths chosen", "identical")


def decoders(model, tgt_dict, block_sizes):
    """Fresh generators by name: greedy, then each fixed width, then adaptive up to the widest."""
    from fairseq_bpd.adaptive import AdaptiveBlockwiseGenerator
    from fairseq_bpd.generator import BlockwiseGenerator

    made = {"greedy": SequenceGenerator([model], tgt_dict, beam_size=1)}
    for k in block_sizes:
        made[f"width {k}"] = BlockwiseGenerator(model, tgt_dict, block_size=k)
    made["adaptive"] = AdaptiveBlockwiseGenerator(model, tgt_dict, block_size=max(block_sizes))
    return made


def measure(model, tgt_dict, samples, block_sizes, repeats):
    """Per decoder: median seconds, outputs and statistics of the last run."""
    for generator in decoders(model, tgt_dict, block_sizes).values():
        decode(generator, model, samples[:1])  # warm-up
    seconds, last = {}, {}
    for _ in range(repeats):
        for name, generator in decoders(model, tgt_dict, block_sizes).items():
            out, took = decode(generator, model, samples)
            seconds.setdefault(name, []).append(took)
            last[name] = (out, getattr(generator, "stats", None))
    return {name: (statistics.median(seconds[name]), *last[name]) for name in seconds}


def rows(batch_size, measured):
    greedy_seconds, greedy_out, _ = measured["greedy"]
    for name, (took, out, stats) in measured.items():
        same = sum(out[i]["tokens"].tolist() == greedy_out[i]["tokens"].tolist() for i in greedy_out)
        yield {
            "batch_size": batch_size, "decoder": name, "seconds": took, "speedup": greedy_seconds / took,
            "invocations": stats.invocations if stats else sum(len(h["tokens"]) for h in out.values()),
            "mean_accepted_block": stats.mean_accepted_block() if stats else 1.0,
            "accepted_histogram": dict(sorted(stats.accepted.items())) if stats else {},
            "widths_chosen": dict(sorted(stats.widths.items())) if stats else {},
            "identical": same, "sentences": len(greedy_out),
        }


def markdown(r):
    widths = " ".join(f"{w}:{n}" for w, n in r["widths_chosen"].items())
    cells = (r["batch_size"], r["decoder"], f"{r['seconds']:.2f}", f"{r['speedup']:.2f}x", r["invocations"],
             f"{r['mean_accepted_block']:.2f}", widths, f"{r['identical']}/{r['sentences']}")
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[2, 4, 8],
                    help="fixed widths to time; adaptive chooses up to the largest")
    ap.add_argument("--max-sentences", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    add_device_args(ap)
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    args.batch_size = args.batch_sizes[0]
    model, task = prepare(args)[:2]  # checks the paths, sets --threads, puts the model on its device
    device = next(model.parameters()).device
    if max(args.block_sizes) > model.decoder.block_size:
        raise SystemExit(f"error: --block-sizes go up to the checkpoint's {model.decoder.block_size} heads")
    results = []
    for batch_size in args.batch_sizes:
        samples = batches(task, args.subset, batch_size, args.max_sentences, device)
        measured = measure(model, task.target_dictionary, samples, args.block_sizes, args.repeats)
        for r in rows(batch_size, measured):
            results.append(r)
            print(markdown(r), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"first {args.max_sentences} sentences of {args.subset}, medians of {args.repeats} runs, "
                f"timed on {describe(device)}, checkpoint {args.path}\n\n"
                + "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
                + "\n".join(markdown(r) for r in results) + "\n")


if __name__ == "__main__":
    main()
