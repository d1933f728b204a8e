#!/usr/bin/env python
"""Undo prepare_data.py's preprocessing: remove BPE, then Moses-detokenise.

Used before scoring with sacrebleu, which expects plain (detokenised) text.

Usage: python scripts/detok.py --lang en [FILE ...] > out.txt   (stdin if no FILE)
"""
import argparse
import fileinput
import re

from sacremoses import MosesDetokenizer

# "@@" joins a subword to the next one; at the very end of a line it can be
# left dangling by a truncated hypothesis.
_BPE_JOINER = re.compile(r"@@( |$)")


def remove_bpe(line):
    """Join subword units split by subword-nmt ("Licht@@ es" -> "Lichtes")."""
    return _BPE_JOINER.sub("", line.strip())


class Detokenizer:
    """Callable turning one BPE'd, Moses-tokenised line into plain text."""

    def __init__(self, lang):
        self._moses = MosesDetokenizer(lang=lang)

    def __call__(self, line):
        return self._moses.detokenize(remove_bpe(line).split())


def detokenize(line, lang):
    """One-off convenience wrapper around Detokenizer (slower in loops)."""
    return Detokenizer(lang)(line)


def main(argv=None):
    """Command-line entry point: detokenise files (or stdin) to stdout."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lang", required=True, help="language code, e.g. en")
    ap.add_argument("files", nargs="*", help="input files (default: stdin)")
    args = ap.parse_args(argv)
    detok = Detokenizer(args.lang)
    with fileinput.input(args.files or ("-",), encoding="utf-8") as lines:
        for line in lines:
            print(detok(line))


if __name__ == "__main__":
    main()
