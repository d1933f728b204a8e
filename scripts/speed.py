#!/usr/bin/env python
"""Decoding speed of decoder specs beside fairseq's own decoding, at several batch sizes: one table.

Each --rows entry is a decoder spec, KIND[:VALUE] then options after commas:

  greedy        fairseq's greedy, as fairseq-generate --beam 1 builds it: every row's
                baseline, always timed (identity and speedups are against it)
  width:N       blockwise, a chain of width N (--block-size N)
  default       --blockwise alone: each block's width from this model's width table on this
                machine (scripts/calibrate_widths.py), else width 1; `default,widths=FILE`
                names a table
  k             blockwise at the checkpoint's full width (--block-size k)
  adaptive[:N]  --blockwise-adaptive, widths up to N (default k)
  tree:N        --blockwise-tree N at width k, its rates from --tree-rates (default: the built-in table)
  sampling[:N]  --sampling at width N (default k), against fairseq's own --sampling --beam 1
                with the same temperature and top-k/top-p, both seeded alike; no identity
  distance:E    --blockwise-distance E at width k (a task of numbers: superres_blockwise)
  ctranslate2   CTranslate2's greedy on the checkpoint without its heads, in a process of its
                own (scripts/ctranslate2_greedy.py); skipped with a message without ctranslate2

Options are BlockwiseOptions' fields: width:8,topk=2  k,proposal_vocab=2000,confidence=0.3
width:3,min_block=2  sampling,temperature=0.7,sampling_topp=0.9; ctranslate2 takes
compute_type=int8. --proposal-lexicon FILE gives every blockwise row without its own
proposal_lexicon option that lexicon (--blockwise-proposal-lexicon; a draft's), read once. Per batch size every decoder decodes the same sentences in turn, round
by round, after a warm-up, and its time is the median over --repeats rounds (bench.Timer);
a blockwise decoder is built anew each round, so an adaptive one learns from nothing each
time, as a fresh fairseq-generate does. Writes OUT.json and OUT.md, naming the device,
threads and commit. Decodes on the GPU when torch sees one (--cpu: the CPU).

  .venv/bin/python scripts/speed.py --data DATA --path CKPT --rows greedy width:1 width:3 k adaptive \
      tree:16 [--batch-sizes 1 32] [--max-sentences N] [--repeats 3] [--threads N] [--tree-rates FILE] \
      [--proposal-lexicon FILE] --out OUT
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

import torch

from fairseq_bpd import bench
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.options import read_lexicon

HERE = os.path.dirname(os.path.abspath(__file__))
# Each kind's options from its VALUE (None when not given) and the checkpoint's k.
KINDS = {
    "width": lambda value, k: {"block_size": int(value)},
    "default": lambda value, k: {},
    "k": lambda value, k: {"block_size": k},
    "adaptive": lambda value, k: {"block_size": int(value or k), "adaptive": True},
    "tree": lambda value, k: {"block_size": k, "tree": int(value)},
    "sampling": lambda value, k: {"block_size": int(value or k), "sampling": True},
    "distance": lambda value, k: {"block_size": k, "distance": float(value)},
}
SAMPLING = ("temperature", "sampling_topk", "sampling_topp")  # what fairseq's sampling shares with ours
CT2_MISSING = ("skipping the ctranslate2 row: ctranslate2 is not installed "
               "(.venv/bin/pip install ctranslate2; it does not depend on torch)")


def literal(text):
    """A spec option's value: a JSON number or boolean, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_spec(spec, k):
    """'width:8,topk=2' -> ("blockwise", {"block_size": 8, "topk": 2}); greedy and ctranslate2 keep their kind."""
    head, *pairs = spec.split(",")
    kind, _, value = head.partition(":")
    options = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals:
            raise SystemExit(f"error: --rows {spec}: options are NAME=VALUE (got {pair!r})")
        options[key.replace("-", "_")] = literal(text)
    if kind in ("greedy", "ctranslate2"):
        return kind, options
    if kind not in KINDS:
        raise SystemExit(f"error: --rows {spec}: unknown kind {kind!r} (known: greedy, ctranslate2, {', '.join(KINDS)})")
    try:
        return "blockwise", {**KINDS[kind](value or None, k), **options}
    except (TypeError, ValueError):
        raise SystemExit(f"error: --rows {spec}: {kind} takes a number, as {kind}:8") from None


def fairseq_generator(task, model, lengths=None, **generation):
    """What fairseq-generate builds for this task at --beam 1 with `generation`'s flags (greedy,
    or --sampling). The task may fix the output lengths in the flags (superres_blockwise:
    exactly its pixel count); they are copied into `lengths` for the blockwise decoders."""
    args = argparse.Namespace(beam=1, **generation)
    generator = task.build_generator([model], args)
    if lengths is not None:
        lengths.update({name: getattr(args, name) for name in ("max_len_a", "max_len_b", "min_len") if hasattr(args, name)})
    return generator


