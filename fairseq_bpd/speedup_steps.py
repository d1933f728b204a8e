"""The steps of python -m fairseq_bpd.speedup (speedup.py): each takes the run (OUT and its
record) and the job (the checked inputs and options) and returns what it measured.

fairseq's commands run in this process through their own main() (fairseq's start-up is paid
once), with their log lines in OUT/logs; fairseq-train's also on stdout, as it prints them.
The check alone starts fairseq-generate as a user would.
"""
import argparse
import importlib
import logging
import os
import re
import runpy
import shutil
import subprocess
import sys
import time

from fairseq import checkpoint_utils
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.transformer import TransformerModel

PLUGIN = os.path.dirname(os.path.abspath(__file__))
TREE_RATES = os.path.join(os.path.dirname(PLUGIN), "scripts", "tree_rates.py")
WIDTH_BATCH_SIZES = (1, 8, 32)  # the width table's, for step 5: what fairseq-generate is run at
BATCHES = r"(\d+) / (\d+) wps"  # fairseq-generate's progress: batches done, of how many
LOG_FORMAT, DATE_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S"  # fairseq's


def refuse(message):
    raise SystemExit(f"error: {message}")


def say(message):
    print(f"speedup: {message}", flush=True)


def minutes(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


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
    `total`: of how much) and says the time left at this run's pace, about every tenth."""

    def __init__(self, pattern, unit, total=None):
        super().__init__()
        self.pattern, self.unit, self.total = re.compile(pattern), unit, total
        self.first, self.said = None, 0

    def emit(self, record):
        self.read(record.getMessage())

    def read(self, line):
        found = self.pattern.search(line)
        if not found:
            return
        done, total = int(found.group(1)), self.total or int(found.group(2))
        if self.first is None:
            self.first = (done, time.monotonic())
        first, then = self.first
        if done <= first or done >= total or done - self.said < total / 10:
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
            TimeLeft(BATCHES, "batches"))
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


def bf16_is_fast(cpu):
    """Whether heads 2..k's training projection pays in bfloat16 (--head-loss-bf16) here: on a
    GPU that has it, or a CPU with bfloat16 instructions (Linux says so in /proc/cpuinfo)."""
    import torch

    if not cpu and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def training_args(job, out):
    """fairseq-train's namespace for the heads, its model options the checkpoint's own. Built
    before any step too: a flag fairseq-train refuses is refused before anything is written."""
    from fairseq import options

    updates = job.updates
    # train_heads.sh's frozen settings. fairseq validates at each save inside an epoch, so a run
    # saves (and validates: the log's `block` estimate) about 4 times, and at the end.
    bf16 = ["--head-loss-bf16"] if bf16_is_fast(job.cpu) else []
    argv = [
        os.path.join(out, "distilled"), "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--source-lang", job.src, "--target-lang", job.tgt, "--arch", "transformer_blockwise",
        "--finetune-from-model", job.checkpoint, "--freeze-base", "--proposal-heads", job.proposal_heads,
        "--head-type", job.head_type, "--head-vocab", job.head_vocab, "--head-ffn-dim", job.head_ffn_dim,
        "--criterion", "blockwise_cross_entropy", "--label-smoothing", 0.1,
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", 2e-3, "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", min(100, max(1, updates // 5)), "--warmup-init-lr", 1e-7, "--clip-norm", 1.0, *bf16,
        "--max-tokens", job.max_tokens, "--required-batch-size-multiple", 1, "--max-update", updates,
        "--save-dir", os.path.join(out, "train"), "--save-interval-updates", min(250, max(10, updates // 4)),
        "--keep-interval-updates", 1, "--no-epoch-checkpoints", "--validate-interval", 10**6,
        "--log-format", "simple", "--log-interval", min(50, max(1, updates // 20)), "--seed", 1,
        *job.cpu, *job.train_flags,
    ]
    args = options.parse_args_and_arch(options.get_training_parser(), list(map(str, argv)))
    for name, value in model_options(job.state["cfg"].model).items():
        setattr(args, name, value)
    return args


def train(run, job):
    """Step 2: the heads alone on the distilled pairs, through fairseq's own training loop."""
    import fairseq_cli.train
    from fairseq import distributed_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args, updates = training_args(job, run.out), job.updates
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
    return {"updates": updates, "head_loss_bf16": args.head_loss_bf16}


def rates(run, job):
    """Step 3: the heads' top-r rates beside the checkpoint, for --blockwise-tree-rates."""
    if not os.path.exists(TREE_RATES):
        say("skipped: scripts/tree_rates.py comes with the repository, not with an installed plugin")
        return None
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
    # fairseq-generate itself, in a process of its own: the command a user runs, and the one
    # that prints the run's acceptance summary as it exits.
    time_left = TimeLeft(BATCHES, "batches")
    with open(output, "w") as out, open(log, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "fairseq_cli.generate", job.data, "--path", run.file("checkpoint.pt"),
             "--user-dir", PLUGIN, "--task", "translation_blockwise", "--blockwise",
             "--block-size", str(job.proposal_heads),  # all k heads: what they accept, whatever width pays
             "--gen-subset", "valid",
             "--source-lang", job.src, "--target-lang", job.tgt, *map(str, job.batching)],
            stdout=out, stderr=subprocess.PIPE, text=True)
        for line in process.stderr:
            err.write(line)
            time_left.read(line)
    if process.wait():
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


def widths(run, job):
    """Step 5: the width table --blockwise alone chooses each block's width from, measured on this
    machine on the valid split (fairseq_bpd/widths.py), in the user's cache and beside the checkpoint."""
    from . import bench
    from .errors import BlockwiseRequestError
    from .calibration import calibrate
    from .widths import save_table, table_path

    device = bench.pick_device(bool(job.cpu))
    heads, task, _ = bench.load(run.file("checkpoint.pt"), job.data)
    heads.to(device)
    try:
        table = calibrate(heads, task, "valid", WIDTH_BATCH_SIZES, device, repeats=1)  # one command: one round
    except BlockwiseRequestError as error:  # the heads serve without a table: go on to the speed
        say(f"warning: no width table ({error}); --blockwise alone decodes at width 1, a rerun tries again")
        return None
    out = run.file("checkpoint.widths.json")
    for path in (table_path(heads, device), out):
        save_table(table, path)
    chosen = " ".join(f"{b}:{table.width(b)}" for b in WIDTH_BATCH_SIZES)
    say(f"widths --blockwise chooses by batch size: {chosen} (batch:width; {out})")
    return {"file": out, "chosen": {b: table.width(b) for b in WIDTH_BATCH_SIZES}}


def speed(run, job):
    """Step 5: greedy (fairseq's SequenceGenerator, beam 1, on CHECKPOINT) vs blockwise (the
    plugin's defaults, on OUT/checkpoint.pt), batch 1, one timed run each after a warm-up."""
    from fairseq.sequence_generator import SequenceGenerator

    from . import bench

    device = bench.pick_device(bool(job.cpu))
    original, task, _ = bench.load(job.checkpoint, job.data)
    heads, _, _ = bench.load(run.file("checkpoint.pt"), job.data)
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
