"""Proposal heads: what predicts the tokens 2..k steps ahead.

Stern, Shazeer & Uszkoreit, "Blockwise Parallel Decoding for Deep Autoregressive
Models", NeurIPS 2018, section 6: one feed-forward layer (hidden k*d_ffn, output
k*d_model) after the decoder; slice i plus a residual from the decoder output is
projected by the decoder's own output projection and predicts the token i steps ahead.
A new head architecture is a sibling class here with the same `propose()`.
"""
import math

import torch
from torch import nn
from fairseq import utils


def shortlist_problem(flag, vocab, dictionary):
    """Why `vocab` (given as `flag`) is no shortlist of `dictionary`'s first entries; None if it is."""
    if vocab == 0 or dictionary.nspecial < vocab <= len(dictionary):
        return None
    return (f"{flag} must be 0 (all) or between {dictionary.nspecial + 1} (past the special "
            f"symbols) and the dictionary's {len(dictionary)} entries (got {vocab})")


class ProposalHeads(nn.Module):
    """The paper's k heads over one feed-forward layer cut into residual slices.

    layout "base": head 1 is the decoder's own output and the layer serves heads 2..k
    (a frozen base then decodes exactly as the original model); "paper": all k heads
    pass through the layer. The heads share the decoder's output projection, reached
    through `decoder` (a plain reference, not a submodule: its weights are the
    decoder's). With k=1 and the base layout there is no layer and no parameter.
    """

    def __init__(self, decoder, block_size, layout, ffn_dim, activation_fn, dropout):
        super().__init__()
        self.__dict__["decoder"] = decoder  # not registered: no second copy in state_dict
        self.block_size, self.layout = block_size, layout
        self.num_heads = block_size - (1 if layout == "base" else 0)  # heads in the layer
        self.fc1 = self.fc2 = None
        if self.num_heads > 0:
            embed_dim = decoder.output_embed_dim
            self.fc1 = nn.Linear(embed_dim, self.num_heads * ffn_dim)
            self.fc2 = nn.Linear(self.num_heads * ffn_dim, self.num_heads * embed_dim)
            self.activation_fn = utils.get_activation_fn(activation_fn)
            self.dropout = nn.Dropout(dropout)
            nn.init.xavier_uniform_(self.fc1.weight)
            nn.init.zeros_(self.fc1.bias)
            # Zero output: every head starts as the base model's next-token head, so a
            # pretrained base keeps its quality on the first update.
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

    def layer(self, x, count):
        """The layer's first `count` slices: x B x T x C -> B x T x count x C."""
        hidden = self.activation_fn(self.fc1(x))
        # fc2's rows are the heads' slices: a smaller block computes only its own.
        rows = count * x.size(-1)
        h = self.dropout(nn.functional.linear(hidden, self.fc2.weight[:rows], self.fc2.bias[:rows]))
        return x.unsqueeze(-2) + h.view(*x.shape[:-1], count, x.size(-1))

    def block_features(self, x, count=None):
        """Features of the first `count` heads (default all k): ... x C -> ... x count x C."""
        count = self.block_size if count is None else count
        if self.num_heads == 0 or count == 1 and self.layout == "base":
            return x.unsqueeze(-2)
        if self.layout == "paper":
            return self.layer(x, count)
        return torch.cat([x.unsqueeze(-2), self.layer(x, count - 1)], dim=-2)

    def head1_features(self, x):
        """Features of the next-token head alone: ... x C -> ... x C."""
        if self.layout == "base":
            return x
        return self.block_features(x, 1)[..., 0, :]

    def proposal_logits(self, x):
        """Training logits of heads 2..k: ... x C -> ... x N, N the model's --head-vocab.

        The shortlist is a view of the projection's first rows, no copy.
        """
        decoder = self.decoder
        if not decoder.head_vocab:
            return decoder.output_layer(x)
        return nn.functional.linear(x, decoder.output_projection.weight[: decoder.head_vocab])

    def propose(self, features, count, vocab=0, topn=1):
        """Heads 2..count after one position: their `topn` best tokens, best first.

        features: b x C, the decoder output at the last accepted position. vocab: propose
        among the first N dictionary entries (0: all). Returns tokens and their
        log-probs (over that vocabulary), both b x count-1 x topn. Padding is never proposed.
        """
        if count <= 1:
            empty = features.new_empty(features.size(0), 0, topn)
            return empty.long(), empty
        lprobs, tokens = self.logits(features, count, vocab).log_softmax(dim=-1).topk(topn, dim=-1)
        return tokens, lprobs

    def logits(self, features, count, vocab=0):
        """Heads 2..count after one position: features b x C -> logits b x count-1 x N.

        N is `vocab` (0: the dictionary). Padding gets -inf: in a block it would read as padding.
        """
        heads = self.block_features(features, count)[:, 1:]  # b x count-1 x C
        logits = self.decoder.project(heads, vocab)  # b x count-1 x N
        logits[..., self.decoder.padding_idx] = -math.inf
        return logits