def sampling_baseline(options):
    """The name of fairseq's sampling with a sampling row's temperature and top-k/top-p."""
    return ",".join(["fairseq sampling", *(f"{key}={options[key]}" for key in SAMPLING if key in options)])


class CTranslate2:
    """CTranslate2's greedy (scripts/ctranslate2_greedy.py), each run in a new process that
    warms up on the first batch and times the rest itself. The checkpoint is converted once."""

    stats = None

    def __init__(self, args, task, workdir, lengths, device, threads, compute_type="float32"):
        self.script, self.workdir, self.task = os.path.join(HERE, "ctranslate2_greedy.py"), workdir, task
        self.model = os.path.join(workdir, "ctranslate2")
        self.env = {**os.environ, "CT2_USE_MKL": os.environ.get("CT2_USE_MKL", "0")}  # oneDNN: see the script
        self.options = ["--threads", str(threads), "--device", "cuda" if device.type == "cuda" else "cpu",
                        "--compute-type", compute_type, "--max-length", str(lengths.get("max_len_b", 200))]
        if os.path.exists(self.model):  # converted for an earlier batch size
            return
        convert = subprocess.run([sys.executable, self.script, "convert", args.path, args.data, self.model,
                                  "--source-lang", task.cfg.source_lang, "--target-lang", task.cfg.target_lang],
                                 env=self.env, capture_output=True, text=True)
        if convert.returncode:
            raise RuntimeError(convert.stderr[-3000:])

    def warm_up(self, samples):
        pass  # every run's process warms itself up

    def run(self, samples, clock=None):
        src_dict, tgt_dict = self.task.source_dictionary, self.task.target_dictionary
        ids = [sid for sample in samples for sid in sample["id"].tolist()]
        sources = [[[src_dict[t] for t in row.tolist() if t not in (src_dict.pad(), src_dict.eos())]
                    for row in sample["net_input"]["src_tokens"]] for sample in samples]
        batches, out = os.path.join(self.workdir, "batches.json"), os.path.join(self.workdir, "out.json")
        with open(batches, "w") as f:
            json.dump(sources, f)
        subprocess.run([sys.executable, self.script, "translate", self.model, batches, out, *self.options],
                       env=self.env, check=True)
        with open(out) as f:
            result = json.load(f)
        hypos = {sid: {"tokens": torch.tensor([tgt_dict.index(t) for t in tokens] + [tgt_dict.eos()])}
                 for sid, tokens in zip(ids, result["outputs"])}
        return hypos, result["seconds"]


def ctranslate2_available():
    return subprocess.run([sys.executable, "-c", "import ctranslate2"], capture_output=True).returncode == 0


def decoders(parsed, model, task, args, device, workdir, notes):
    """{name: decoder} for one batch size: greedy first, each sampling baseline before its rows."""
    lengths = {}
    greedy = functools.partial(fairseq_generator, task, model, lengths)
    greedy()  # fills `lengths`
    made = {"greedy": bench.Decoder(greedy, model)}
    for spec, (kind, options) in parsed.items():
        if kind == "ctranslate2":
            if not ctranslate2_available():
                print(CT2_MISSING, file=sys.stderr, flush=True)
                notes.add(CT2_MISSING)
                continue
            made[spec] = CTranslate2(args, task, workdir, lengths, device, torch.get_num_threads(), **options)
        elif kind == "blockwise":
            seed = None
            if options.get("sampling"):
                seed = args.seed
                shared = {key: options[key] for key in SAMPLING if key in options}
                made.setdefault(sampling_baseline(options), bench.Decoder(
                    functools.partial(fairseq_generator, task, model, sampling=True, **shared), model, seed))
            options = decoding_options(options, args)
            build = functools.partial(bench.blockwise_generator, model, task.target_dictionary, {**lengths, **options})
            made[spec] = bench.Decoder(build, model, seed)
    return made


def decoding_options(options, args):
    """A blockwise row's options as its generators are built with them: --tree-rates for a
    tree row without rates of its own, and its lexicon read (once, not every round)."""
    if options.get("tree") and args.tree_rates:
        options = {"tree_rates": args.tree_rates, **options}
    if isinstance(options.get("proposal_lexicon"), str):
        options = {**options, "proposal_lexicon": read_once(options["proposal_lexicon"])}
    return options


