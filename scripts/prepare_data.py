#!/usr/bin/env python
"""Raw parallel text -> Moses tokens -> joint BPE -> fairseq data-bin.

Usage:
  python scripts/prepare_data.py --src de --tgt en --train data/bible-raw/train \
      --valid data/bible-raw/valid --test data/bible-raw/test \
      --out data/bible-bin [--merges 8000]

Each PREFIX names PREFIX.<src> and PREFIX.<tgt>, one sentence a line.
OUT receives the fairseq binaries and dictionaries, plus
  bpe.codes                 the joint BPE merges,
  text/<split>.bpe.<lang>   the tokenised + BPE'd text fed to fairseq,
  raw/{valid,test}.<lang>   the input lines as read, the references for sacrebleu,
  .done                     a hash of inputs + settings, so reruns skip.
Model output is turned back into plain text with scripts/detok.py.
"""
import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
from multiprocessing import Pool

from sacremoses import MosesPunctNormalizer, MosesTokenizer
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

SPLITS = ("train", "valid", "test")
# Part of the .done hash: bump it when the preprocessing itself changes, so
# existing data-bins are rebuilt rather than silently reused.
PIPELINE_VERSION = 3
# Line boundaries for str.splitlines() or universal newlines, besides "\n".
LINE_BREAKS = re.compile("[\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def read_lines(path):
    """Return the lines of a UTF-8 file, split at newlines only; exit if missing or not UTF-8.

    str.splitlines() (and a text file's universal newlines) also break at \\r, \\v, \\f,
    \\x1c-\\x1e, U+0085, U+2028 and U+2029, which shifts every pair after one of them.
    Inside a line they become spaces, so no tool downstream splits it; a CR before the
    newline (CRLF files) and a UTF-8 byte-order mark are dropped, the latter anywhere
    (files joined with cat carry one at each join). A file with CRs and no newline at
    all (classic Mac line ends) is split at its CRs, not read as one line.
    """
    if not os.path.isfile(path):
        raise SystemExit(f"error: input file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SystemExit(f"error: {path} is not UTF-8 text: line {line}, byte {error.start}: "
                         f"{error.reason}; convert it first, e.g. iconv -f latin1 -t utf-8")
    text = text.replace("\ufeff", "")
    lines = text.split("\n" if "\n" in text or "\r" not in text else "\r")
    if lines[-1] == "":
        lines.pop()  # the last line's newline
    return [LINE_BREAKS.sub(" ", line.removesuffix("\r")) for line in lines]


def read_parallel(prefix, src, tgt):
    """Read PREFIX.src / PREFIX.tgt, checking they are non-empty and aligned."""
    src_path, tgt_path = f"{prefix}.{src}", f"{prefix}.{tgt}"
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise SystemExit(
            f"error: line counts differ: {src_path} has {len(src_lines)} lines, "
            f"{tgt_path} has {len(tgt_lines)} lines")
    for path, lines in ((src_path, src_lines), (tgt_path, tgt_lines)):
        if not any(line.strip() for line in lines):
            raise SystemExit(f"error: empty corpus: {path} has no text")
    return src_lines, tgt_lines


def _tokenize_chunk(job):
    """Normalise and tokenise a list of lines (runs in a worker process)."""
    lang, lines = job
    norm, tok = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    # escape=False keeps & < > " ' literal; fairseq needs no XML escaping and
    # it would otherwise leak into detokenised output and BLEU.
    return [tok.tokenize(norm.normalize(line), escape=False, return_str=True)
            for line in lines]


def tokenize(lines, lang, workers=2):
    """Moses-normalise and tokenise lines, in parallel (sacremoses is slow)."""
    size = max(1, len(lines) // (workers * 4) + 1)
    jobs = [(lang, lines[i:i + size]) for i in range(0, len(lines), size)]
    with Pool(workers) as pool:
        return [line for chunk in pool.map(_tokenize_chunk, jobs) for line in chunk]


def inputs_hash(args):
    """Hash input file contents and settings, to tell when a rerun can skip."""
    h = hashlib.sha256(
        f"{PIPELINE_VERSION} {args.src} {args.tgt} {args.merges}".encode())
    for split in SPLITS:
        for lang in (args.src, args.tgt):
            with open(f"{getattr(args, split)}.{lang}", "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def write_lines(path, lines):
    """Write lines to a UTF-8 file, one a line."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def fairseq_preprocess(args, text_dir):
    """Binarise the BPE'd text with fairseq-preprocess and a joined dictionary."""
    # The CLI next to this interpreter belongs to the same environment.
    exe = os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess")
    if not os.path.exists(exe):
        exe = shutil.which("fairseq-preprocess") or exe
    cmd = [exe, "--source-lang", args.src, "--target-lang", args.tgt,
           "--destdir", args.out, "--joined-dictionary", "--workers", "2"]
    for split in SPLITS:
        cmd += [f"--{split}pref", os.path.join(text_dir, f"{split}.bpe")]
    subprocess.run(cmd, check=True)


def written_text(args, split, lang):
    """The text files written for one side of a split, one line a pair."""
    paths = [os.path.join(args.out, "text", f"{split}.{kind}.{lang}") for kind in ("tok", "bpe")]
    if split != "train":
        paths.append(os.path.join(args.out, "raw", f"{split}.{lang}"))
    return paths


def binarised(args, split, lang):
    """fairseq's stem of one side of a split (.bin and .idx)."""
    return os.path.join(args.out, f"{split}.{args.src}-{args.tgt}.{lang}")


def missing_outputs(args):
    """The files a finished run wrote that are not there (deleted since)."""
    paths = [os.path.join(args.out, name) for name in
             ("bpe.codes", f"dict.{args.src}.txt", f"dict.{args.tgt}.txt")]
    for split in SPLITS:
        for lang in (args.src, args.tgt):
            stem = binarised(args, split, lang)
            paths += written_text(args, split, lang) + [stem + ".bin", stem + ".idx"]
    return [path for path in paths if not os.path.exists(path)]


def check_written(args, pairs):
    """Exit unless every file written holds one line, and fairseq one sentence, a pair."""
    from fairseq.data import data_utils  # slow to import; only needed here

    for split, n in pairs.items():
        for lang in (args.src, args.tgt):
            for path in written_text(args, split, lang):
                with open(path, encoding="utf-8") as f:  # lines as fairseq-preprocess reads them
                    lines = sum(1 for _ in f)
                if lines != n:
                    raise SystemExit(f"error: {path} has {lines} lines for {n} sentence pairs")
            stem = binarised(args, split, lang)
            sentences = len(data_utils.load_indexed_dataset(stem, None))
            if sentences != n:
                raise SystemExit(f"error: {stem}.bin has {sentences} sentences for {n} pairs")


def prepare(args):
    """Run the whole pipeline into args.out, unless .done says it is current."""
    data = {split: read_parallel(getattr(args, split), args.src, args.tgt)
            for split in SPLITS}
    langs = (args.src, args.tgt)
    done, digest = os.path.join(args.out, ".done"), inputs_hash(args)
    if os.path.exists(done) and read_lines(done) == [digest]:
        missing = missing_outputs(args)
        if not missing:
            print(f"{args.out} is up to date; nothing to do")
            return
        more = f" and {len(missing) - 1} more files" if len(missing) > 1 else ""
        print(f"{args.out} lacks {missing[0]}{more}: building it again")
    text_dir, raw_dir = os.path.join(args.out, "text"), os.path.join(args.out, "raw")
    os.makedirs(text_dir, exist_ok=True)
    os.makedirs(raw_dir, exist_ok=True)
    # A failed rerun must not look finished, and fairseq-preprocess refuses
    # to overwrite the dictionaries of an earlier run.
    for name in (".done", f"dict.{args.src}.txt", f"dict.{args.tgt}.txt"):
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))

    tok = {(s, lang): tokenize(data[s][i], lang, args.workers)
           for s in SPLITS for i, lang in enumerate(langs)}
    for (split, lang), lines in tok.items():
        write_lines(os.path.join(text_dir, f"{split}.tok.{lang}"), lines)
    for split in ("valid", "test"):
        for i, lang in enumerate(langs):
            write_lines(os.path.join(raw_dir, f"{split}.{lang}"), data[split][i])

    # Joint BPE: one vocabulary for both sides, as --joined-dictionary expects.
    codes_path = os.path.join(args.out, "bpe.codes")
    joint = io.StringIO("\n".join(tok["train", args.src] + tok["train", args.tgt]))
    with open(codes_path, "w", encoding="utf-8") as codes:
        learn_bpe(joint, codes, args.merges)
    with open(codes_path, encoding="utf-8") as codes:
        bpe = BPE(codes)
    for (split, lang), lines in tok.items():
        write_lines(os.path.join(text_dir, f"{split}.bpe.{lang}"),
                    [bpe.process_line(line) for line in lines])

    fairseq_preprocess(args, text_dir)
    check_written(args, {split: len(data[split][0]) for split in SPLITS})
    write_lines(done, [digest])
    print(f"wrote {args.out}: " + ", ".join(
        f"{s} {len(data[s][0])}" for s in SPLITS) + " sentence pairs")


def main(argv=None):
    """Command-line entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--src", required=True, help="source language, e.g. de")
    ap.add_argument("--tgt", required=True, help="target language, e.g. en")
    for split in SPLITS:
        ap.add_argument(f"--{split}", required=True, metavar="PREFIX",
                        help=f"{split} text is PREFIX.<src> and PREFIX.<tgt>")
    ap.add_argument("--out", required=True, help="data-bin folder to write")
    ap.add_argument("--merges", type=int, default=8000, help="BPE merge operations")
    ap.add_argument("--workers", type=int, default=2, help="tokeniser processes (1 or more)")
    args = ap.parse_args(argv)
    if args.workers < 1:  # was a ZeroDivisionError (0) or multiprocessing's ValueError
        ap.error(f"--workers must be 1 or more (got {args.workers})")
    if args.src == args.tgt:  # both sides would be one file, and one dictionary's entries
        ap.error(f"--src and --tgt must be two languages (got {args.src} for both)")
    prepare(args)


if __name__ == "__main__":
    main()
