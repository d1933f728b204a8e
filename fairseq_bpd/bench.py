"""The benchmark's library: load a checkpoint, batch a split, decode, time, tabulate.

scripts/speed.py (every speed row), scripts/profile_invocation.py and the paper
tables (scripts/benchmark.py) share it, so that every number is measured one way:
decoding only (loading and batching apart), every decoder warmed up, the decoders
alternating round by round on the same batches in one process (a machine that slows
down mid-run slows them all), medians over the rounds. The plugin never imports this
module (fairseq_bpd/__init__.py): fairseq-generate does not load it.
"""
import argparse
import collections
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import time

import sacrebleu
import numpy as np
import torch
from fairseq import checkpoint_utils, utils
from fairseq.data import encoders

PLUGIN = os.path.dirname(os.path.abspath(__file__))


def load(path, data, overrides=None):
    """The model (eval mode) and its task from a checkpoint, with the plugin imported; seconds taken."""
    start = time.perf_counter()
    utils.import_user_module(argparse.Namespace(user_dir=PLUGIN))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": data, **(overrides or {})})
    return models[0].eval(), task, time.perf_counter() - start


def pick_device(cpu=False):
    """The GPU when torch sees one and --cpu was not given, as fairseq's commands choose."""
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def describe(device):
    """What was timed, in words: the GPU's name, or the CPU's cores and torch threads."""
    if device.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(device)})"
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def commit():
    """The plugin's git commit, '-dirty' when its files differ from it; None outside git."""
    def git(*argv):
        return subprocess.run(["git", "-C", PLUGIN, *argv], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if git("diff", "--quiet", "HEAD", "--", ".").returncode else "")


def batches(task, subset, batch_size, max_sentences=None, device=torch.device("cpu"), spread=False):
    """The first max_sentences of `subset` in dataset order, as batches on `device`; spread:
    max_sentences evenly spaced over the whole split instead (a split's first sentences are
    one book's opening, whose heads' acceptance is not the split's)."""
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    ids = list(range(len(dataset)))[:max_sentences]
    if spread and max_sentences and max_sentences < len(dataset):
        ids = np.linspace(0, len(dataset) - 1, max_sentences).round().astype(int).tolist()
    samples = (dataset.collater([dataset[i] for i in ids[s : s + batch_size]]) for s in range(0, len(ids), batch_size))
    return [utils.move_to_cuda(sample, device) if device.type == "cuda" else sample for sample in samples]


def decode(generator, model, samples, clock=time.perf_counter):
    """Hypotheses by sentence id (the best of each), and the seconds the decoding took."""
    cuda = bool(samples) and samples[0]["net_input"]["src_tokens"].is_cuda
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    synchronize()
    start = clock()
    with torch.no_grad():
        for sample in samples:
            for sid, hypos in zip(sample["id"].tolist(), generator.generate([model], sample)):
                out[sid] = hypos[0]
    synchronize()  # a GPU runs behind the Python that launches its work
    return out, clock() - start


class Decoder:
    """One decoder of a timed run: `build` makes a fresh generator for every run, so that its
    statistics are that run's and an adaptive one learns from nothing each time, as a fresh
    fairseq-generate does. `seed`: torch's seed before every run (a sampler draws the same)."""

    def __init__(self, build, model, seed=None):
        self.build, self.model, self.seed = build, model, seed
        self.generator = None

    def warm_up(self, samples):
        self.run(samples)

    def run(self, samples, clock=time.perf_counter):
        """Hypotheses by sentence id and seconds."""
        self.generator = self.build()
        if self.seed is not None:
            torch.manual_seed(self.seed)
        return decode(self.generator, self.model, samples, clock)

    @property
    def stats(self):
        """The last run's BlockwiseStats; None for fairseq's generators."""
        return getattr(self.generator, "stats", None)


@dataclasses.dataclass
class Timing:
    seconds: float  # the median over the rounds
    rounds: list  # seconds of each round, in order
    hypos: dict  # the last round's hypotheses by sentence id
    stats: object  # the last round's BlockwiseStats, or None


