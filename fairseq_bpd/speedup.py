"""Speed up an existing translation model: proposal heads trained on it frozen, one command.

  python -m fairseq_bpd.speedup CHECKPOINT DATA SOURCE OUT [--updates 1000] [--proposal-heads 8]
      [--head-type chained] [--head-vocab N] [--max-tokens 4096] [--cpu] [fairseq-train flags...]

CHECKPOINT: a plain fairseq translation model (--arch transformer, any size); DATA: its
data-bin (the dictionaries it was trained with, and a valid split); SOURCE: any text in the
source language, one sentence a line, tokenised and BPE'd as DATA's training source.
OUT receives checkpoint.pt (k heads on the untouched model: Stern et al. 2018's "frozen"
setting), checkpoint.tree-rates.json and speedup.json, the record of each finished step:

  1. distil  the model's greedy (--beam 1) output for SOURCE and for DATA's valid split
  2. train   the heads alone on those targets (--finetune-from-model --freeze-base: head 1
             not computed; --head-loss-bf16 where the machine has bfloat16)
  3. rates   their top-r acceptance rates on the valid split (scripts/tree_rates.py)
  4. check   fairseq-generate --blockwise at the full k on checkpoint.pt equals step 1's valid output
  5. widths  the width table --blockwise alone chooses from (fairseq_bpd/widths.py), measured
             on this machine: in the user's cache and as checkpoint.widths.json
  6. speed   greedy vs --blockwise at batch 1 on the first valid sentences, one run each

A rerun skips the finished steps; an interrupted training resumes from fairseq's
checkpoint_last.pt. A module rather than a script, so that an installed plugin has it too
(without step 3, whose script is the clone's). The plugin never imports it.
"""
import argparse
import json
import logging
import os
import sys
import time

from fairseq import checkpoint_utils
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel

from .model import BlockwiseTransformerModel
from .stored_features import sha256
from .speedup_steps import (
    DATE_FORMAT, LOG_FORMAT, PLUGIN, check, distil, minutes, model_options, rates, refuse, say, speed, train,
    training_args, widths,
)

STEPS = {  # in order: what each step does, as the command says it
    "distil": (distil, "the model's greedy output for SOURCE and for DATA's valid split"),
    "train": (train, "the heads alone on those targets, the model frozen"),
    "rates": (rates, "the heads' top-r acceptance rates on the valid split, for --blockwise-tree-rates"),
    "check": (check, "fairseq-generate --blockwise on the valid split equals the model's greedy output"),
    "widths": (widths, "the widths --blockwise alone chooses, measured on this machine"),
    "speed": (speed, "greedy vs blockwise at batch 1 on the first valid sentences, one run each"),
}
# A shortlist pays where the dictionary is large; a small one is cheap in full.
HEAD_VOCAB, FULL_VOCAB_UP_TO = 2000, 4000


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


def read_record(path):
    """The record in `path` (speedup.json), refused by name when it is not one: nothing in
    OUT is overwritten, so a damaged record is for the user to move away."""
    try:
        with open(path) as f:
            record = json.load(f)
        if isinstance(record.get("inputs"), dict) and isinstance(record.get("steps"), dict):
            return record
    except (OSError, ValueError, AttributeError):
        pass
    refuse(f"{path} is not a speedup record (damaged or another program's): move it away, or give a new OUT")


class Run:
    """OUT and its record, speedup.json: the inputs, and each finished step's results."""

    def __init__(self, out, inputs):
        self.out, self.path = out, os.path.join(out, "speedup.json")
        if os.path.exists(out) and not os.path.isdir(out):
            refuse(f"OUT {out} is a file, not a directory: give a new or empty directory")
        if os.path.exists(self.path):
            self.record = read_record(self.path)
            differ = [key for key in inputs if self.record["inputs"].get(key) != inputs[key]]
            if differ:
                refuse(f"OUT {out} holds another run's files (its speedup.json has other {', '.join(differ)}): "
                       "give a new directory")
        elif os.path.isdir(out) and os.listdir(out):
            refuse(f"OUT {out} holds other files and no speedup.json: give a new or empty directory")
        else:
            try:
                os.makedirs(out, exist_ok=True)
            except OSError as error:  # a file on its path, no permission
                refuse(f"OUT {out}: cannot make the directory ({error.strerror})")
            self.record = {"inputs": inputs, "steps": {}}
            self.save()

    def file(self, *parts):
        return os.path.join(self.out, *parts)

    def save(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.record, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


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
    if "rates" in steps:
        say(f"trees (docs/tree.md): add --blockwise-tree N --blockwise-tree-rates {steps['rates']['file']}")
    else:
        say("no tree rates (step 3 said why); a rerun tries again")


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
    ap.add_argument("--head-type", default="chained", choices=["chained", "independent"],
                    help="chained (Hydra: each head reads the token before it; the default) or independent")
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
    for flag in ("updates", "proposal_heads", "max_tokens", "speed_sentences"):
        if getattr(args, flag) < (2 if flag == "proposal_heads" else 1):
            ap.error(f"--{flag.replace('_', '-')} must be at least {2 if flag == 'proposal_heads' else 1}")
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
                    "--log-interval", 1, *job.cpu]
    inputs = {
        "checkpoint": os.path.abspath(job.checkpoint), "checkpoint_sha256": sha256(job.checkpoint),
        "data": os.path.abspath(job.data), "source": os.path.abspath(job.source),
        "source_sha256": sha256(job.source), "source_lang": job.src, "target_lang": job.tgt,
        **{name: getattr(job, name) for name in ("updates", "proposal_heads", "head_type", "head_vocab",
                                                 "head_ffn_dim", "max_tokens", "train_flags")},
    }
    training_args(job, job.out)
    run = Run(job.out, inputs)
    for folder in ("logs", "text"):
        os.makedirs(run.file(folder), exist_ok=True)
    logging.basicConfig(format=LOG_FORMAT, datefmt=DATE_FORMAT, level=logging.INFO, stream=sys.stdout, force=True)
    for n, (name, (step, what)) in enumerate(STEPS.items(), 1):
        if name in run.record["steps"]:
            say(f"step {n}/{len(STEPS)} {name}: done, skipped")
            continue
        say(f"step {n}/{len(STEPS)} {name}: {what}")
        start = time.monotonic()
        result = step(run, job)
        if result is not None:
            run.record["steps"][name] = {"seconds": round(time.monotonic() - start, 1), **result}
            run.save()
            say(f"step {n}/{len(STEPS)} {name}: done in {minutes(time.monotonic() - start)}")
    report(run)


if __name__ == "__main__":
    main()
