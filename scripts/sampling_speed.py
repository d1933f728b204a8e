#!/usr/bin/env python
"""fairseq's --sampling --beam 1 vs --blockwise --sampling, side by side in one process.

For each batch size, temperature and sampling rule (plain, top-10, top-p 0.9) both
decoders sample the same batches, alternating, after a warm-up; times are decoding
only, the ratio is of medians over --repeats runs. Tokens per invocation (a sentence's
output tokens over the decoder passes it took; fairseq's is 1) and the mean accepted
block are deterministic at a --seed. The mean output length of each decoder is printed
beside them: the two sample the same distribution, so they agree up to noise.

  .venv/bin/python scripts/sampling_speed.py --data data/bible-bin --path work/fixture/checkpoint.pt \
      [--batch-sizes 1 32] [--temperatures 0.7 1.0] [--max-sentences 100] [--repeats 3] \
      [--seed 1] [--no-timing] [--json results.json] [--cpu]

It decodes on the GPU when torch sees one (--cpu forces the CPU), as fairseq's commands do.
"""
import argparse
import json
import os
import statistics
import sys

import torch
from fairseq import utils
from fairseq.search import Sampling
from fairseq.sequence_generator import SequenceGenerator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import add_data_args, batches, decode, load  # noqa: E402

RULES = {"plain": {}, "top-10": {"sampling_topk": 10}, "top-p 0.9": {"sampling_topp": 0.9}}


def generators(model, task, temperature, rule):
    """fairseq's sampling generator and the blockwise sampler for one setting."""
    from fairseq_bpd.generator import BlockwiseStats
    from fairseq_bpd.sampling import SpeculativeSampler

    d = task.target_dictionary
    fairseq_generator = SequenceGenerator([model], d, beam_size=1, temperature=temperature,
                                          search_strategy=Sampling(d, **rule))
    blockwise = SpeculativeSampler(model, d, block_size=model.decoder.block_size, temperature=temperature,
                                   stats=BlockwiseStats(), **rule)
    return fairseq_generator, blockwise


def mean_length(hypos):
    return statistics.mean(len(h["tokens"]) for h in hypos.values())


def measure(model, task, samples, temperature, rule, repeats, seed, timing):
    """One setting's row: times (None without timing), tokens per invocation, mean block."""
    fairseq_generator, blockwise = generators(model, task, temperature, rule)
    torch.manual_seed(seed)
    hypos, _ = decode(blockwise, model, samples)  # the counted run, at the seed
    stats = blockwise.stats
    row = {
        "tokens_per_invocation": stats.tokens / stats.invocations,
        "mean_accepted_block": stats.mean_accepted_block(),
        "blockwise_mean_length": mean_length(hypos),
    }
    torch.manual_seed(seed)
    fairseq_hypos, _ = decode(fairseq_generator, model, samples)  # also the warm-up
    row["fairseq_mean_length"] = mean_length(fairseq_hypos)
    if timing:
        times = {"fairseq": [], "blockwise": []}
        for _ in range(repeats):
            for name, generator in (("fairseq", fairseq_generator), ("blockwise", blockwise)):
                torch.manual_seed(seed)  # every timed run samples what the counted runs sampled
                times[name].append(decode(generator, model, samples)[1])
        row["fairseq_s"], row["blockwise_s"] = (statistics.median(times[n]) for n in ("fairseq", "blockwise"))
        row["speedup"] = row["fairseq_s"] / row["blockwise_s"]
    return row


def markdown(results, timing):
    head = "| batch | temperature | rule | tokens/invocation | mean block | mean length fairseq / blockwise |"
    lines = [head + (" fairseq s | blockwise s | speedup |" if timing else ""),
             "|---" * (6 + 3 * timing) + "|"]
    for r in results:
        line = (f"| {r['batch_size']} | {r['temperature']} | {r['rule']} | {r['tokens_per_invocation']:.3f} "
                f"| {r['mean_accepted_block']:.3f} | {r['fairseq_mean_length']:.2f} / {r['blockwise_mean_length']:.2f} |")
        if timing:
            line += f" {r['fairseq_s']:.2f} | {r['blockwise_s']:.2f} | {r['speedup']:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(ap)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    ap.add_argument("--max-sentences", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-timing", action="store_true", help="only the deterministic token counts")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--cpu", action="store_true", help="decode on the CPU even when a GPU is there")
    args = ap.parse_args()
    model, task, _ = load(args.path, args.data)
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        model.cuda()
    print(f"decoding on {torch.cuda.get_device_name() if cuda else 'the CPU'}", flush=True)
    results = []
    for batch_size in args.batch_sizes:
        samples = batches(task, args.subset, batch_size, args.max_sentences)
        samples = [utils.move_to_cuda(s) for s in samples] if cuda else samples
        for temperature in args.temperatures:
            for rule in args.rules:
                row = measure(model, task, samples, temperature, RULES[rule], args.repeats, args.seed,
                              not args.no_timing)
                results.append({"batch_size": batch_size, "temperature": temperature, "rule": rule, **row})
                print(json.dumps(results[-1]), flush=True)
    print(markdown(results, not args.no_timing))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
