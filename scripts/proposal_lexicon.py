#!/usr/bin/env python
"""Count a proposal lexicon for --blockwise-proposal-lexicon in binarised training pairs.

For each source word, the target tokens past the proposal shortlist's first --first entries
(the rarer ones, which the draft decoder does not propose on its own) that came in the same
pair most often: at most --per-source of them, each in at least --min-count pairs. Count it
in the base's own greedy output (scripts/self_distill.sh, scripts/hold_out.py's `train`
split), which is what proposals must match; never in a valid or test split.

  .venv/bin/python scripts/proposal_lexicon.py DATA OUT [--first 2000] [--per-source 5] \
      [--min-count 2] [--subset train] [--source-lang de --target-lang en]
"""
import argparse
import collections
import glob
import os
import sys

from fairseq.data import Dictionary, data_utils

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fairseq_bpd.lexicon import ProposalLexicon  # noqa: E402

HELD_OUT = ("valid", "test")


def languages(data, subset, source, target):
    """(source, target) languages of DATA's `subset`: as given, else the one pair it holds."""
    if source and target:
        return source, target
    pairs = {os.path.basename(p).split(".")[1] for p in glob.glob(os.path.join(data, f"{subset}.*-*.*.bin"))}
    if len(pairs) != 1:
        raise SystemExit(f"error: {data} holds {len(pairs)} language pairs of split '{subset}' "
                         f"({sorted(pairs)}): give --source-lang and --target-lang")
    return tuple(pairs.pop().split("-"))


def load_split(data, subset, lang, pair):
    """DATA's binarised `subset` in `lang` (a fairseq indexed dataset)."""
    prefix = os.path.join(data, f"{subset}.{pair}.{lang}")
    dataset = data_utils.load_indexed_dataset(prefix, None)
    if dataset is None:
        raise SystemExit(f"error: no binarised split at {prefix}.bin (fairseq-preprocess makes one)")
    return dataset


def count(sources, targets, first):
    """Pairs each source token came in, and with each rarer target token: Counter, {source: Counter}."""
    if len(sources) != len(targets):
        raise SystemExit(f"error: {len(sources)} source sentences but {len(targets)} target sentences")
    alone, together = collections.Counter(), collections.defaultdict(collections.Counter)
    for i in range(len(sources)):
        source = set(sources[i].tolist())
        rare = {t for t in targets[i].tolist() if t >= first}
        alone.update(source)
        for s in source:
            together[s].update(rare)
    return alone, together


def lexicon_table(together, src_dict, tgt_dict, per_source, min_count):
    """{source word: [target words]}: each source token's most frequent companions, ties by id."""
    table = {}
    for s, companions in together.items():
        best = sorted((t for t, n in companions.items() if n >= min_count), key=lambda t: (-companions[t], t))
        if best and s >= src_dict.nspecial:
            table[src_dict[s]] = [tgt_dict[t] for t in best[:per_source]]
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", help="a fairseq-preprocess folder of training pairs (dictionaries and binarised splits)")
    ap.add_argument("out", help="the lexicon's JSON file")
    ap.add_argument("--first", type=int, default=2000,
                    help="the shortlist the draft proposes from (--head-vocab or --blockwise-proposal-vocab)")
    ap.add_argument("--per-source", type=int, default=5, help="most target tokens a source word adds")
    ap.add_argument("--min-count", type=int, default=2, help="least pairs a source word and target token share")
    ap.add_argument("--subset", default="train")
    ap.add_argument("--source-lang")
    ap.add_argument("--target-lang")
    args = ap.parse_args()
    if args.subset in HELD_OUT or args.subset.startswith(HELD_OUT):
        raise SystemExit(f"error: --subset {args.subset}: valid and test splits stay held out; count in training pairs")
    for flag, value in (("--per-source", args.per_source), ("--min-count", args.min_count), ("--first", args.first)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be at least 1 (got {value})")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise SystemExit(f"error: cannot write {args.out}: {folder} is no folder this user may write in")
    if not os.path.isdir(args.data):
        raise SystemExit(f"error: no folder {args.data}")
    source, target = languages(args.data, args.subset, args.source_lang, args.target_lang)
    dicts = []
    for lang in (source, target):
        path = os.path.join(args.data, f"dict.{lang}.txt")
        if not os.path.exists(path):
            raise SystemExit(f"error: no dictionary {path}")
        dicts.append(Dictionary.load(path))
    src_dict, tgt_dict = dicts
    if not tgt_dict.nspecial < args.first < len(tgt_dict):
        raise SystemExit(f"error: --first {args.first} must lie between the target dictionary's "
                         f"{tgt_dict.nspecial} special symbols and its {len(tgt_dict)} entries")
    pair = f"{source}-{target}"
    sources, targets = (load_split(args.data, args.subset, lang, pair) for lang in (source, target))
    alone, together = count(sources, targets, args.first)
    table = lexicon_table(together, src_dict, tgt_dict, args.per_source, args.min_count)
    if not table:
        raise SystemExit(f"error: no source word shares a target token past the first {args.first} in "
                         f"{args.min_count} or more pairs of {args.data} ({args.subset}): nothing to write")
    try:
        ProposalLexicon(table, args.first).save(args.out)
    except OSError as error:
        raise SystemExit(f"error: cannot write {args.out} ({error})")
    added = sum(len(words) for words in table.values())
    print(f"wrote {args.out}: {len(table)} source words add {added} target tokens past the first {args.first} "
          f"({len(sources)} pairs of {args.data} {args.subset})")


if __name__ == "__main__":
    main()
