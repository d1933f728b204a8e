#!/usr/bin/env python
"""Greedy vs blockwise speed of one checkpoint over block sizes and confidence cuts.

For every (block size, --blockwise-confidence) pair, scripts/compare.py's compare()
decodes the same sentences with fairseq's greedy SequenceGenerator and with blockwise
decoding, alternating in this one process, and takes medians over --repeats runs.
Writes a JSON list and a markdown table. Decodes on the GPU when torch sees one (--cpu:
the CPU) and names the device it timed.

  .venv/bin/python scripts/speed.py --data DATA --path CKPT --block-sizes 4 6 8 \
      --confidences 0 0.3 [--batch-size 1] [--max-sentences 100] [--repeats 3] --out work/speed/b1
"""
import argparse
import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import add_data_args, add_device_args, compare, prepare  # noqa: E402

COLUMNS = ("block size", "confidence", "greedy s", "blockwise s", "speedup", "mean accepted block",
           "invocations (greedy / blockwise)", "identical", "BLEU greedy / blockwise")


def row(r):
    return (r["block_size"], r["confidence"], f"{r['greedy_seconds']:.2f}", f"{r['blockwise_seconds']:.2f}",
            f"{r['speedup']:.2f}x", f"{r['mean_accepted_block']:.2f}",
            f"{r['greedy_invocations']} / {r['blockwise_invocations']}", f"{r['identical']}/{r['sentences']}",
            f"{r['bleu_greedy']:.2f} / {r['bleu_blockwise']:.2f}")


def markdown(cells):
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table(results):
    lines = [markdown(COLUMNS), "|" + "---|" * len(COLUMNS)] + [markdown(row(r)) for r in results]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap)
    ap.add_argument("--block-sizes", type=int, nargs="+", required=True)
    ap.add_argument("--confidences", type=float, nargs="+", default=[0.0])
    ap.add_argument("--proposal-vocab", type=int, default=0, help="as --blockwise-proposal-vocab")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-sentences", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    add_device_args(ap)
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    model, task, _, samples, references, _ = prepare(args)
    lang = task.cfg.target_lang
    results = []
    for k in args.block_sizes:
        for confidence in args.confidences:
            r = compare(model, task, samples, references, k, repeats=args.repeats, lang=lang,
                        proposal_vocab=args.proposal_vocab, confidence=confidence)
            r.update(batch_size=args.batch_size, checkpoint=args.path)
            results.append(r)
            print(markdown(row(r)), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"{len(samples)} batches of {args.batch_size} ({args.subset}), medians of {args.repeats} runs, "
                f"timed on {results[0]['device']}, checkpoint {args.path}\n\n{table(results)}\n")


if __name__ == "__main__":
    main()
