#!/usr/bin/env python
"""CTranslate2's greedy decoding of a blockwise checkpoint's base: scripts/speed.py's ctranslate2 row.

Dropping the proposal heads leaves an ordinary fairseq `transformer` whose greedy output
is the blockwise model's, which CTranslate2's fairseq converter reads. Each step runs in
a process of its own, started by scripts/speed.py: once CTranslate2 has translated in a
process, torch's decoding in that process slows down until the translator is deleted.

  convert CKPT DATA OUT_DIR: writes the checkpoint without its heads, as --arch transformer
      and --task translation, and converts it into OUT_DIR.
  translate MODEL_DIR BATCHES OUT [--threads N] [--device cpu] [--compute-type float32]:
      BATCHES is JSON, a list of batches of source token lists; translates the first batch
      (a warm-up), then all of them timed, greedily (beam 1), and writes
      {"seconds": S, "outputs": [token lists, batch after batch]} to OUT.

speed.py sets CT2_USE_MKL=0 (oneDNN) unless it is set: CTranslate2's default MKL backend
with two threads ran far slower per step than oneDNN on a 2-core CPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time


def plain_checkpoint(path, out):
    """The checkpoint at `path` as a plain fairseq transformer (no heads) at `out`."""
    import torch
    import fairseq_bpd  # noqa: F401  (allow-lists the checkpoint's globals)
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    args = state["args"] or state["cfg"]["model"]
    if getattr(args, "head_layout", "base") != "base":
        raise SystemExit(f"error: {path} has --head-layout {args.head_layout}: head 1 is not the base's own "
                         "output, so without its heads the model is not the one blockwise decoding verifies with")
    plain = argparse.Namespace(**vars(args))
    plain.arch = plain._name = "transformer"
    plain.task = "translation"
    weights = {name: tensor for name, tensor in state["model"].items() if not name.startswith("decoder.heads.")}
    torch.save({"args": plain, "model": weights}, out)


def convert(args):
    import fairseq_bpd  # noqa: F401  (allow-lists the plain checkpoint's Namespace for weights-only loading)
    from ctranslate2.converters import FairseqConverter

    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "plain.pt")
        plain_checkpoint(args.checkpoint, plain)
        FairseqConverter(plain, args.data, source_lang=args.source_lang, target_lang=args.target_lang).convert(
            args.out, force=True)


def translate(args):
    import ctranslate2

    with open(args.batches) as f:
        batches = json.load(f)
    translator = ctranslate2.Translator(args.model, device=args.device, compute_type=args.compute_type,
                                        intra_threads=args.threads, inter_threads=1)
    options = dict(beam_size=1, max_decoding_length=args.max_length, min_decoding_length=1)
    translator.translate_batch(batches[0], **options)  # warm-up
    start = time.perf_counter()
    results = [translator.translate_batch(batch, **options) for batch in batches]
    seconds = time.perf_counter() - start
    outputs = [result.hypotheses[0] for batch in results for result in batch]
    with open(args.out, "w") as f:
        json.dump({"seconds": seconds, "outputs": outputs}, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert")
    c.add_argument("checkpoint")
    c.add_argument("data")
    c.add_argument("out")
    c.add_argument("--source-lang")
    c.add_argument("--target-lang")
    t = sub.add_parser("translate")
    t.add_argument("model")
    t.add_argument("batches")
    t.add_argument("out")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--device", default="cpu")
    t.add_argument("--compute-type", default="float32")
    t.add_argument("--max-length", type=int, default=200, help="as fairseq's --max-len-b (its default)")
    args = ap.parse_args(argv)
    {"convert": convert, "translate": translate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
