"""Speed up an existing translation model: proposal heads trained on it frozen, one command.

  python -m fairseq_bpd.speedup CHECKPOINT DATA SOURCE OUT [--updates 1000] [--proposal-heads 8]
      [--head-type chained] [--head-vocab N] [--max-tokens 4096] [--cpu] [fairseq-train flags...]

CHECKPOINT: a plain fairseq translation model (--arch transformer, any size); DATA: its
data-bin (the dictionaries it was trained with, and a valid split); SOURCE: any text in the
source language, one sentence a line, tokenised and BPE'd as DATA's training source.
OUT receives checkpoint.pt (k heads on the untouched model: Stern et al. 2018's "frozen"
setting), checkpoint.tree-rates.json and speedup.json, the record of each finished step:

  1. distil  the model's greedy (--beam 1) output for SOURCE and for DATA's valid split
  2. train   the heads alone on those targets (--finetune-from-model --freeze-base)
  3. rates   their top-r acceptance rates on the valid split (scripts/tree_rates.py)
  4. check   fairseq-generate --blockwise on checkpoint.pt equals step 1's valid output
  5. speed   greedy vs blockwise at batch 1 on the first valid sentences, one run each

A rerun skips the finished steps; an interrupted training resumes from fairseq's
checkpoint_last.pt. The plugin never imports this module (fairseq_bpd/__init__.py).
"""
import argparse
import hashlib
import importlib
import json
import logging
import os
import re
import runpy
import shutil
import subprocess
import sys
import time

from fairseq import checkpoint_utils
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel

from .model import BlockwiseTransformerModel

PLUGIN = os.path.dirname(os.path.abspath(__file__))
TREE_RATES = os.path.join(os.path.dirname(PLUGIN), "scripts", "tree_rates.py")
STEPS = {  # what each step does, in order, as the command says it
    "distil": "the model's greedy output for SOURCE and for DATA's valid split",
    "train": "the heads alone on those targets, the model frozen",
    "rates": "the heads' top-r acceptance rates on the valid split, for --blockwise-tree-rates",
    "check": "fairseq-generate --blockwise on the valid split equals the model's greedy output",
    "speed": "greedy vs blockwise at batch 1 on the first valid sentences, one run each",
}
# A shortlist pays where the dictionary is large; a small one is cheap in full.
HEAD_VOCAB, FULL_VOCAB_UP_TO = 2000, 4000
LOG_FORMAT, DATE_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S"  # fairseq's


def refuse(message):
    raise SystemExit(f"error: {message}")


def say(message):
    print(f"speedup: {message}", flush=True)


