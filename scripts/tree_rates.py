#!/usr/bin/env python
"""Measure the heads' top-r acceptance rates that shape --blockwise-tree's candidate tree.

Decodes --subset greedily (blockwise, which is exactly greedy), then feeds each
output back teacher-forced and counts, for head h (2..k) and rank r, how often the
head's rank-r proposal at a position is the greedy token h-1 steps later: the path
exact decoding must reproduce. Chained heads read that path's tokens (teacher-forced),
as each node of a --blockwise-tree reads its own parent's token. Writes {"rates": heads
x ranks, ...} as JSON beside the checkpoint (CKPT without .pt, plus .tree-rates.json),
for --blockwise-tree-rates.

  .venv/bin/python scripts/tree_rates.py --data DATA --path CKPT [--subset valid] \
      [--max-sentences 500] [--batch-size 32] [--proposal-lexicon FILE] [--out FILE]

Under --proposal-lexicon the proposals range over what decoding with
--blockwise-proposal-lexicon gives each batch: the shortlist and the rarer tokens its
source words bring.
"""
import argparse
import json
import os

import torch
from fairseq.data import data_utils

from fairseq_bpd.bench import add_data_args, batches, load
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.heads import best_tokens, decoding_logits
from fairseq_bpd.options import BlockwiseOptions, read_lexicon
from fairseq_bpd.tree import MAX_RANK


def beside(path):
    """Where the rates of checkpoint `path` go by default."""
    return os.path.splitext(path)[0] + ".tree-rates.json"


def ranked_tokens(decoder, heads, vocab, ranks):
    """The `ranks` best proposals of features ... x C: tokens ... x ranks.

    vocab: N (the first N entries; 0: all) or a batch's ProposalVocabulary, whose proposals
    are the best of its tokens: the whole dictionary's logits with every other token's at
    -inf, as the draft ranks its columns (ids in order: the first of tied tokens first)."""
    if isinstance(vocab, int):
        return best_tokens(decoder, heads, vocab, ranks)[0]
    logits = decoding_logits(decoder, heads, 0).index_select(-1, vocab.ids)  # ... x its columns
    return vocab.tokens(logits.topk(min(ranks, vocab.size()), dim=-1)[1])


@torch.no_grad()
def count_hits(model, net_input, outputs, proposal_vocab=0, ranks=MAX_RANK):
    """Hits and trials per head and rank, teacher-forced on `outputs` (token lists, EOS last)
    as the translations of the batch `net_input`; proposal_vocab: an int (the first N
    entries; 0: all) or the batch's ProposalVocabulary.

    Returns hits: k-1 x ranks (head h+2's rank-r proposal was the token h+1 steps on) and
    trials: k-1 (positions with a token h+1 steps on).
    """
    decoder = model.decoder
    pad, eos = decoder.padding_idx, decoder.dictionary.eos()
    target = data_utils.collate_tokens(outputs, pad, eos)  # B x T
    previous = data_utils.collate_tokens(outputs, pad, eos, move_eos_to_beginning=True)
    encoder_out = model.encoder.forward_torchscript(net_input)
    features, _ = decoder.extract_features(previous, encoder_out=encoder_out)  # B x T x C
    T = features.size(1)
    k = decoder.proposal_heads
    # Teacher-forced on greedy's path: chained heads read its tokens, as a tree's node reads
    # its parent's token, which is greedy's wherever the parent is accepted.
    heads = decoder.heads.block_features(features, k, previous, encoder_out)[:, :, 1:]  # B x T x k-1 x C
    tokens = ranked_tokens(decoder, heads, proposal_vocab, ranks)  # B x T x k-1 x ranks
    hits = torch.zeros(k - 1, tokens.size(-1), dtype=torch.long)
    trials = torch.zeros(k - 1, dtype=torch.long)
    for h in range(k - 1):
        ahead = target[:, h + 1 :]  # B x T-h-1: the token h+1 steps on
        valid = ahead.ne(pad)
        hits[h] = (tokens[:, : T - h - 1, h] == ahead[..., None])[valid].sum(dim=0)
        trials[h] = valid.sum()
    return hits, trials


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_args(ap, subset="valid")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-sentences", type=int, default=500)
    ap.add_argument("--proposal-vocab", type=int, default=0, help="as --blockwise-proposal-vocab (0: the checkpoint's)")
    ap.add_argument("--proposal-lexicon", help="as --blockwise-proposal-lexicon: a JSON lexicon of scripts/proposal_lexicon.py")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", help="default: beside the checkpoint, " + beside("CKPT.pt"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.exists(args.path):
        raise SystemExit(f"error: checkpoint not found: {args.path}")
    lexicon = None
    if args.proposal_lexicon:  # refused before the model loads
        lexicon, problem = read_lexicon(args.proposal_lexicon)
        if problem:
            raise SystemExit(f"error: {problem}")
    model, task, _ = load(args.path, args.data)
    samples = batches(task, args.subset, args.batch_size, args.max_sentences)
    k = model.decoder.proposal_heads
    if k < 2:
        raise SystemExit(f"error: {args.path} has no proposal heads to measure (k={k})")
    try:
        options = BlockwiseOptions(block_size=k, proposal_vocab=args.proposal_vocab, proposal_lexicon=lexicon)
        generator = options.generator(model, task.target_dictionary)
    except BlockwiseRequestError as error:  # a lexicon for heads that read none, a shortlist too long...
        raise SystemExit(f"error: {error}") from None
    hits = torch.zeros(k - 1, MAX_RANK, dtype=torch.long)
    trials = torch.zeros(k - 1, dtype=torch.long)
    for sample in samples:
        outputs = [h[0]["tokens"] for h in generator.generate([model], sample)]
        vocab = generator.vocabulary(sample["net_input"]["src_tokens"])
        h, t = count_hits(model, sample["net_input"], outputs, vocab)
        hits[:, : h.size(1)] += h
        trials += t
    rates = (hits.double() / trials.clamp(min=1)[:, None].double()).tolist()
    result = {"rates": [[round(p, 5) for p in row] for row in rates], "checkpoint": args.path,
              "subset": args.subset, "sentences": sum(len(s["id"]) for s in samples),
              "positions": trials.tolist(), "proposal_vocab": generator.proposal_vocab,
              "proposal_lexicon": args.proposal_lexicon}
    out = args.out or beside(args.path)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for h, row in enumerate(rates):
        print(f"head {h + 2}: " + " ".join(f"{p:.3f}" for p in row[:5]) + f" (top-3 {sum(row[:3]):.3f})")
    print(f"wrote {out}: decode with --blockwise-tree N --blockwise-tree-rates {out}")


if __name__ == "__main__":
    main()
