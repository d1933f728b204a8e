#!/usr/bin/env python
"""Greedy (fairseq's SequenceGenerator, beam 1) vs blockwise decoding, side by side.

Both decoders run in this one process on the same batches, alternating, after a
warm-up; times are decoding only (data and model loading are reported apart) and
the ratio is of medians over --repeats runs.

  .venv/bin/python scripts/compare.py --data data/bible-bin --path ckpt.pt \
      [--batch-size 1] [--block-size K] [--topk 1] [--proposal-vocab N] [--confidence P] [--repeats 3] [--max-sentences 200]
"""
import argparse
import json
import os
import statistics
import sys
import time

import sacrebleu
import torch
from fairseq import checkpoint_utils, utils
from fairseq.sequence_generator import SequenceGenerator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from detok import Detokenizer  # noqa: E402

PLUGIN = os.path.join(os.path.dirname(HERE), "fairseq_bpd")


def load(path, data):
    """The model (eval mode) and its task, with the plugin imported; seconds taken."""
    start = time.perf_counter()
    utils.import_user_module(argparse.Namespace(user_dir=PLUGIN))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    return models[0].eval(), task, time.perf_counter() - start


def batches(task, subset, batch_size, max_sentences=None):
    """All batches of `subset` in memory, in dataset order (loading excluded from timing)."""
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    ids = list(range(len(dataset)))[:max_sentences]
    return [dataset.collater([dataset[i] for i in ids[s : s + batch_size]])
            for s in range(0, len(ids), batch_size)]


def decode(generator, model, samples):
    """Hypothesis token lists by sentence id, and the seconds the decoding took."""
    out = {}
    start = time.perf_counter()
    with torch.no_grad():
        for sample in samples:
            for sid, hypos in zip(sample["id"].tolist(), generator.generate([model], sample)):
                out[sid] = hypos[0]
    return out, time.perf_counter() - start


def bleu(task, hypos, references, lang):
    detok = Detokenizer(lang)
    lines = [detok(task.target_dictionary.string(hypos[i]["tokens"], extra_symbols_to_ignore={task.target_dictionary.eos()}))
             for i in sorted(hypos)]
    return sacrebleu.corpus_bleu(lines, [[references[i] for i in sorted(hypos)]]).score


def compare(model, task, samples, references, block_size, topk=1, min_block=1, repeats=3, lang="en",
            proposal_vocab=0, confidence=0.0):
    """Medians of greedy and blockwise decoding times, BLEU, exact matches and block statistics."""
    from fairseq_bpd.generator import BlockwiseGenerator, BlockwiseStats

    tgt_dict = task.target_dictionary
    greedy = SequenceGenerator([model], tgt_dict, beam_size=1)
    blockwise = BlockwiseGenerator(model, tgt_dict, block_size=block_size, topk=topk, min_block=min_block,
                                   proposal_vocab=proposal_vocab, confidence=confidence)
    decode(greedy, model, samples[:1])  # warm-up
    decode(blockwise, model, samples[:1])
    times = {"greedy": [], "blockwise": []}
    for _ in range(repeats):
        greedy_out, seconds = decode(greedy, model, samples)
        times["greedy"].append(seconds)
        blockwise.stats = BlockwiseStats()  # count the last run only
        blockwise_out, seconds = decode(blockwise, model, samples)
        times["blockwise"].append(seconds)
    same = sum(greedy_out[i]["tokens"].tolist() == blockwise_out[i]["tokens"].tolist() for i in greedy_out)
    stats = blockwise.stats
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "sentences": len(greedy_out),
        "block_size": block_size, "topk": topk, "min_block": min_block, "proposal_vocab": proposal_vocab,
        "confidence": confidence,
        "greedy_seconds": median["greedy"], "blockwise_seconds": median["blockwise"],
        "speedup": median["greedy"] / median["blockwise"],
        "greedy_invocations": sum(len(h["tokens"]) for h in greedy_out.values()),
        "blockwise_invocations": stats.invocations,
        "mean_accepted_block": stats.mean_accepted_block(),
        "accepted_histogram": dict(sorted(stats.accepted.items())),
        "identical": same,
        "bleu_greedy": bleu(task, greedy_out, references, lang),
        "bleu_blockwise": bleu(task, blockwise_out, references, lang),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def prepare(args):
    """From parsed --data, --path, --subset, --batch-size, --max-sentences and --threads:
    the model, its task, seconds to load it, the batches and the reference lines."""
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in (args.path, args.data):
        if not os.path.exists(path):
            raise SystemExit(f"error: not found: {path}")
    model, task, load_seconds = load(args.path, args.data)
    references = open(os.path.join(args.data, "raw", f"{args.subset}.{task.cfg.target_lang}")).read().splitlines()
    return model, task, load_seconds, batches(task, args.subset, args.batch_size, args.max_sentences), references


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--subset", default="test")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=None, help="default: the checkpoint's k")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--min-block", type=int, default=1)
    ap.add_argument("--proposal-vocab", type=int, default=0, help="as --blockwise-proposal-vocab (0: all)")
    ap.add_argument("--confidence", type=float, default=0.0, help="as --blockwise-confidence (0: off)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-sentences", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    model, task, load_seconds, samples, references = prepare(args)
    result = compare(model, task, samples, references, args.block_size or model.decoder.block_size,
                     args.topk, args.min_block, args.repeats, task.cfg.target_lang, args.proposal_vocab,
                     args.confidence)
    result.update(batch_size=args.batch_size, load_seconds=load_seconds, checkpoint=args.path)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