def refuse_early(parsed, model, task, args):
    """Build each blockwise row's generator once, so that a row the model cannot decode (a
    lexicon for heads that read none, a flag it refuses) is refused by name before any
    decoder is timed."""
    for spec, (kind, options) in parsed.items():
        if kind != "blockwise":
            continue
        try:
            bench.blockwise_generator(model, task.target_dictionary, decoding_options(options, args))
        except BlockwiseRequestError as error:
            raise SystemExit(f"error: --rows {spec}: {error}") from None


def give_lexicon(parsed, path):
    """--proposal-lexicon: every blockwise row of `parsed` without a lexicon of its own gets `path`."""
    for kind, options in parsed.values():
        if kind == "blockwise":
            options.setdefault("proposal_lexicon", path)


@functools.lru_cache(maxsize=None)
def read_once(path):
    """The ProposalLexicon in `path`, read and bound once for all rounds and rows, as one
    fairseq-generate reads it once."""
    lexicon, problem = read_lexicon(path)
    if problem:
        raise SystemExit(f"error: {problem}")
    return lexicon


def rows(batch_size, timings, parsed, score):
    """A Row per decoder; a sampler's speedup is over fairseq's sampling, and it has no identity."""
    greedy = timings["greedy"]
    made = []
    for name, timing in timings.items():
        options = parsed.get(name, ("greedy", {}))[1]
        sampled = name.startswith("fairseq sampling") or options.get("sampling")
        baseline = sampling_baseline(options) if options.get("sampling") else name if sampled else "greedy"
        made.append(bench.row(name, batch_size, timing, baseline, timings[baseline],
                              None if sampled else greedy.hypos, score, options))
    return made


def examples(task, data, subset, timings, count):
    """The first `count` sentences: source, reference and each decoder's output."""
    detok = bench.detokenizer(task)
    sources = bench.raw_lines(data, subset, task.cfg.source_lang) or {}
    references = bench.raw_lines(data, subset, task.cfg.target_lang) or {}
    shown = sorted(timings["greedy"].hypos)[:count]
    return [{"id": i, "source": sources[i] if sources else None, "reference": references[i] if references else None,
             **{name: detok(timing.hypos[i]["tokens"]) for name, timing in timings.items()}} for i in shown]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_data_args(ap)
    ap.add_argument("--rows", nargs="+", default=["greedy", "k"], help="decoder specs (above)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--max-sentences", type=int, default=None, help="the first N of --subset (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds; times are their medians")
    ap.add_argument("--tree-rates", help="scripts/tree_rates.py's file, for the tree rows")
    ap.add_argument("--proposal-lexicon", help="--blockwise-proposal-lexicon for every blockwise row (a draft's)")
    ap.add_argument("--seed", type=int, default=1, help="torch's seed before every sampling run")
    ap.add_argument("--examples", type=int, default=0, help="also write the first N sentences' outputs")
    bench.add_device_args(ap)
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    for spec in args.rows:  # a malformed spec is refused before the model loads (any k will do)
        parse_spec(spec, 0)
    if args.proposal_lexicon:  # so is an unreadable lexicon
        read_once(args.proposal_lexicon)
    model, task, device, load_seconds = bench.setup(args)
    task.cfg.blockwise = False  # the baseline is fairseq's own search, whatever the checkpoint trained with
    parsed = {spec: parse_spec(spec, bench.full_width(model)) for spec in args.rows}
    if args.proposal_lexicon:
        give_lexicon(parsed, args.proposal_lexicon)
    refuse_early(parsed, model, task, args)
    references = bench.raw_lines(args.data, args.subset, task.cfg.target_lang)
    if references:
        detok = bench.detokenizer(task)
        score = lambda hypos: bench.bleu({i: detok(h["tokens"]) for i, h in hypos.items()}, references)  # noqa: E731
    else:
        score = None
    run = {"checkpoint": args.path, "subset": args.subset, "repeats": args.repeats,
           "device": bench.describe(device), "threads": torch.get_num_threads(), "commit": bench.commit(),
           "torch": torch.__version__, "load seconds": round(load_seconds, 1)}
    print(", ".join(f"{key} {value}" for key, value in run.items()), flush=True)
    table, notes, shown = [], set(), []
    with tempfile.TemporaryDirectory() as workdir:
        for batch_size in args.batch_sizes:
            samples = bench.batches(task, args.subset, batch_size, args.max_sentences, device)
            timings = bench.Timer(args.repeats).run(decoders(parsed, model, task, args, device, workdir, notes), samples)
            for r in rows(batch_size, timings, parsed, score):
                table.append(r)
                print(bench.markdown(r), flush=True)
            if args.examples and not shown:
                shown = examples(task, args.data, args.subset, timings, args.examples)
    bench.write_table(args.out, run, table, sorted(notes), shown)
    print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
