#!/usr/bin/env python
"""Greedy (fairseq's SequenceGenerator, beam 1) vs blockwise decoding, side by side.

Both decoders run in this one process on the same batches, alternating, after a
warm-up; times are decoding only (data and model loading are reported apart) and
the ratio is of medians over --repeats runs. Like fairseq's own commands it decodes on
the GPU when torch sees one (--cpu forces the CPU) and says which device it timed.

  .venv/bin/python scripts/compare.py --data data/bible-bin --path ckpt.pt \
      [--batch-size 1] [--block-size K] [--topk 1] [--proposal-vocab N] [--confidence P] [--repeats 3] \
      [--max-sentences 200] [--examples 3] [--cpu]
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


def pick_device(cpu=False):
    """The GPU when torch sees one and --cpu was not given, as fairseq's commands choose."""
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def describe(device):
    """What was timed, in words: the GPU's name, or the CPU's cores and torch threads."""
    if device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def batches(task, subset, batch_size, max_sentences=None, device=torch.device("cpu")):
    """All batches of `subset` on `device`, in dataset order (loading excluded from timing)."""
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    ids = list(range(len(dataset)))[:max_sentences]
    return [utils.move_to_cuda(sample, device) if device.type == "cuda" else sample
            for sample in (dataset.collater([dataset[i] for i in ids[s : s + batch_size]])
                           for s in range(0, len(ids), batch_size))]


def decode(generator, model, samples):
    """Hypothesis token lists by sentence id, and the seconds the decoding took."""
    out = {}
    synchronize = torch.cuda.synchronize if samples and samples[0]["net_input"]["src_tokens"].is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for sample in samples:
            for sid, hypos in zip(sample["id"].tolist(), generator.generate([model], sample)):
                out[sid] = hypos[0]
    synchronize()  # a GPU runs behind the Python that launches its work
    return out, time.perf_counter() - start


def detokenized(task, hypos, lang):
    """Plain-text output lines by sentence id."""
    detok, tgt_dict = Detokenizer(lang), task.target_dictionary
    return {i: detok(tgt_dict.string(h["tokens"], extra_symbols_to_ignore={tgt_dict.eos()})) for i, h in hypos.items()}


def bleu(lines, references):
    """sacrebleu's corpus BLEU of {sentence id: line} against the reference lines."""
    ids = sorted(lines)
    return sacrebleu.corpus_bleu([lines[i] for i in ids], [[references[i] for i in ids]]).score


def compare(model, task, samples, references, block_size, topk=1, min_block=1, repeats=3, lang="en",
            proposal_vocab=0, confidence=0.0, sources=None, examples=0):
    """Medians of greedy and blockwise decoding times, BLEU, exact matches and block statistics,
    and the first `examples` sentences (source, reference, greedy and blockwise output)."""
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
    greedy_lines, blockwise_lines = detokenized(task, greedy_out, lang), detokenized(task, blockwise_out, lang)
    shown = sorted(greedy_out)[:examples]
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
        "bleu_greedy": bleu(greedy_lines, references),
        "bleu_blockwise": bleu(blockwise_lines, references),
        "examples": [{"source": sources[i] if sources else None, "reference": references[i],
                      "greedy": greedy_lines[i], "blockwise": blockwise_lines[i]} for i in shown],
        "device": describe(samples[0]["net_input"]["src_tokens"].device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def raw_lines(data, subset, lang):
    """The untokenised lines of data/raw/SUBSET.LANG (newlines only: prepare_data.py's split)."""
    path = os.path.join(data, "raw", f"{subset}.{lang}")
    if not os.path.exists(path):
        raise SystemExit(f"error: not found: {path} (scripts/prepare_data.py writes it)")
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def add_data_args(ap, subset="test"):
    """--data, --path and --subset: the data-bin, the checkpoint and the split that load(),
    batches() and prepare() read, shared by the scripts that decode a split."""
    ap.add_argument("--data", required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--subset", default=subset)


def add_device_args(ap):
    """--threads and --cpu, shared by the scripts that time decoding."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--cpu", action="store_true", help="decode on the CPU even when torch sees a GPU")


def prepare(args):
    """From parsed --data, --path, --subset, --batch-size, --max-sentences, --threads and --cpu:
    the model (on its device), its task, seconds to load it, the batches, the reference
    and the source lines."""
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in (args.path, args.data):
        if not os.path.exists(path):
            raise SystemExit(f"error: not found: {path}")
    model, task, load_seconds = load(args.path, args.data)
    device = pick_device(args.cpu)
    model.to(device)
    references = raw_lines(args.data, args.subset, task.cfg.target_lang)
    sources = raw_lines(args.data, args.subset, task.cfg.source_lang)
    samples = batches(task, args.subset, args.batch_size, args.max_sentences, device)
    return model, task, load_seconds, samples, references, sources


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=None, help="default: the checkpoint's k")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--min-block", type=int, default=1)
    ap.add_argument("--proposal-vocab", type=int, default=0, help="as --blockwise-proposal-vocab (0: all)")
    ap.add_argument("--confidence", type=float, default=0.0, help="as --blockwise-confidence (0: off)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-sentences", type=int, default=None)
    ap.add_argument("--examples", type=int, default=0, help="also return the first N sentences' outputs")
    add_device_args(ap)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    model, task, load_seconds, samples, references, sources = prepare(args)
    result = compare(model, task, samples, references, args.block_size or model.decoder.block_size,
                     args.topk, args.min_block, args.repeats, task.cfg.target_lang, args.proposal_vocab,
                     args.confidence, sources, args.examples)
    result.update(batch_size=args.batch_size, load_seconds=load_seconds, checkpoint=args.path)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