def minutes(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def read_checkpoint(path):
    """The checkpoint's state and architecture, refused unless it is a plain translation Transformer."""
    if not os.path.isfile(path):
        refuse(f"CHECKPOINT {path}: no such file")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
    except Exception as error:  # the loader names the file and why (patches.py)
        refuse(f"CHECKPOINT {path}: {error}")
    cfg = state["cfg"]
    if cfg.task._name != "translation":
        refuse(f"CHECKPOINT {path} is a {cfg.task._name} model (its --task), not a translation model "
               "(--task translation)")
    arch = getattr(cfg.model, "arch", None) or cfg.model._name
    model = ARCH_MODEL_REGISTRY.get(arch)
    if model is None or not issubclass(model, TransformerModel):
        refuse(f"CHECKPOINT {path} is an --arch {arch} model; heads are added to --arch transformer "
               "and its sizes (transformer_wmt_en_de_big, ...)")
    if issubclass(model, BlockwiseTransformerModel):
        refuse(f"CHECKPOINT {path} already has proposal heads (--arch {arch})")
    return state


def check_data(data, state, source_lang, target_lang):
    """DATA's languages and dictionaries, refused unless they are the ones CHECKPOINT was trained with."""
    if not os.path.isdir(data):
        refuse(f"DATA {data}: no such directory")
    task = state["cfg"].task
    src = source_lang or task.source_lang
    tgt = target_lang or task.target_lang
    if not (src and tgt):
        src, tgt = data_utils.infer_language_pair(data)
    if not (src and tgt):
        refuse(f"DATA {data} has no train.SRC-TGT.* files to tell its languages: give --source-lang and --target-lang")
    rows = {src: ("encoder", "source"), tgt: ("decoder", "target")}
    trained_with = task.data.split(os.pathsep)[0]
    for lang, (side, name) in rows.items():
        path = os.path.join(data, f"dict.{lang}.txt")
        if not os.path.isfile(path):
            refuse(f"DATA {data} has no dict.{lang}.txt (the checkpoint translates {src} to {tgt})")
        entries, size = Dictionary.load(path), state["model"][f"{side}.embed_tokens.weight"].size(0)
        if len(entries) != size:
            refuse(f"DATA {data}: dict.{lang}.txt has {len(entries)} entries where the checkpoint's {name} "
                   f"embeddings have {size}: not the dictionary the checkpoint was trained with")
        # Only an absolute path surely names the data-bin the checkpoint was trained on.
        original = os.path.join(trained_with, f"dict.{lang}.txt")
        if os.path.isabs(original) and os.path.isfile(original) and not os.path.samefile(original, path):
            differ = [i for i, (a, b) in enumerate(zip(Dictionary.load(original).symbols, entries.symbols)) if a != b]
            if differ:
                refuse(f"DATA {data}: dict.{lang}.txt differs from {original}, the checkpoint's, from entry "
                       f"{differ[0]} on ({Dictionary.load(original)[differ[0]]!r} there, {entries[differ[0]]!r} here)")
    if not any(os.path.exists(os.path.join(data, f"valid.{a}-{b}.{src}.idx")) for a, b in ((src, tgt), (tgt, src))):
        refuse(f"DATA {data} has no valid split (valid.{src}-{tgt}.*): the last check decodes it")
    return src, tgt, len(Dictionary.load(os.path.join(data, f"dict.{tgt}.txt")))


def check_source(path, data, src):
    """SOURCE's number of lines; refused when empty or holding a blank line."""
    if not os.path.isfile(path):
        refuse(f"SOURCE {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines:
        refuse(f"SOURCE {path} is empty: give it one source sentence a line")
    blank = next((i for i, line in enumerate(lines, 1) if not line.strip()), None)
    if blank:
        refuse(f"SOURCE {path}: line {blank} is blank (one sentence a line)")
    known = Dictionary.load(os.path.join(data, f"dict.{src}.txt")).indices
    words = [w for line in lines for w in line.split()]
    unknown = sum(w not in known for w in words) / len(words)
    if unknown > 0.1:
        say(f"warning: {unknown:.0%} of SOURCE's tokens are not in DATA's dict.{src}.txt: is it tokenised "
            "and BPE'd as DATA's training source?")
    return len(lines)


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Run:
    """OUT and its record, speedup.json: the inputs, and each finished step's results."""

    def __init__(self, out, inputs):
        self.out, self.path = out, os.path.join(out, "speedup.json")
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.record = json.load(f)
            differ = [key for key in inputs if self.record["inputs"].get(key) != inputs[key]]
            if differ:
                refuse(f"OUT {out} holds another run's files (its speedup.json has other {', '.join(differ)}): "
                       "give a new directory")
        elif os.path.isdir(out) and os.listdir(out):
            refuse(f"OUT {out} holds other files and no speedup.json: give a new or empty directory")
        else:
            os.makedirs(out, exist_ok=True)
            self.record = {"inputs": inputs, "steps": {}}
            self.save()

    def file(self, *parts):
        return os.path.join(self.out, *parts)

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.record, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


def fairseq(command, argv, log, watch=None):
    """fairseq_cli.COMMAND's main in this process (fairseq's start-up paid once), its log lines
    to the file `log` and to `watch`. A failure is refused with the log's name."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    module = importlib.import_module(f"fairseq_cli.{command}")
    argv = list(map(str, argv))
    root, own = logging.getLogger(), logging.getLogger(module.__name__)  # preprocess adds a handler of its own
    saved = root.handlers[:], own.handlers[:]
    to_file = logging.FileHandler(log)
    to_file.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root.handlers = [to_file, *([watch] if watch else [])]
    try:
        if command == "preprocess":
            module.main(options.get_preprocessing_parser().parse_args(argv))
        else:
            module.main(convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv)))
    except Exception as error:
        logging.getLogger(__name__).exception("fairseq-%s failed", command)
        refuse(f"fairseq-{command} failed: {error} (log: {log})")
    finally:
        root.handlers, own.handlers = saved
        to_file.close()


class TimeLeft(logging.Handler):
    """Reads fairseq's progress lines (`pattern`'s first group: what is done; its second or
    `total`: of how much) and says the time left at this run's pace, every `every` lines."""

    def __init__(self, pattern, unit, total=None, every=1):
        super().__init__()
        self.pattern, self.unit, self.total, self.every = re.compile(pattern), unit, total, every
        self.first, self.seen, self.said = None, 0, 0

    def emit(self, record):
        found = self.pattern.search(record.getMessage())
        if not found:
            return
        done, total = int(found.group(1)), self.total or int(found.group(2))
        if self.first is None:
            self.first = (done, time.monotonic())
        first, then = self.first
        self.seen += 1
        if done <= max(first, self.said) or done >= total or self.seen % self.every:
            return
        self.said = done
        left = (total - done) * (time.monotonic() - then) / (done - first)
        say(f"{done}/{total} {self.unit}, about {minutes(left)} left")


def hypotheses(path, kind="H"):
    """fairseq-generate's KIND-lines in the file `path`: {sentence id: tokens}."""
    with open(path, encoding="utf-8") as f:
        found = (re.match(rf"{kind}-(\d+)\t(?:\S+\t)?(.*)$", line) for line in f)
        return {int(m.group(1)): m.group(2) for m in found if m}


def greedy(job, data, subset, results, log, *flags):
    """The original model's --beam 1 output for DATA's SUBSET: fairseq-generate's lines in `results`."""
    fairseq("generate", [data, "--path", job.checkpoint, "--user-dir", PLUGIN, "--gen-subset", subset,
                         "--source-lang", job.src, "--target-lang", job.tgt, "--beam", 1, *job.batching,
                         "--results-path", os.path.dirname(results), *flags], log,
            TimeLeft(r"(\d+) / (\d+) wps", "batches", every=10))
    os.replace(os.path.join(os.path.dirname(results), f"generate-{subset}.txt"), results)


def distil(run, job):
    """Step 1: greedy targets for SOURCE (training) and DATA's valid split (validation, and
    the check's reference), binarised with DATA's dictionaries in OUT/distilled."""
    work, distilled, src, tgt, data = run.file("distil"), run.file("distilled"), job.src, job.tgt, job.data
    for folder in (work, distilled):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.copy(job.source, run.file(f"source.{src}"))
    fairseq("preprocess", ["--only-source", "--source-lang", src, "--target-lang", tgt, "--trainpref",
                           run.file("source"), "--srcdict", f"{data}/dict.{src}.txt", "--destdir", work],
            run.file("logs", "preprocess-source.log"))
    shutil.copy(f"{data}/dict.{tgt}.txt", work)
    start = time.monotonic()
    # Bounded lengths, as scripts/self_distill.sh: a runaway repetition on unfamiliar text
    # would make a long and useless target.
    greedy(job, work, "train", run.file("text", "greedy-source.txt"), run.file("logs", "greedy-source.log"),
           "--max-len-a", 1.2, "--max-len-b", 10)
    made = len(hypotheses(run.file("text", "greedy-source.txt")))
    if made != job.sentences:
        refuse(f"{made} greedy translations for the {job.sentences} SOURCE lines (log: {run.file('logs')})")
    say(f"greedy output of the {made} SOURCE sentences in {minutes(time.monotonic() - start)}")
    start = time.monotonic()
    greedy(job, data, "valid", run.file("text", "greedy-valid.txt"), run.file("logs", "greedy-valid.log"))
    valid_seconds = time.monotonic() - start
    for split, results in (("train", "greedy-source.txt"), ("valid", "greedy-valid.txt")):
        results = run.file("text", results)
        for lang, lines in ((src, hypotheses(results, "S")), (tgt, hypotheses(results))):
            with open(run.file("text", f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(lines[i] + "\n" for i in sorted(lines))
    fairseq("preprocess", ["--source-lang", src, "--target-lang", tgt, "--trainpref", run.file("text", "train"),
                           "--validpref", run.file("text", "valid"), "--srcdict", f"{data}/dict.{src}.txt",
                           "--tgtdict", f"{data}/dict.{tgt}.txt", "--destdir", distilled],
            run.file("logs", "preprocess-distilled.log"))
    shutil.rmtree(work)
    os.remove(run.file(f"source.{src}"))
    return {"sentences": made, "greedy_valid_seconds": round(valid_seconds, 1)}


def model_options(base):
    """The checkpoint's Transformer options (layers, sizes, embeddings sharing...): its cfg.model
    holds every flag of its training, and only these are the model's."""
    parser, defaults = argparse.ArgumentParser(), argparse.Namespace()
    TransformerModel.add_args(parser)
    ARCH_CONFIG_REGISTRY["transformer"](defaults)
    names = {action.dest for action in parser._actions} | set(vars(defaults))
    values = vars(base) if isinstance(base, argparse.Namespace) else dict(base)
    return {name: values[name] for name in sorted(names) if name in values}


def train(run, job):
    """Step 2: the heads alone on the distilled pairs, through fairseq's own training loop."""
    import fairseq_cli.train
    from fairseq import distributed_utils, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    updates = job.updates
    argv = [
        run.file("distilled"), "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--source-lang", job.src, "--target-lang", job.tgt, "--arch", "transformer_blockwise",
        "--finetune-from-model", job.checkpoint, "--freeze-base", "--proposal-heads", job.proposal_heads,
        "--head-type", job.head_type, "--head-vocab", job.head_vocab, "--head-ffn-dim", job.head_ffn_dim,
        "--criterion", "blockwise_cross_entropy", "--label-smoothing", 0.1,
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", 1e-3, "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", min(200, max(1, updates // 5)), "--warmup-init-lr", 1e-7, "--clip-norm", 1.0,
        "--max-tokens", job.max_tokens, "--required-batch-size-multiple", 1, "--max-update", updates,
        "--save-dir", run.file("train"), "--save-interval-updates", min(250, max(10, updates // 10)),
        "--keep-interval-updates", 1, "--no-epoch-checkpoints", "--validate-interval", 10**6,
        "--log-format", "simple", "--log-interval", min(50, max(1, updates // 20)), "--seed", 1,
        *job.cpu, *job.train_flags,
    ]
    args = options.parse_args_and_arch(options.get_training_parser(), list(map(str, argv)))
    for name, value in model_options(job.state["cfg"].model).items():
        setattr(args, name, value)
    watch = TimeLeft(r"num_updates[= ](\d+)", "updates", total=updates)
    to_file = logging.FileHandler(run.file("logs", "train.log"))
    to_file.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root = logging.getLogger()
    root.addHandler(watch), root.addHandler(to_file)
    last = run.file("train", "checkpoint_last.pt")
    # fairseq resumed at --max-update would still make one update.
    done = os.path.exists(last) and checkpoint_utils.load_checkpoint_to_cpu(last)["optimizer_history"][-1]["num_updates"]
    try:  # fairseq's own log lines on stdout, as fairseq-train prints them
        if done and done >= updates:
            say(f"{last} holds all {done} updates")
        else:
            distributed_utils.call_main(convert_namespace_to_omegaconf(args), fairseq_cli.train.main)
    finally:
        root.removeHandler(watch), root.removeHandler(to_file)
        to_file.close()
    shutil.copy(last, run.file("checkpoint.pt.tmp"))
    os.replace(run.file("checkpoint.pt.tmp"), run.file("checkpoint.pt"))
    return {"updates": updates}


def rates(run, job):
    """Step 3: the heads' top-r rates beside the checkpoint, for --blockwise-tree-rates."""
    if not os.path.exists(TREE_RATES):
        say("skipped: scripts/tree_rates.py comes with the repository, not with an installed plugin")
        return {"skipped": True}
    out = run.file("checkpoint.tree-rates.json")
    argv, path = sys.argv, sys.path[:]
    sys.argv = [TREE_RATES, "--data", job.data, "--path", run.file("checkpoint.pt"), "--subset", "valid", "--out", out]
    try:
        runpy.run_path(TREE_RATES, run_name="__main__")
    except (Exception, SystemExit) as error:  # the heads serve without rates: go on to the check
        say(f"warning: no tree rates (scripts/tree_rates.py: {error}); a rerun tries again")
        return None
    finally:
        sys.argv, sys.path[:] = argv, path
    return {"file": out}


def check(run, job):
    """Step 4: blockwise decoding of the valid split is the original's greedy output, token for token."""
    output, log = run.file("text", "blockwise-valid.txt"), run.file("logs", "blockwise-valid.log")
    say(f"about {minutes(run.record['steps']['distil']['greedy_valid_seconds'])} (the greedy pass took that)")
    # fairseq-generate itself, in a process of its own: the command a user runs, and the one
    # that prints the run's acceptance summary as it exits.
    with open(output, "w") as out, open(log, "w") as err:
        done = subprocess.run([sys.executable, "-m", "fairseq_cli.generate", job.data, "--path", run.file("checkpoint.pt"),
                               "--user-dir", PLUGIN, "--task", "translation_blockwise", "--blockwise",
                               "--gen-subset", "valid", "--source-lang", job.src, "--target-lang", job.tgt,
                               *map(str, job.batching)], stdout=out, stderr=err)
    if done.returncode:
        refuse(f"fairseq-generate --blockwise failed (log: {log})")
    expected, got = hypotheses(run.file("text", "greedy-valid.txt")), hypotheses(output)
    differ = [i for i in sorted(expected) if got.get(i) != expected[i]]
    if differ:
        i = differ[0]
        refuse(f"the check failed: blockwise output differs from CHECKPOINT's greedy output on {len(differ)} of "
               f"{len(expected)} valid sentences; sentence {i}:\n  greedy:    {expected[i]}\n  blockwise: "
               f"{got.get(i)}\n({run.file('text', 'greedy-valid.txt')}, {output}); OUT/checkpoint.pt is not exact")
    with open(log) as f:
        summary = re.search(r"(\d+) decoder invocations, mean accepted block size ([\d.]+)", f.read())
    say(f"{len(expected)}/{len(expected)} valid sentences identical to CHECKPOINT's greedy output")
    return {"identical": len(expected), "invocations": int(summary.group(1)), "mean_accepted": float(summary.group(2))}


def speed(run, job):
    """Step 5: greedy (fairseq's SequenceGenerator, beam 1, on CHECKPOINT) vs blockwise (the
    plugin's defaults, on OUT/checkpoint.pt), batch 1, one timed run each after a warm-up."""
    from fairseq.sequence_generator import SequenceGenerator

    from . import bench

    device = bench.pick_device(bool(job.cpu))
    original, task, _ = bench.load(job.checkpoint, job.data)
    heads, heads_task, _ = bench.load(run.file("checkpoint.pt"), job.data)
    samples = bench.batches(task, "valid", 1, job.speed_sentences, device)
    tgt_dict = task.target_dictionary
    decoders = {
        "greedy": bench.Decoder(lambda: SequenceGenerator([original], tgt_dict, beam_size=1), original.to(device)),
        "blockwise": bench.Decoder(lambda: bench.blockwise_generator(heads, tgt_dict, {}), heads.to(device)),
    }
    timings = bench.Timer(repeats=1).run(decoders, samples)
    seconds = {name: round(timing.seconds, 2) for name, timing in timings.items()}
    return {"sentences": len(samples), "device": bench.describe(device), **seconds,
            "identical": bench.identical(timings["blockwise"].hypos, timings["greedy"].hypos)}


def report(run):
    """What the heads accept and how fast decoding got, from the record."""
    steps, inputs = run.record["steps"], run.record["inputs"]
    checked, timed = steps["check"], steps["speed"]
    say(f"done: {run.file('checkpoint.pt')}, {inputs['proposal_heads']} {inputs['head_type']} heads on the "
        f"frozen CHECKPOINT; its output is CHECKPOINT's greedy output ({checked['identical']} valid sentences "
        "identical)")
    say(f"the heads accept {checked['mean_accepted']:.2f} tokens per decoder invocation on the valid set")
    say(f"batch 1, the first {timed['sentences']} valid sentences, one run each on {timed['device']}: greedy "
        f"{timed['greedy']:.1f} s, blockwise {timed['blockwise']:.1f} s ({timed['greedy'] / timed['blockwise']:.2f}x)")
    say(f"decode: fairseq-generate {inputs['data']} --user-dir {PLUGIN} --task translation_blockwise "
        f"--path {run.file('checkpoint.pt')} --blockwise")
    if "file" in steps.get("rates", {}):
        say(f"trees: add --blockwise-tree 8 --blockwise-tree-rates {steps['rates']['file']}")


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m fairseq_bpd.speedup", description=__doc__.split("\n")[0],
        epilog="Other flags go to fairseq-train after these (a later flag wins), e.g. --num-workers 0.")
    ap.add_argument("checkpoint", metavar="CHECKPOINT", help="a fairseq translation checkpoint without heads")
    ap.add_argument("data", metavar="DATA", help="its data-bin: its dictionaries and a valid split")
    ap.add_argument("source", metavar="SOURCE", help="source sentences, one a line, BPE'd as DATA's training source")
    ap.add_argument("out", metavar="OUT", help="a new or empty directory (or this command's own, to resume)")
    ap.add_argument("--updates", type=int, default=1000, help="head training updates (default 1000)")
    ap.add_argument("--proposal-heads", type=int, default=8, help="k, head 1 included (default 8)")
    ap.add_argument("--head-type", default="chained", help="chained (default) or independent")
    ap.add_argument("--head-vocab", type=int, default=None,
                    help=f"heads 2..k's shortlist (default {HEAD_VOCAB} for a target dictionary of more "
                         f"than {FULL_VOCAB_UP_TO} entries, else 0: all)")
    ap.add_argument("--head-ffn-dim", type=int, default=None, help="each head's hidden size (default: half the "
                    "decoder's width)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens per training batch (default 4096)")
    ap.add_argument("--speed-sentences", type=int, default=100, help="valid sentences timed at batch 1 (default 100)")
    ap.add_argument("--source-lang", help="default: the checkpoint's, else DATA's")
    ap.add_argument("--target-lang", help="default: the checkpoint's, else DATA's")
    ap.add_argument("--cpu", action="store_true", help="train and decode on the CPU even where torch sees a GPU")
    args, args.train_flags = ap.parse_known_args(argv)
    return args


def main(argv=None):
    job = parse(argv)
    job.state = read_checkpoint(job.checkpoint)
    job.src, job.tgt, vocab = check_data(job.data, job.state, job.source_lang, job.target_lang)
    job.sentences = check_source(job.source, job.data, job.src)
    if job.head_vocab is None:
        job.head_vocab = HEAD_VOCAB if vocab > FULL_VOCAB_UP_TO else 0
    if job.head_ffn_dim is None:
        job.head_ffn_dim = max(1, model_options(job.state["cfg"].model)["decoder_embed_dim"] // 2)
    job.cpu = ["--cpu"] if job.cpu else []
    job.batching = ["--max-tokens", 8000, "--required-batch-size-multiple", 1, "--log-format", "simple",
                    "--log-interval", 10, *job.cpu]
    inputs = {
        "checkpoint": os.path.abspath(job.checkpoint), "checkpoint_sha256": digest(job.checkpoint),
        "data": os.path.abspath(job.data), "source": os.path.abspath(job.source),
        "source_sha256": digest(job.source), "source_lang": job.src, "target_lang": job.tgt,
        **{name: getattr(job, name) for name in ("updates", "proposal_heads", "head_type", "head_vocab",
                                                 "head_ffn_dim", "max_tokens", "train_flags")},
    }
    run = Run(job.out, inputs)
    for folder in ("logs", "text"):
        os.makedirs(run.file(folder), exist_ok=True)
    logging.basicConfig(format=LOG_FORMAT, datefmt=DATE_FORMAT, level=logging.INFO, stream=sys.stdout, force=True)
    for n, (name, what) in enumerate(STEPS.items(), 1):
        if name in run.record["steps"]:
            say(f"step {n}/{len(STEPS)} {name}: done, skipped")
            continue
        say(f"step {n}/{len(STEPS)} {name}: {what}")
        start = time.monotonic()
        result = globals()[name](run, job)
        if result is not None:
            run.record["steps"][name] = {"seconds": round(time.monotonic() - start, 1), **result}
            run.save()
            say(f"step {n}/{len(STEPS)} {name}: done in {minutes(time.monotonic() - start)}")
    report(run)


if __name__ == "__main__":
    main()
