"""Proposal heads: what predicts the tokens 2..k steps ahead.

Stern, Shazeer & Uszkoreit, "Blockwise Parallel Decoding for Deep Autoregressive
Models", NeurIPS 2018, section 6: one feed-forward layer (hidden k*d_ffn, output
k*d_model) after the decoder; slice i plus a residual from the decoder output is
projected by the decoder's own output projection and predicts the token i steps ahead.
Every proposer follows one protocol (Proposer): the generator hands it what it needs and
never asks which kind it has. A new head architecture is a sibling class here: ChainedHeads
(--head-type chained) tells each head the token the head before it predicts. Decoding runs
the heads on their weights arranged once per change (heads_step.py).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from fairseq import utils

from .targets import shift_target
from .dropout import HashDropout
from .errors import BlockwiseRequestError
from .heads_step import Arranged, ChainWeights, HeadWeights


class Proposer:
    """The proposer protocol: what proposes a block's tokens after the last accepted position.

    After each block the generator hands the proposer the accepted path's last features
    (b x C, the decoder output at its last node), the last committed token (b: head 1's
    choice after those features, the next block's first token), the block's width (that
    token and width - 1 proposals), the proposal vocabulary (the dictionary's first N
    entries; 0: all of it), topn (the ranks a tree uses) and the encoder output, for a
    proposer that attends to it. A proposer that keeps state across blocks (a draft
    model's own cache) keeps it in step through crop and reorder; today's heads keep none.
    """

    # Whether each proposal's distribution is known without the proposals before it, so
    # that logits() gives them all at once (speculative sampling draws from them).
    independent = True

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        """The best `topn` tokens of each of the block's width - 1 proposals, best first, and
        their log-probs over the proposal vocabulary: both b x width-1 x topn. log_probs
        False: None instead of the log-probs, for a caller that reads only the tokens (an
        exact chain needs each proposal's best token alone). confidence (a log-probability,
        --blockwise-confidence's, which cuts the block before the first proposal at which a
        sentence's sum of top log-probs falls below it): a proposer whose proposals cost
        much each may stop after the first at which every sentence's sum has fallen below
        it, and return fewer than width - 1."""
        raise NotImplementedError

    def nodes(self, proposals, tree, features, token, vocab=0, encoder_out=None):
        """The block's candidates laid out as `tree` (tree.py; not the chain): tokens b x n-1.

        proposals: b x width-1 x topn, what propose() returned after `features` and `token`
        (the same arguments). Node v at depth d takes head d+1's rank-r_v proposal: a
        proposer whose heads read no token has one distribution per head, whatever the path.
        """
        return proposals[:, tree.depth[1:] - 1, tree.rank[1:]]

    def logits(self, features, token, width, vocab=0, encoder_out=None):
        """Each proposal's logits over the proposal vocabulary (N entries; padding -inf):
        b x width-1 x N. Only for an independent proposer."""
        raise NotImplementedError(f"{type(self).__name__} gives no distribution of every proposal at once")

    def crop(self, path, kept):
        """The block's nodes along `path` (b x D+1) were accepted, the first `kept` (b) of them
        stay: keep only those in any state (the decoder's cache is cropped the same way)."""

    def reorder(self, rows):
        """Only the sentences at `rows` (b') stay in the batch, in that order: reorder any state."""

    def keep(self, path, kept, features, block):
        """crop(path, kept), told also the block's features b x n x C and tokens b x n, for a
        proposer that feeds its state the accepted positions (the draft decoder)."""
        self.crop(path, kept)


def shortlist_problem(flag, vocab, dictionary):
    """Why `vocab` (given as `flag`) is no shortlist of `dictionary`'s first entries; None if it is."""
    if vocab == 0 or dictionary.nspecial < vocab <= len(dictionary):
        return None
    return (f"{flag} must be 0 (all) or between {dictionary.nspecial + 1} (past the special "
            f"symbols) and the dictionary's {len(dictionary)} entries (got {vocab})")


class ProposalHeads(Arranged, nn.Module, Proposer):
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
            self.dropout = HashDropout(dropout)
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

    def block_features(self, x, count=None, inputs=None, encoder_out=None):
        """Features of the first `count` heads (default all k): ... x C -> ... x count x C.

        inputs (the decoder's input tokens) is for heads that read tokens (ChainedHeads),
        encoder_out for heads that read the source (the draft decoder).
        """
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
        """Training logits of heads 2..k: ... x C -> ... x N, N the model's --head-vocab."""
        return shortlist_logits(self.decoder, x)

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        """Heads 2..width after one position: their `topn` best tokens, best first (the
        Proposer protocol; the heads read neither `token` nor `encoder_out`, but a batch's
        encoder output tells when to check the arranged weights: decoding_weights)."""
        if width <= 1:
            return no_proposals(features, topn, log_probs)
        logits = self.logits(features, token, width, vocab, encoder_out)  # b x width-1 x N
        tokens = logits.argmax(dim=-1, keepdim=True) if topn == 1 else logits.topk(topn, dim=-1)[1]
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens) if log_probs else None

    def logits(self, features, token, width, vocab=0, encoder_out=None):
        """Heads 2..width after one position: features b x C -> logits b x width-1 x N.

        N is `vocab` (0: the dictionary). Padding gets -inf (speculative sampling draws
        from these). On HeadWeights where they can run (decoding_weights).
        """
        weights = self.decoding_weights(vocab, encoder_out)
        if weights is not None and width > 1:
            return weights.logits(features, width)
        heads = self.block_features(features, width)[:, 1:]  # b x width-1 x C
        return decoding_logits(self.decoder, heads, vocab)

    def arrange(self, columns, padding):
        return HeadWeights(self, columns, padding)


def shortlist_logits(decoder, x):
    """Training logits over the decoder's --head-vocab shortlist: ... x C -> ... x N.

    The shortlist is a view of the projection's first rows, no copy.
    """
    if not decoder.head_vocab:
        return decoder.output_layer(x)
    return nn.functional.linear(x, decoder.output_projection.weight[: decoder.head_vocab])


def decoding_logits(decoder, features, vocab):
    """Decoding logits of proposal features over the first `vocab` entries (0: all): ... x C -> ... x N.

    Padding is never proposed: in a block it would read as padding.
    """
    projection = decoder.proposal_projection(vocab)
    if projection is None:  # not a plain product: the decoder's own projection
        logits = decoder.project(features, vocab)  # ... x N
        logits[..., decoder.padding_idx] = -math.inf
        return logits
    columns, padding = projection  # C x N, N: one addmm, the padding's -inf its bias
    if features.dim() == 2:  # b x C, a chain's head: no reshaping either side
        return torch.addmm(padding, features, columns)
    flat = torch.addmm(padding, features.reshape(-1, features.size(-1)), columns)
    return flat.view(*features.shape[:-1], columns.size(1))


def best_tokens(decoder, features, vocab, topn):
    """The `topn` best tokens of proposal features and their log-probs: ... x C -> ... x topn.

    One best token by max, not topk (a sort, slower over a row): which of tied tokens a
    proposal names changes no output, verification being exact."""
    lprobs = decoding_logits(decoder, features, vocab).log_softmax(dim=-1)
    if topn == 1:
        lprobs, tokens = lprobs.max(dim=-1, keepdim=True)
        return tokens, lprobs
    lprobs, tokens = lprobs.topk(topn, dim=-1)
    return tokens, lprobs


def choose(logits, topn):
    """A chain's choice at one head from its logits b x N: the token the next head reads (b)
    and the head's proposals (b, or b x topn best first, topn > 1).

    The best by argmax of the logits, which is the log-softmax's (tied tokens change no
    output, verification being exact): no log-softmax where no one reads log-probs."""
    if topn == 1:
        token = logits.argmax(dim=-1)
        return token, token
    best = logits.topk(topn, dim=-1)[1]
    return best[:, 0], best


def chain_proposals(chosen, logits, topn, log_probs):
    """A chain's proposals from each head's choose() and logits (lists of b, or b x topn, and
    b x N): tokens b x w-1 x topn, and their log-probs b x w-1 x topn, one log-softmax over
    all heads, or None (not log_probs)."""
    tokens = torch.stack(chosen, dim=1)  # b x w-1 (x topn)
    if topn == 1:
        tokens = tokens.unsqueeze(-1)
    if not log_probs:
        return tokens, None
    return tokens, torch.stack(logits, dim=1).log_softmax(dim=-1).gather(-1, tokens)


def no_proposals(features, topn, log_probs):
    """What propose() returns for a block of width 1: tokens b x 0 x topn, log-probs alike or None."""
    empty = features.new_empty(features.size(0), 0, topn)
    return empty.long(), empty if log_probs else None


def following_tokens(inputs, pad, eos):
    """The token after each decoder input, as fairseq's targets: B x T -> B x T.

    fairseq feeds the target rotated right (EOS first), so the target is the input
    shifted left, EOS after the last real token and pad on padding (either side).
    """
    following = inputs.new_full(inputs.shape, pad)
    following[:, :-1] = inputs[:, 1:]
    real = inputs.ne(pad)
    following = following.masked_fill(real & following.eq(pad), eos)
    return following.masked_fill(~real, pad)


def after_head1(heads, head_type, decoder, block_size, layout):
    """Attach `heads` of `head_type`, which follow head 1 (the decoder's own output), to `decoder`."""
    if layout != "base":
        raise BlockwiseRequestError(f"--head-type {head_type} needs --head-layout base: head 1 is the decoder's own output")
    heads.__dict__["decoder"] = decoder  # not registered: no second copy in state_dict
    heads.block_size, heads.layout = block_size, layout


class ChainedHeads(Arranged, nn.Module, Proposer):
    """Heads 2..k in a chain, each told the token the head before it predicts.

    Ankner et al., "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding",
    2024: the paper's heads guess their tokens independently, so head 3 cannot know
    which word head 2 chose. Head i (i >= 2) reads head i-1's features f and the
    embedding of head i-1's token y: f_i = f + W2_i act(W1_i [f; E y]), f_1 the decoder
    output (head 1, the base layout only). y is the reference in training (teacher
    forcing) and head i-1's proposal in decoding, so proposals are made one head after
    another: k-1 small steps over the shortlist, no extra decoder pass. W2_i starts at
    zero, so every head starts as the base's next-token head. The embedding table and
    output projection are the decoder's, reached through `decoder` (not registered).
    """

    independent = False  # head i reads head i-1's proposal
    nodes_read_proposals = False  # nodes() proposes each node after its own parent

    def __init__(self, decoder, block_size, layout, ffn_dim, activation_fn, dropout):
        super().__init__()
        after_head1(self, "chained", decoder, block_size, layout)
        embed_dim, token_dim = decoder.output_embed_dim, decoder.embed_tokens.embedding_dim
        links = range(block_size - 1)
        self.fc_in = nn.ModuleList([nn.Linear(embed_dim + token_dim, ffn_dim) for _ in links])
        self.fc_out = nn.ModuleList([nn.Linear(ffn_dim, embed_dim) for _ in links])
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.dropout = HashDropout(dropout)
        for fc_in, fc_out in zip(self.fc_in, self.fc_out):
            nn.init.xavier_uniform_(fc_in.weight)
            nn.init.zeros_(fc_in.bias)
            nn.init.zeros_(fc_out.weight)
            nn.init.zeros_(fc_out.bias)

    def link(self, i, features, tokens):
        """Head i+2's features from head i+1's: features ... x C, tokens ... -> ... x C."""
        decoder, fc_in, fc_out = self.decoder, self.fc_in[i], self.fc_out[i]
        if not self.training and not any(m._forward_hooks or m._forward_pre_hooks
                                         for m in (fc_in, fc_out, decoder.embed_tokens)):
            # Decoding calls this k-1 times an invocation on a few rows: the same function
            # without nn.Module's call machinery and an identity dropout, which cost more
            # there than the products.
            embedded = decoder.embed_scale * F.embedding(tokens, decoder.embed_tokens.weight)  # ... x E
            hidden = self.activation_fn(F.linear(torch.cat([features, embedded], dim=-1), fc_in.weight, fc_in.bias))
            return features + F.linear(hidden, fc_out.weight, fc_out.bias)
        embedded = decoder.embed_scale * decoder.embed_tokens(tokens)  # ... x E
        hidden = self.activation_fn(fc_in(torch.cat([features, embedded], dim=-1)))
        return features + self.dropout(fc_out(hidden))

    def block_features(self, x, count=None, inputs=None, encoder_out=None):
        """Teacher-forced features of the first `count` heads: x B x T x C -> B x T x count x C.

        inputs: B x T, the decoder's input tokens; head i+1 reads the reference token
        head i predicts (i steps after each input).
        """
        count = self.block_size if count is None else count
        features = [x]
        if count > 1:
            if inputs is None:
                raise ValueError("chained heads need the decoder's input tokens")
            decoder = self.decoder
            following = following_tokens(inputs, decoder.padding_idx, decoder.dictionary.eos())
            for i in range(count - 1):
                features.append(self.link(i, features[-1], shift_target(following, i, decoder.padding_idx)))
        return torch.stack(features, dim=-2)

    def head1_features(self, x):
        """Head 1 is the decoder's own output: ... x C -> ... x C."""
        return x

    def proposal_logits(self, x):
        """Training logits of heads 2..k: ... x C -> ... x N, N the model's --head-vocab."""
        return shortlist_logits(self.decoder, x)

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        """Heads 2..width after one position, one after another: `topn` best tokens each
        (the Proposer protocol).

        Head 2 reads `token` (b, head 1's choice after `features`, the block's first
        token), each later head its predecessor's best token: the best chain, whose
        alternatives at each head (topn > 1) follow it. A tree's nodes follow their own
        parents instead (nodes()). Links run on ChainWeights where they can (decoding_weights).
        """
        if width <= 1:
            return no_proposals(features, topn, log_probs)
        weights = self.decoding_weights(vocab, encoder_out)
        chosen, logits, scores = [], [], None
        for i in range(width - 1):
            if weights is None:
                features = self.link(i, features, token)  # b x C
                scores = decoding_logits(self.decoder, features, vocab)  # b x N
            else:
                features, scores = weights.link(i, features, token, scores, i == width - 2)
            token, best = choose(scores, topn)
            chosen.append(best)
            logits.append(scores)
        return chain_proposals(chosen, logits, topn, log_probs)

    def reads(self):
        return (self.decoder.embed_tokens,)

    def arrange(self, columns, padding):
        return ChainWeights(self, columns, padding)

    def nodes(self, proposals, tree, features, token, vocab=0, encoder_out=None):
        """A Hydra tree (Ankner et al., 2024): each node's children are proposed
        after the node's own token, not after the best chain's (the Proposer protocol).

        Node v at depth d, its token t_v chosen from features g_v (siblings share them), has
        children among the best tokens of head d+2 after link(d, g_v, t_v); g_root is the
        decoder output `features` (b x C), t_root `token` (b). One link and one projection per
        depth over all its parents at once: b x P_d rows, on ChainWeights where they can run
        (decoding_weights). propose()'s chain is the tree's rank-0 path, its lprobs what
        --blockwise-confidence reads.
        """
        weights = self.decoding_weights(vocab, encoder_out)
        chosen = token.new_empty(token.size(0), tree.size)  # b x n: each node's token
        chosen[:, 0] = token
        g, logits = features[:, None], None  # b x P_d x C, b x P_d x N: each parent's features, its head's logits
        for d, (parents, sources, children, rows, ranks, topn) in enumerate(tree.hydra):
            if weights is None:
                g = self.link(d, g[:, sources], chosen[:, parents])  # b x P_d x C: the children's features
                logits = decoding_logits(self.decoder, g, vocab)  # b x P_d x N
            else:
                g, logits = weights.link_parents(d, g, logits, sources, chosen[:, parents],
                                                 d == len(tree.hydra) - 1)
            best = logits.topk(topn, dim=-1)[1]  # b x P_d x topn
            chosen[:, children] = best[:, rows, ranks]
        return chosen[:, 1:]


from .draft import DraftDecoder  # noqa: E402 (it builds on this module's Proposer)

HEAD_TYPES = {"independent": ProposalHeads, "chained": ChainedHeads, "draft": DraftDecoder}
