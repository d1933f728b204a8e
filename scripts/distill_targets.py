#!/usr/bin/env python
"""Checks for scripts/distill.sh: distilled targets paired with the right sources.

  distill_targets.py extract GENERATE_OUTPUT SOURCE_TEXT TARGET_TEXT
      writes the H- lines of fairseq-generate's output in sentence order to TARGET_TEXT,
      after checking that every line of SOURCE_TEXT has exactly one S- and one H- line
      and that the S- line is that source (a word outside the dictionary shows as <unk>).
  distill_targets.py count PREFIX SRC TGT
      checks that PREFIX.SRC-TGT.{SRC,TGT} (fairseq's binarised train set) hold one
      sentence for each line of text/train.bpe.SRC beside them.

Each exits with a message naming the file when the check fails.
"""
import argparse
import os
import sys

UNK = "<unk>"  # how fairseq-generate prints a source word outside the dictionary


def text_lines(path):
    """The lines of a text file as fairseq-preprocess reads them (universal newlines)."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def read_generate(path):
    """{sentence id: source} and {sentence id: hypothesis} from fairseq-generate's output."""
    found = {"S": {}, "H": {}}
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            kind, _, sentence = fields[0].partition("-")
            if kind not in found or not sentence.isdigit():
                continue
            if int(sentence) in found[kind]:
                raise SystemExit(f"error: {path} has two {kind}-{sentence} lines")
            # S-id<TAB>source; H-id<TAB>score<TAB>hypothesis (empty fields when empty)
            found[kind][int(sentence)] = (fields + ["", ""])[1 if kind == "S" else 2]
    return found["S"], found["H"]


def same_source(printed, line):
    """Whether fairseq printed this source line: the same words, or <unk> in their place."""
    printed, words = printed.split(), line.split()
    return len(printed) == len(words) and all(p in (w, UNK) for p, w in zip(printed, words))


def extract(generate_output, source_text, target_text):
    """Write the hypotheses in source order to target_text, once they are checked to pair."""
    sources, hypotheses = read_generate(generate_output)
    lines = text_lines(source_text)
    for kind, found in (("S", sources), ("H", hypotheses)):
        if sorted(found) != list(range(len(lines))):
            missing = sorted(set(range(len(lines))) - set(found))
            raise SystemExit(
                f"error: {generate_output} has {len(found)} {kind}- lines for the "
                f"{len(lines)} sources in {source_text}"
                + (f" (first missing: {kind}-{missing[0]})" if missing else "")
            )
    for i, line in enumerate(lines):
        if not same_source(sources[i], line):
            raise SystemExit(
                f"error: {generate_output} translated S-{i} {sources[i]!r}, but line {i + 1} "
                f"of {source_text} is {line!r}: its targets belong to other sources"
            )
    with open(target_text + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(hypotheses[i] + "\n" for i in range(len(lines)))
    os.replace(target_text + ".tmp", target_text)


def count(prefix, src, tgt):
    """Exit unless both sides of the binarised set hold one sentence per source line."""
    from fairseq.data import data_utils  # slow to import; only needed here

    source_text = os.path.join(os.path.dirname(prefix), "text", f"train.bpe.{src}")
    pairs = len(text_lines(source_text))
    for lang in (src, tgt):
        stem = f"{prefix}.{src}-{tgt}.{lang}"
        sentences = len(data_utils.load_indexed_dataset(stem, None))
        if sentences != pairs:
            raise SystemExit(f"error: {stem}.bin has {sentences} sentences for the {pairs} lines of {source_text}")


def main(argv=None):
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = ap.add_subparsers(dest="command", required=True)
    one = commands.add_parser("extract", help="targets from fairseq-generate's output")
    for name in ("generate_output", "source_text", "target_text"):
        one.add_argument(name)
    two = commands.add_parser("count", help="check the binarised pair count")
    for name in ("prefix", "src", "tgt"):
        two.add_argument(name)
    args = vars(ap.parse_args(argv))
    {"extract": extract, "count": count}[args.pop("command")](**args)


if __name__ == "__main__":
    sys.exit(main())
