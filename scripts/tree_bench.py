#!/usr/bin/env python
"""The chain vs --blockwise-tree of several sizes on one checkpoint: tokens per invocation, cost, speed.

Untimed (the default): decodes the sentences once per layout at --batch-sizes' first
size and reports what is deterministic: mean accepted tokens per invocation, the
rates' prediction of it, and identity with fairseq's greedy. --timed adds, per batch
size, the medians over --repeats of greedy and every layout, run alternately in this
one process: seconds, speedup over greedy, and an invocation's cost relative to a
greedy step. The rates come from --rates, else are measured on --rates-subset
(scripts/tree_rates.py) and written to OUT.rates.json.

  .venv/bin/python scripts/tree_bench.py --data DATA --path CKPT [--sizes 0 4 8 16 32 64] \
      [--max-sentences 200] [--batch-sizes 32 1] [--timed] [--repeats 3] [--chain-widths 3 4] --out work/tree/fixture

--chain-widths adds chains narrower than the checkpoint's k (rows "width W"): trees spend
their nodes where a narrower chain saves rows, so both are measured side by side.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from fairseq.sequence_generator import SequenceGenerator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from compare import add_data_args, batches, decode, load  # noqa: E402
from speed import markdown  # noqa: E402

from fairseq_bpd.generator import BlockwiseGenerator, BlockwiseStats  # noqa: E402
from fairseq_bpd.tree import default_rates, load_rates  # noqa: E402


ACCEPTED = ("tree (0: chain)", "nodes", "expected tokens per block (rates)", "mean accepted block",
            "tokens per invocation", "invocations", "greedy steps", "identical", "sentences")
TIMED = ("batch", "tree (0: chain)", "greedy s", "tree s", "speedup", "invocation cost in greedy steps")


def cells(values):
    return markdown(f"{v:.3f}" if isinstance(v, float) else v for v in values)


def header(columns):
    return markdown(columns) + "\n|" + "---|" * len(columns)


def layouts(model, task, sizes, rates, proposal_vocab, chain_widths=()):
    """A generator per tree size (0: the chain of k), by size, then per narrower chain, by "width W"."""
    k = model.decoder.block_size
    generators = {size: BlockwiseGenerator(model, task.target_dictionary, block_size=k, tree=size, tree_rates=rates,
                                           proposal_vocab=proposal_vocab) for size in sizes}
    for width in chain_widths:
        generators[f"width {width}"] = BlockwiseGenerator(model, task.target_dictionary, block_size=width,
                                                          proposal_vocab=proposal_vocab)
    return generators


def accepted(generators, greedy_out, model, samples, rates):
    """Per layout: deterministic statistics of one decoding of `samples`."""
    rows = []
    print(header(ACCEPTED), flush=True)
    for size, generator in generators.items():
        out, _ = decode(generator, model, samples)
        stats = generator.stats
        rows.append({
            "tree": size, "nodes": generator.layout.size - 1,
            "expected_tokens_per_block": generator.layout.expected_tokens(rates),
            "mean_accepted_block": stats.mean_accepted_block(),
            "tokens_per_invocation": stats.tokens / stats.invocations,
            "invocations": stats.invocations, "greedy_steps": sum(len(h["tokens"]) for h in greedy_out.values()),
            "identical": sum(out[i]["tokens"].tolist() == greedy_out[i]["tokens"].tolist() for i in greedy_out),
            "sentences": len(greedy_out),
        })
        print(cells(rows[-1].values()), flush=True)
    return rows


def timed(generators, greedy, model, samples, repeats):
    """Per layout: medians of seconds over `repeats` alternating runs, against greedy's."""
    decode(greedy, model, samples[:1])  # warm-up
    seconds = {"greedy": []} | {size: [] for size in generators}
    invocations = {}
    for _ in range(repeats):
        greedy_out, s = decode(greedy, model, samples)
        seconds["greedy"].append(s)
        for size, generator in generators.items():
            generator.stats = BlockwiseStats()  # count this run only
            _, s = decode(generator, model, samples)
            seconds[size].append(s)
            invocations[size] = generator.stats.invocations
    median = {name: statistics.median(s) for name, s in seconds.items()}
    step = median["greedy"] / sum(len(h["tokens"]) for h in greedy_out.values())
    return [{"tree": size, "greedy_seconds": median["greedy"], "seconds": median[size],
             "speedup": median["greedy"] / median[size],
             "invocation_cost_in_greedy_steps": median[size] / invocations[size] / step} for size in generators]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap)
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 4, 8, 16, 32, 64], help="0: the chain")
    ap.add_argument("--rates", help="scripts/tree_rates.py's file, or 'default' for the built-in "
                    "table (default: measure on --rates-subset)")
    ap.add_argument("--rates-subset", default="valid")
    ap.add_argument("--max-sentences", type=int, default=200)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32])
    ap.add_argument("--proposal-vocab", type=int, default=0, help="as --blockwise-proposal-vocab")
    ap.add_argument("--timed", action="store_true", help="also time greedy and every layout per batch size")
    ap.add_argument("--chain-widths", type=int, nargs="*", default=[], help="chains of these widths besides k's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", required=True, help="writes OUT.json (and OUT.rates.json when measuring)")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rates_path = args.rates or args.out + ".rates.json"
    if args.rates is None:
        subprocess.run([sys.executable, os.path.join(HERE, "tree_rates.py"), "--data", args.data, "--path", args.path,
                        "--subset", args.rates_subset, "--out", rates_path]
                       + (["--threads", str(args.threads)] if args.threads else []), check=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, task, _ = load(args.path, args.data)
    rates = default_rates(model.decoder.block_size - 1) if args.rates == "default" else load_rates(rates_path)
    result = {"checkpoint": args.path, "rates": rates_path, "subset": args.subset, "threads": torch.get_num_threads()}
    greedy = SequenceGenerator([model], task.target_dictionary, beam_size=1)
    for batch_size in args.batch_sizes:
        samples = batches(task, args.subset, batch_size, args.max_sentences)
        generators = layouts(model, task, args.sizes, rates, args.proposal_vocab, args.chain_widths)
        if batch_size == args.batch_sizes[0]:
            greedy_out, _ = decode(greedy, model, samples)
            result["accepted"] = accepted(generators, greedy_out, model, samples, rates)
            result["accepted_batch_size"] = batch_size
        if args.timed:
            result[f"timed_batch_{batch_size}"] = timed(generators, greedy, model, samples, args.repeats)
            print(header(TIMED), flush=True)
            for row in result[f"timed_batch_{batch_size}"]:
                print(cells([batch_size, *row.values()]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
