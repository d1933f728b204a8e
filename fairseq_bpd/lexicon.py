"""A source-conditioned proposal vocabulary (--blockwise-proposal-lexicon): the draft decoder
proposes among the target dictionary's first N entries and the rarer tokens that the
batch's own source words bring, a lexical shortlist as Marian's and CTranslate2's
vocabulary maps make for a whole translation.

Why: a shortlist of the first N entries (--head-vocab, --blockwise-proposal-vocab) keeps
each draft step's projection small, but the tokens past it (names, rarer words, about one
output token in twelve on the Bible with N = 2000) are then never proposed, and every block
that reaches one stops there; the whole dictionary costs every step V/N times the
projection. A lexicon names, for each source word, the rarer target tokens it came with in
training pairs (scripts/proposal_lexicon.py counts them in the base's own greedy output):
a sentence adds about a hundred. Verification stays head 1's over the whole dictionary,
so the output is greedy's whatever the lexicon holds.

The file is JSON, words not ids, so that it reads the same against any dictionary holding
them: {"format": FORMAT, "first": N, "table": {source word: [target words]}} (first: the
shortlist it was counted past, for the record).
"""
import json

import torch

FORMAT = "fairseq_bpd proposal lexicon 1"


class ProposalLexicon:
    """The target words each source word adds to the proposals' vocabulary (words: strings)."""

    def __init__(self, table, first=0):
        self.table, self.first = table, first
        self.bound = None  # (source dictionary, target dictionary, ids table): bind()'s last

    @classmethod
    def load(cls, path):
        """The lexicon in the JSON file `path`; ValueError naming the file where it is none."""
        try:
            with open(path, encoding="utf-8") as f:  # the words are UTF-8 whatever the locale
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as error:
            raise ValueError(f"--blockwise-proposal-lexicon {path}: cannot read it ({error})") from None
        table = data.get("table") if isinstance(data, dict) else None
        first = data.get("first", 0) if isinstance(data, dict) else None
        if (not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(table, dict)
                or not all(isinstance(words, list) and all(isinstance(w, str) for w in words)
                           for words in table.values())
                or type(first) is not int or first < 0):
            raise ValueError(f"--blockwise-proposal-lexicon {path}: not a proposal lexicon "
                             f"(scripts/proposal_lexicon.py writes one)")
        return cls(table, first)

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "first": self.first, "table": self.table}, f, ensure_ascii=False)

    def bind(self, src_dict, tgt_dict):
        """The table as ids: a LongTensor source entries x most (target ids, -1 after each
        row's last); words neither dictionary holds are dropped. Kept for the last pair."""
        if self.bound is not None and self.bound[0] is src_dict and self.bound[1] is tgt_dict:
            return self.bound[2]
        unk = tgt_dict.unk()
        rows = {}
        for word, targets in self.table.items():
            source = src_dict.indices.get(word)
            ids = sorted({tgt_dict.indices.get(t, unk) for t in targets} - {unk})
            if source is not None and ids:
                rows[source] = ids
        most = max((len(ids) for ids in rows.values()), default=0)
        ids = torch.full((len(src_dict), max(most, 1)), -1, dtype=torch.long)
        for source, targets in rows.items():
            ids[source, : len(targets)] = torch.tensor(targets)
        self.bound = (src_dict, tgt_dict, ids)
        return ids

    def vocabulary(self, src_tokens, first, src_dict, tgt_dict):
        """The proposal vocabulary of the batch `src_tokens` (B x S): the first `first` entries
        and every target token that any of its source tokens adds past them, a
        ProposalVocabulary; `first` itself where they add none."""
        table = self.bind(src_dict, tgt_dict)
        extras = table[src_tokens.reshape(-1).cpu()].reshape(-1)  # entries of padding are -1
        extras = torch.unique(extras[extras >= first])  # sorted
        return ProposalVocabulary(first, extras.to(src_tokens.device)) if extras.numel() else first


class ProposalVocabulary:
    """What the proposals of one batch range over: the first `first` dictionary entries and
    `extras` (a sorted LongTensor of ids past them). Logits over it are `first` columns then
    one per extra, in that order (size()); a chosen column is token ids[column], so that the
    first of tied columns is the first of tied tokens, as an argmax over the dictionary."""

    def __init__(self, first, extras):
        self.first, self.extras = first, extras
        self.ids = torch.cat([torch.arange(first, device=extras.device), extras])  # column -> token
        self.arranged = {}  # the draft's products over the extras, by the projection they come from

    def size(self):
        return self.ids.numel()

    def tokens(self, columns):
        """Token ids of chosen columns (any shape)."""
        return self.ids[columns]