class Timer:
    """Warm every decoder up on the first `warmup` batches, then run them in turn, round by
    round, `repeats` times; a decoder's time is its median over the rounds."""

    def __init__(self, repeats=3, warmup=1, clock=time.perf_counter):
        self.repeats, self.warmup, self.clock = repeats, warmup, clock

    def run(self, decoders, samples):
        """decoders: {name: Decoder}; returns {name: Timing}."""
        for decoder in decoders.values():
            decoder.warm_up(samples[: self.warmup])
        rounds, last = collections.defaultdict(list), {}
        for _ in range(self.repeats):
            for name, decoder in decoders.items():
                hypos, seconds = decoder.run(samples, self.clock)
                rounds[name].append(seconds)
                last[name] = hypos
        return {name: Timing(statistics.median(rounds[name]), rounds[name], last[name], decoders[name].stats)
                for name in decoders}


def blockwise_generator(model, tgt_dict, options, stats=None):
    """A blockwise generator from BlockwiseOptions' fields (a dict), through the options API;
    without hypo["attention"] unless the fields ask for it, as fairseq's commands decode."""
    if not os.path.exists(os.path.join(PLUGIN, "options.py")):
        # The before/after table runs this library against commits older than options.py,
        # whose generators took the options as constructor keywords. (A file test, not an
        # import: an editable install would find a newer checkout's options.py.)
        from .adaptive import AdaptiveBlockwiseGenerator
        from .generator import BlockwiseGenerator
        from .sampling import SpeculativeSampler

        options = dict(options)
        adaptive, sampling = options.pop("adaptive", False), options.pop("sampling", False)
        if not sampling:
            options.pop("sampling_topk", None), options.pop("sampling_topp", None)
        cls = SpeculativeSampler if sampling else AdaptiveBlockwiseGenerator if adaptive else BlockwiseGenerator
        return cls(model, tgt_dict, stats=stats, **options)
    from .options import BlockwiseOptions

    if "attention" in {f.name for f in dataclasses.fields(BlockwiseOptions)}:  # older commits: always on
        options = {"attention": False, **options}
    return BlockwiseOptions(**options).generator(model, tgt_dict, stats=stats)


def full_width(model):
    """The checkpoint's k, its widest block (proposal_heads; block_size before it had its own name)."""
    decoder = model.decoder
    return getattr(decoder, "proposal_heads", None) or decoder.block_size


def identical(hypos, reference):
    """Sentences whose output tokens equal the reference decoder's."""
    return sum(hypos[i]["tokens"].tolist() == reference[i]["tokens"].tolist() for i in reference)


def raw_lines(data, subset, lang):
    """The untokenised lines of DATA/raw/SUBSET.LANG (prepare_data.py keeps them); None if absent."""
    path = os.path.join(data, "raw", f"{subset}.{lang}")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def detokenizer(task):
    """Token ids to plain text: BPE removed and Moses-detokenised, as fairseq-generate's
    --post-process subword_nmt --tokenizer moses score it."""
    tgt_dict, lang = task.target_dictionary, task.cfg.target_lang
    moses = encoders.build_tokenizer(argparse.Namespace(tokenizer="moses", source_lang=lang, target_lang=lang))
    return lambda tokens: moses.decode(tgt_dict.string(tokens, "subword_nmt"))


def bleu(lines, references):
    """sacrebleu's corpus BLEU of {sentence id: line} against the reference lines."""
    ids = sorted(lines)
    return sacrebleu.corpus_bleu([lines[i] for i in ids], [[references[i] for i in ids]]).score


@dataclasses.dataclass
class Row:
    """One decoder at one batch size; `baseline` is the decoder its speedup is over (fairseq's
    greedy, or fairseq's sampling for a sampling row), timed in the same rounds."""

    decoder: str
    batch_size: int
    sentences: int
    seconds: float
    baseline: str
    baseline_seconds: float
    speedup: float
    invocations: int
    tokens_per_invocation: float
    mean_accepted_block: float
    identical: int = None  # sentences whose output equals fairseq's greedy (None: a sampler)
    bleu: float = None  # None without DATA/raw references
    options: dict = dataclasses.field(default_factory=dict)  # the generator's, as the spec gave them
    rounds: list = dataclasses.field(default_factory=list)
    accepted_histogram: dict = dataclasses.field(default_factory=dict)
    widths_chosen: dict = dataclasses.field(default_factory=dict)


