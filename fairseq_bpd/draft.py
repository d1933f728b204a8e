"""--head-type draft: one decoder layer that reads the source drafts heads 2..k.

Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML
2024, for a decoder-only model: one layer fed, at each position, the base's top-layer
features f_j and the embedding of the next token x_{j+1}, run autoregressively. Here it is
the encoder-decoder version: the layer also attends to the base's encoder output (where
the words still to be translated are), as SpecDec's drafter does (Xia et al., 2023).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from fairseq import utils
from fairseq.modules import LayerNorm, MultiheadAttention

from .heads import (Proposer, after_head1, chain_proposals, choose, decoding_logits, following_tokens,
                    no_proposals, shortlist_logits)
from .draft_step import DraftState, DraftWeights, Waiting, decode_step, feed_waiting, tree_plan
from . import kernels
from .dropout import HashDropout
from .product import Int8Product, Product
from .targets import shift_target


def split_heads(x, heads):
    """b x L x C -> b x H x L x C/H."""
    return x.view(*x.shape[:2], heads, -1).transpose(1, 2)


def attend(attention, x, keys, values, allowed):
    """`attention`'s projections around scaled dot-product attention.

    x: b x m x C queries; keys, values: b x H x L x d (projected); allowed: b x m x L
    (or broadcastable) bools, True where a query may attend. Returns b x m x C.
    """
    q = split_heads(attention.q_proj(x), attention.num_heads)  # b x H x m x d
    # In float32 under --heads-bf16's autocast (its bfloat16 products made q, keys and values):
    # torch's bfloat16 attention backward on a CPU took several times float32's.
    dtype = torch.float32 if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        y = F.scaled_dot_product_attention(q.to(dtype), keys.to(dtype), values.to(dtype),
                                           attn_mask=allowed[:, None])
    return attention.out_proj(y.transpose(1, 2).reshape(x.shape))


def keys_values(attention, x):
    """Projected keys and values of x b x L x C: both b x H x L x d."""
    h = attention.num_heads
    return split_heads(attention.k_proj(x), h), split_heads(attention.v_proj(x), h)


def encoder_states(encoder_out):
    """The encoder output S x b x C that the draft attends to (a ValueError where none is given)."""
    if encoder_out is None or not encoder_out["encoder_out"]:
        raise ValueError("the draft decoder reads the encoder output: pass encoder_out")
    return encoder_out["encoder_out"][0]


class DraftDecoder(nn.Module, Proposer):
    """Heads 2..k as the autoregressive steps of one Transformer decoder layer.

    Entry j of the draft reads z_j = W_in [f_j; E x_{j+1}] (f_j the base's top-layer
    features at decoder input x_j), self-attends to the entries before it, attends to the
    encoder output and passes a feed-forward layer (pre-norm); its output is
    g_j = f_j + W_out(layer(z)), projected by the decoder's shared output projection over
    --head-vocab: g_j predicts x_{j+2} (head 2). Head i+1 is the draft's i-th step after
    the last accepted position: its entry reads its own previous output g and the token
    head i predicts (the reference in training, head i's proposal in decoding), and
    attends to the accepted prefix's entries and to its own earlier steps, exactly in
    training (one pass per step over every position, each position's steps seeing only
    their own) as in decoding. A tree (nodes()) is drafted per node: each node's step reads
    its parent's drafted output and its own token and sees its own ancestors' steps, what
    the chain's step reads on that node's path. W_out starts at zero: every head starts as
    head 1.
    """

    independent = False  # each step reads the proposal before it
    nodes_read_proposals = False  # nodes() drafts each node after its own ancestors
    reads_lexicon = True  # its vocab may be a ProposalVocabulary (lexicon.py): logits() and the chain read it
    cache_columns = 64  # the decoding cache's columns at a batch's start (doubled when full)
    # Blocks of one in a row whose positions wait unfed before their keys and values are
    # written (feed_waiting): what bounds the list held and the next first step.
    waiting_most = 64
    # --draft-train-heads: the heads whose steps training unrolls (None: all k); decoding
    # and validation run all k.
    train_heads = None

    def __init__(self, decoder, block_size, layout, ffn_dim, activation_fn, dropout):
        super().__init__()
        after_head1(self, "draft", decoder, block_size, layout)
        embed_dim, token_dim = decoder.output_embed_dim, decoder.embed_tokens.embedding_dim
        heads = decoder.cfg.decoder.attention_heads
        self.fc_in = nn.Linear(embed_dim + token_dim, embed_dim)
        self.self_attn_norm, self.encoder_attn_norm, self.ffn_norm, self.final_norm = (
            LayerNorm(embed_dim) for _ in range(4))
        self.self_attn = MultiheadAttention(embed_dim, heads, self_attention=True)
        encoder_dim = decoder.cfg.encoder.embed_dim
        self.encoder_attn = MultiheadAttention(embed_dim, heads, kdim=encoder_dim, vdim=encoder_dim,
                                               encoder_decoder_attention=True)
        self.ffn1, self.ffn2 = nn.Linear(embed_dim, ffn_dim), nn.Linear(ffn_dim, embed_dim)
        self.fc_out = nn.Linear(embed_dim, embed_dim)
        self.activation_fn = utils.get_activation_fn(activation_fn)
        self.dropout = HashDropout(dropout)
        nn.init.zeros_(self.fc_out.weight)
        nn.init.zeros_(self.fc_out.bias)
        self.state = None

    # The layer, shared by training and decoding.

    def entry(self, features, tokens):
        """The layer's input: features ... x C, tokens ... -> ... x C."""
        embedded = self.decoder.embed_scale * self.decoder.embed_tokens(tokens)  # ... x E
        # The residual stream in the features' dtype: under --heads-bf16 only products are bfloat16.
        return self.fc_in(torch.cat([features, embedded], dim=-1)).to(features.dtype)

    def layer(self, z, normed, features, keys, values, allowed, source):
        """The layer over entries z b x m x C (normed: self_attn_norm(z), which made their own
        keys) whose self-attention sees `keys`, `values` (b x H x L x d) where `allowed`
        (b x m x L); source: the encoder's keys, values and allowed columns. Returns the
        drafted features b x m x C."""
        z = z + self.dropout(attend(self.self_attn, normed, keys, values, allowed))
        z = z + self.dropout(attend(self.encoder_attn, self.encoder_attn_norm(z), *source))
        z = z + self.dropout(self.ffn2(self.activation_fn(self.ffn1(self.ffn_norm(z)))))
        return features + self.dropout(self.fc_out(self.final_norm(z)))

    def source(self, encoder_out):
        """The encoder output's keys and values b x H x S x d, and where to attend b x 1 x S."""
        enc = encoder_states(encoder_out).transpose(0, 1)  # b x S x C
        padding = encoder_out["encoder_padding_mask"]
        allowed = ~padding[0][:, None] if padding else enc.new_ones(enc.size(0), 1, enc.size(1), dtype=torch.bool)
        return (*keys_values(self.encoder_attn, enc), allowed)

    # Training: every position's steps at once, teacher-forced.

    def block_features(self, x, count=None, inputs=None, encoder_out=None):
        """Teacher-forced features of the first `count` heads: x B x T x C -> B x T x count x C
        (default: all k, or in training --draft-train-heads).

        inputs: B x T, the decoder's input tokens; encoder_out: the base's. Step i (head
        i+1) at position j reads the reference token i steps after input j, and attends
        to entries 0..j of step 1 (the accepted prefix) and to its own steps 2..i at j.
        """
        if count is None:
            count = self.train_heads if self.training and self.train_heads else self.block_size
        if count == 1:
            return x.unsqueeze(-2)
        if inputs is None:
            raise ValueError("the draft decoder needs the decoder's input tokens")
        decoder = self.decoder
        following = following_tokens(inputs, decoder.padding_idx, decoder.dictionary.eos())  # B x T
        source = self.source(encoder_out)
        T = x.size(1)
        real = inputs.ne(decoder.padding_idx)  # B x T
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        prefix = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        # Padding is never attended to, but each entry sees itself (no empty row).
        prefix = (prefix & real[:, None, :]) | eye  # B x T x T
        features, keys, values, allowed = [x], [], [], prefix
        for i in range(count - 1):
            z = self.entry(features[-1], shift_target(following, i, decoder.padding_idx))  # B x T x C
            normed = self.self_attn_norm(z)
            k, v = keys_values(self.self_attn, normed)
            keys.append(k)
            values.append(v)
            if i > 0:
                allowed = torch.cat([allowed, eye.expand_as(prefix)], dim=-1)  # B x T x (i+1)T
            features.append(self.layer(z, normed, features[-1], torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                       allowed, source))
        return torch.stack(features, dim=-2)

    def head1_features(self, x):
        """Head 1 is the decoder's own output: ... x C -> ... x C."""
        return x

    def proposal_logits(self, x):
        """Training logits of heads 2..k: ... x C -> ... x N, N the model's --head-vocab."""
        return shortlist_logits(self.decoder, x)

    # Decoding: the Proposer protocol, with the draft's own cache.

    def keep(self, path, kept, features, block):
        """The accepted positions before the last (its features come with propose()) wait,
        with their next tokens, to be fed on the next first step: features b x n x C and
        block b x n (a chain's, or a tree's nodes) along path b x D+1 (node indices), the
        first kept - 1 of them. After a block of one that proposed nothing none: its one
        position is the next last, and the last before it was deferred (defer)."""
        if self.state is not None and self.state.skipped:
            self.state.skipped = False
            return
        if self.state is None or not self.state.proposed:
            # No proposal led to this block: a new batch's first (on BOS alone), the state
            # a finished batch's. Dropped here, so that reorder cannot adopt it.
            self.state = None
            return
        self.state.proposed = False
        if features.size(0) == 1:  # batch 1: the row's own lengths, one device round trip a block
            most = int(kept)
            if most == 1:  # nothing waits: the next first step feeds the last position alone
                self.state.pending = None
                return
            longest, row = self.state.longest + most, path[0]
            waiting, following = features.index_select(1, row[: most - 1]), block.index_select(1, row[1:most])
        else:  # one device round trip a block: the waiting count and the longest prefix after them
            most, longest = torch.stack([kept.max(), (self.state.length + kept).max()]).tolist()
            nodes = path[:, : most - 1]  # b x m
            waiting = features.gather(1, nodes[..., None].expand(-1, -1, features.size(-1)))  # b x m x C
            following = block.gather(1, path[:, 1:most])  # b x m
        self.state.pending = Waiting(waiting, following, kept - 1, longest)

    def reorder(self, rows):
        if self.state is not None:
            self.state.select(rows)

    def start(self, features, encoder_out):
        """A fresh state for the batch whose encoder output is `encoder_out`."""
        keys, values, allowed = self.source(encoder_out)
        source_mask = None  # where no row has padding (asked once a batch)
        if not allowed.all():
            source_mask = keys.new_zeros(allowed.shape).masked_fill_(~allowed, -math.inf)[:, None]  # b x 1 x 1 x S
        cache = features.new_zeros(features.size(0), self.cache_columns, 3 * features.size(-1))
        self.state = DraftState(cache, keys, values, source_mask, encoder_out["encoder_out"][0], self.weights())

    def weights(self):
        """DraftWeights, arranged again when any weight they come from changes (weights_key)."""
        from .decoder import weights_key  # the decoder imports the heads: no cycle at import

        key = weights_key(*self.parameters(), self.decoder.embed_tokens.weight)
        if key is None or getattr(self, "_weights_key", None) != key:
            self._weights, self._weights_key = DraftWeights(self), key
        return self._weights

    def forget_arranged(self):
        self._weights = self._weights_key = None  # arranged for decoding only: none kept in training
        self._reduced_projection = None

    def logits(self, drafted, vocab):
        """decoding_logits of drafted features ... x C -> ... x N, on an int8 copy of the
        decoder's proposal projection where the draft's weights are reduced (DraftWeights):
        made again whenever the decoder arranges its projection anew (another Product).
        vocab: N (the first N entries; 0: all) or a ProposalVocabulary, whose columns are its
        first N entries' then its extras' (choose's columns are then vocab.tokens())."""
        if not isinstance(vocab, int):
            return torch.cat([self.logits(drafted, vocab.first), self.extra_logits(drafted, vocab)], dim=-1)
        projection = self.reduced_projection(vocab)
        if projection is None:
            return decoding_logits(self.decoder, drafted, vocab)
        return projection(drafted.reshape(-1, drafted.size(-1))).view(*drafted.shape[:-1], -1)

    def extra_logits(self, drafted, vocab):
        """The logits of a ProposalVocabulary's extras: ... x C -> ... x E, on the same kind of
        product as its first entries' (logits()), made once per batch from the same weights."""
        product = self.extra_projection(vocab)
        if product is None:
            logits = decoding_logits(self.decoder, drafted, 0)  # ... x V: no plain projection, or weights that keep no version
            return logits.index_select(-1, vocab.extras)
        return product(drafted.reshape(-1, drafted.size(-1))).view(*drafted.shape[:-1], -1)

    def extra_projection(self, vocab):
        """A Product (Int8Product where the first entries' is) over the columns of vocab's
        extras, kept on `vocab` (the batch's) for the projection it was made from; None where
        the decoder's projection is not a Product."""
        projection = self.decoder.transposed_projection() if self.decoder.plain_projection() else None
        if not isinstance(projection, Product):
            return None
        reduced = self.reduced_projection(vocab.first) is not None
        kept = vocab.arranged.get(reduced)
        if kept is None or kept[0] is not projection:
            columns = projection[0].index_select(1, vocab.extras)  # C x E
            # lazy: a batch's extras are read by few products, fewer than packing them would cost
            product = (Int8Product if reduced else Product)(columns, columns.new_zeros(columns.size(1)), lazy=True)
            kept = vocab.arranged[reduced] = projection, product
        return kept[1]

    def reduced_projection(self, vocab):
        """The int8 copy of the decoder's proposal projection (an Int8Product), or None where
        the draft's weights are not reduced or the projection is not a Product."""
        projection = self.decoder.proposal_projection(vocab) if self.state.weights.reduced else None
        if not isinstance(projection, Product):
            return None
        kept = getattr(self, "_reduced_projection", None)
        if kept is None or kept[0] is not projection:
            kept = self._reduced_projection = projection, Int8Product(*projection)
        return kept[1]

    def train(self, mode=True):
        self.forget_arranged()
        return super().train(mode)

    def sync(self, features, encoder_out):
        """The state for this call: a new batch (another encoder output) starts afresh."""
        state, encoder = self.state, encoder_states(encoder_out)  # before its first read
        if state is None or (state.encoder is not None and state.encoder is not encoder) \
                or state.length.size(0) != features.size(0):
            self.start(features, encoder_out)
        self.state.encoder = encoder
        return self.state

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        """Heads 2..width after the last accepted position, one draft step after another:
        `topn` best tokens each (the Proposer protocol).

        The first step (first_step) feeds the accepted positions waiting since keep() (of
        every block since the last proposal); each later step reads the step before and its
        best token, in columns past the accepted prefix, under one mask made for all of them
        (at batch 1 none: each step's window of the cache ends at its own column). A width
        of 1 drafts nothing (defer). Under a confidence the steps stop after the first at
        which every sentence's sum of top log-probs is below it (EAGLE-2's dynamic draft):
        the block is cut before that proposal anyway, and each step is a full layer and a
        shortlist projection.
        """
        if width <= 1:
            self.defer(features, token, encoder_out)
            return no_proposals(features, topn, log_probs)
        if features.size(0) == 1 and topn == 1 and not log_probs and confidence == -math.inf:
            proposals = self.compiled_chain(features, token, width, vocab, encoder_out)
            if proposals is not None:
                return proposals, None
        state, drafted = self.first_step(features, token, encoder_out)
        alone = features.size(0) == 1  # batch 1: each step in the column the host knows, no mask
        if width > 2:
            state.reserve(state.longest + width - 2)
            if not alone:
                columns = state.length[:, None] + state.positions[: width - 2]  # b x width-2: each later step's
                masks = state.mask(columns, state.longest + width - 2)  # b x 1 x width-2 x used
        chosen, logits, lprobs, sure = [], [], [], 0.0
        for i in range(width - 1):
            if i > 0 and alone:  # head i+2's step reads head i+1's: one entry, in column length + i - 1
                drafted = decode_step(state, drafted, token, None, None, state.longest + i - 1)
            elif i > 0:
                drafted = decode_step(state, drafted, token, columns[:, i - 1 : i], masks[:, :, i - 1 : i])
            logits.append(self.logits(drafted, vocab))  # b x N
            token, best = choose(logits[-1], topn)  # columns of the logits (a ProposalVocabulary's: not tokens)
            chosen.append(best)
            if not isinstance(vocab, int):
                token = vocab.tokens(token)
            if confidence > -math.inf:  # each step's log-probs: confident_width sums these (returned where asked)
                lprobs.append(logits[-1].log_softmax(dim=-1).gather(-1, best.view(best.size(0), -1)))  # b x topn
                sure = sure + lprobs[-1][:, 0]  # b: as confident_width sums them
                if not bool((sure >= confidence).any()):
                    break
        if lprobs:  # each step's, as the stop summed them (not made again from the logits)
            tokens, lprobs = chain_proposals(chosen, [], topn, False)[0], torch.stack(lprobs, dim=1)
        else:
            tokens, lprobs = chain_proposals(chosen, logits, topn, log_probs)  # gathered by column
        return (tokens if isinstance(vocab, int) else vocab.tokens(tokens)), lprobs if log_probs else None

    def compiled_chain(self, features, token, width, vocab, encoder_out):
        """propose()'s chain at batch 1 (features 1 x C, token 1), no log-probs, in one call of
        the compiled layer (DraftLayer.chain: the first step, then each step's best token on
        the int8 proposal projection and the next step): tokens 1 x width-1 x 1; the state
        left as the Python loop leaves it. None where it does not serve: the first step made
        already, no compiled layer or int8 projection, not float32, autograd."""
        state = self.sync(features, encoder_out)
        lexical = not isinstance(vocab, int)
        layer, projection = state.weights.layer, self.reduced_projection(vocab.first if lexical else vocab)
        extras = self.extra_projection(vocab) if lexical and projection is not None else None
        if (state.proposed or layer is None or projection is None or features.dtype != torch.float32
                or features.requires_grad or kernels.module() is None
                or (lexical and not isinstance(extras, Int8Product))):
            return None
        more = (extras.packed, extras.scales32, vocab.extras) if lexical else ()
        start = state.longest
        inputs, tokens = state.alone_entries(features, token)  # m x C, m
        state.reserve(start + inputs.size(0) + width - 2)
        state.root, proposals = layer.chain(inputs, tokens, state.cache, start, state.source_keys,
                                            state.source_values, state.source_mask, projection.packed,
                                            projection.scales32, projection[1], width - 1, *more)
        state.length, state.longest, state.proposed = state.length + inputs.size(0), start + inputs.size(0), True
        return proposals.view(1, width - 1, 1)

    def defer(self, features, token, encoder_out):
        """A block of one proposes nothing, so its first step is not made: the last accepted
        position (features b x C, after which head 1 chose `token` b) waits with the others
        (DraftState.defer), for the next first step to feed, however many blocks later. No
        operation, unless waiting_most wait: their keys and values are written then."""
        state = self.sync(features, encoder_out)
        if state.proposed:  # this block's first step is made already
            return
        state.defer(features, token)
        if len(state.deferred) >= self.waiting_most:
            feed_waiting(state)

    def first_step(self, features, token, encoder_out):
        """The state and the block's first draft step b x C after the last accepted position
        (features b x C, after which head 1 chose `token` b): fed once a block (feed_accepted),
        by propose() or nodes(), whichever comes first (--blockwise-confidence calls both)."""
        state = self.sync(features, encoder_out)
        if not state.proposed:
            state.root, state.proposed = self.feed_accepted(state, features, token), True
        return state, state.root

    def feed_accepted(self, state, features, token):
        """Feed the waiting accepted positions and the last one (features b x C, token b):
        the draft's first step, b x C. The accepted prefix grows by them."""
        if features.size(0) == 1:
            return self.feed_alone(state, features, token)
        pending, state.pending = state.settle(), None
        if pending is None or pending.features.size(1) == 0:  # the last position alone
            count, longest = (0, state.longest + 1) if pending is None else (pending.count, pending.longest)
            inputs, tokens = features[:, None], token[:, None]  # b x 1
        else:
            count, longest, rows = pending.count, pending.longest, state.rows
            inputs = torch.cat([pending.features, features[:, None]], dim=1)  # b x m+1 x C: the last after each row's own
            tokens = torch.cat([pending.tokens, token[:, None]], dim=1)  # b x m+1
            inputs[rows, count] = features
            tokens[rows, count] = token
        # A row with fewer waiting than m writes its spare entries past its prefix, up to
        # the longest prefix before + m (overwritten later); real entries see < longest.
        state.reserve(state.longest + inputs.size(1))
        columns = state.length[:, None] + state.positions[: inputs.size(1)]  # b x m+1
        if inputs.size(1) == 1:
            drafted = decode_step(state, features, token, columns, state.mask(columns, longest))  # b x C
        else:  # each row's last entry alone is made: of the others the draft keeps their keys and values
            made = (state.length + count)[:, None]  # b x 1: its column
            drafted = decode_step(state, inputs.reshape(-1, inputs.size(-1)), tokens.reshape(-1), columns,
                                  state.mask(made, longest), None, count)  # b x C: start None, last
        state.length, state.longest = state.length + count + 1, longest
        return drafted

    def feed_alone(self, state, features, token):
        """feed_accepted at batch 1, where every waiting position is real and the host knows
        the row's prefix (state.longest): its m+1 entries in columns longest.., of which only
        the last's features are made. Features 1 x C, token 1 -> 1 x C."""
        start = state.longest
        inputs, tokens = state.alone_entries(features, token)  # m+1 x C, m+1
        state.reserve(start + inputs.size(0))
        drafted = decode_step(state, inputs, tokens, None, None, start, True)  # last
        state.length, state.longest = state.length + inputs.size(0), start + inputs.size(0)
        return drafted

    def nodes(self, proposals, tree, features, token, vocab=0, encoder_out=None):
        """A tree drafted per node, as Hydra's (Ankner et al., 2024; the Proposer protocol):
        tokens b x n-1, each node's children after the node's own path, not the best chain's.

        The root's children are the best tokens of the first step (features b x C, `token`
        b); node v at depth d >= 1, its token t_v chosen from its parent's drafted features
        g, drafts its children by the step that reads g and t_v, in column length + o_v
        (TreePlan) under a mask that shows it the accepted prefix and its own ancestors'
        entries: the chain's step on v's path. One step per depth over all its parents at
        once, b x P_d rows. `proposals` are not read (propose(), where --blockwise-confidence
        calls it, has made the first step already).
        """
        state, g = self.first_step(features, token, encoder_out)
        g = g[:, None]  # b x P x C: each parent's step, the root's first
        plan, b = tree_plan(tree), token.size(0)
        if plan.entries:
            used = state.longest + plan.entries
            state.reserve(used)
            masks = state.tree_mask(plan, used)  # b x 1 x O x used
            if b == 1:  # batch 1: a depth's entries in columns the host knows, O x used
                masks = masks[0, 0]
        chosen = token.new_empty(b, tree.size)  # b x n: each node's token
        chosen[:, 0] = token
        for d, (parents, sources, children, rows, ranks, topn) in enumerate(tree.hydra):
            if d > 0:  # the depth-d parents' steps, each after the row its token came from
                entries = slice(plan.starts[d], plan.starts[d] + len(parents))
                inputs, tokens = g[:, sources].reshape(-1, g.size(-1)), chosen[:, parents].reshape(-1)
                if b == 1:
                    g = decode_step(state, inputs, tokens, None, masks[entries], state.longest + entries.start)
                else:
                    columns = state.length[:, None] + state.positions[entries]  # b x P
                    g = decode_step(state, inputs, tokens, columns, masks[:, :, entries])
                g = g.view(b, len(parents), -1)
            logits = self.logits(g, vocab)  # b x P x N
            best = logits.argmax(-1, keepdim=True) if topn == 1 else logits.topk(topn, dim=-1)[1]  # b x P x topn
            if not isinstance(vocab, int):  # columns to tokens
                best = vocab.tokens(best)
            chosen[:, children] = best[:, rows, ranks]
        return chosen[:, 1:]