def row(name, batch_size, timing, baseline_name, baseline, greedy=None, score=None, options=None):
    """The Row of `timing` against `baseline`'s Timing; identity counted against `greedy`'s
    hypotheses; `score`: BLEU of hypotheses, or None."""
    stats = timing.stats
    tokens = sum(len(h["tokens"]) for h in timing.hypos.values())
    invocations = stats.invocations if stats else tokens  # fairseq's: one step per token
    return Row(
        decoder=name, batch_size=batch_size, sentences=len(timing.hypos), seconds=timing.seconds,
        baseline=baseline_name, baseline_seconds=baseline.seconds, speedup=baseline.seconds / timing.seconds,
        invocations=invocations, tokens_per_invocation=tokens / max(invocations, 1),
        mean_accepted_block=stats.mean_accepted_block() if stats else 1.0,
        identical=None if greedy is None else identical(timing.hypos, greedy),
        bleu=None if score is None else score(timing.hypos), options=dict(options or {}), rounds=timing.rounds,
        accepted_histogram=dict(sorted(stats.accepted.items())) if stats else {},
        widths_chosen=dict(sorted(stats.widths.items())) if stats and stats.widths else {},
    )


COLUMNS = ("batch", "decoder", "seconds", "speedup", "over", "tokens / invocation", "mean accepted block",
           "invocations", "identical to greedy", "BLEU")


def markdown(r):
    """A Row as a markdown table line, in COLUMNS' order."""
    cells = (r.batch_size, r.decoder, f"{r.seconds:.2f}", f"{r.speedup:.2f}x", r.baseline,
             f"{r.tokens_per_invocation:.2f}", f"{r.mean_accepted_block:.2f}", r.invocations,
             "" if r.identical is None else f"{r.identical}/{r.sentences}", "" if r.bleu is None else f"{r.bleu:.2f}")
    return "| " + " | ".join(map(str, cells)) + " |"


def write_table(out, run, rows, notes=(), examples=()):
    """OUT.json ({"run": run, "rows": [...], "notes", "examples"}) and OUT.md (a line naming the
    run, the table, the notes)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"run": run, "rows": [dataclasses.asdict(r) for r in rows], "notes": list(notes),
                   "examples": list(examples)}, f, indent=1)
    head = ", ".join(f"{key} {value}" for key, value in run.items())
    lines = [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS), *map(markdown, rows)]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines + ([""] + list(notes) if notes else [])) + "\n")


class MethodProfiler:
    """Seconds spent in wrapped methods and their calls, by label. A wrapper costs a few
    microseconds a call; `synchronize` (a GPU's) runs around every timed call."""

    def __init__(self, synchronize=lambda: None, clock=time.perf_counter):
        self.seconds, self.calls = collections.Counter(), collections.Counter()
        self.synchronize, self.clock = synchronize, clock

    def wrap(self, obj, method, label):
        """Time obj.method under `label`; returns what undoes it."""
        inner, own = getattr(obj, method), method in vars(obj)  # own: defined on obj itself (a class)

        def timed(*args, **kwargs):
            self.synchronize()
            start = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.synchronize()
                self.seconds[label] += self.clock() - start
                self.calls[label] += 1

        setattr(obj, method, timed)
        return lambda: setattr(obj, method, inner) if own else delattr(obj, method)

    @contextlib.contextmanager
    def wrapping(self, parts):
        """Time every (object, method, label) of `parts` inside the block."""
        undo = [self.wrap(*part) for part in parts]
        try:
            yield self
        finally:
            for restore in reversed(undo):
                restore()


def add_data_args(ap, subset="test"):
    """--data, --path and --subset: the data-bin, the checkpoint and the split to decode."""
    ap.add_argument("--data", required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--subset", default=subset)


def add_device_args(ap):
    """--threads and --cpu, for the scripts that time decoding."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--cpu", action="store_true", help="decode on the CPU even when torch sees a GPU")


def setup(args):
    """From parsed add_data_args and add_device_args: the model on its device, its task, the
    device and the seconds loading took. Sets --threads; refuses missing paths."""
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in (args.path, args.data):
        if not os.path.exists(path):
            raise SystemExit(f"error: not found: {path}")
    model, task, seconds = load(args.path, args.data)
    device = pick_device(args.cpu)
    return model.to(device), task, device, seconds
