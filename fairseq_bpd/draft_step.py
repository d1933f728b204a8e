"""The draft decoder's decoding step (draft.py): its cache, its weights arranged once, one step.

Decoding runs the draft's layer k-1 times an invocation on a few rows, so its cost is the
products' weights and per-operation overhead, not arithmetic: the step computes the same
function as the layer that training runs (DraftDecoder.entry, .layer), on weights arranged
once per change (one product for q, k and v; W_in's token half a table of every token's
term; the layer norms' affine folded into the products after them; relu's second bias a
hidden unit), and asks the device nothing (the host knows every length it needs). Its q,
k and v product is written in the cache, in place; at batch 1, where every column is known
on the host, the product writes it there itself and a chain's steps need no mask. It
rounds differently from training's pass, which is why the tests compare them in float64.
"""
import math
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels
from .product import INT8_ROWS, Int8Product, Product, reducible
from .static_pass import merge_heads, product, split_heads, transposed


class Waiting(NamedTuple):
    """Accepted positions not yet fed to the draft: features b x M x C, their next tokens
    b x M, how many of the M are real in each row (b; each row's real ones first), and the
    longest accepted prefix once they and the last position are fed (a host int, so that no
    draft step asks the device)."""

    features: torch.Tensor
    tokens: torch.Tensor
    count: torch.Tensor
    longest: int


def folded(norm, *linears):
    """The linears' product after `norm` with the norm's affine folded in (γ into the rows
    of Wᵀ, β Wᵀ + b into the bias): LN(x) Wᵀ + b = n(x) (γ Wᵀ) + (β Wᵀ + b), n(x) the plain
    normalisation, so that the step's norms scale nothing. C x out and out."""
    weight, bias = transposed(*linears)
    if norm.weight is None:
        return Product(weight, bias)
    return Product(norm.weight.detach()[:, None] * weight, torch.addmv(bias, weight.t(), norm.bias.detach()))


def reduced_feed_forward(ffn1, ffn2):
    """The feed-forward's products (C x F, F x C) as Int8Products, its hidden units padded
    with units of zero weights and bias (an activation of 0 that the zero rows of ffn2 read)
    to a multiple of INT8_ROWS: ffn2's C must be one."""
    (w1, b1), (w2, b2) = ffn1, ffn2
    extra = -w1.size(1) % INT8_ROWS
    return Int8Product(F.pad(w1, (0, extra)), F.pad(b1, (0, extra))), Int8Product(F.pad(w2, (0, 0, 0, extra)), b2)


class DraftWeights:
    """The draft's decoding weights, arranged once per change: products as x · Wᵀ on
    contiguous copies (static_pass.transposed), each layer norm's affine folded into the
    product after it (folded), the self-attention's q, k and v in one, and W_in's token half
    folded into a table: entry z = f · W_fᵀ + table[x], with table = (s E) W_tᵀ + b_in for
    every token (one row lookup instead of a product and a cat). Under relu the
    feed-forward's second bias is one more hidden unit, always 1 (its pre-activation's
    weights 0, its bias 1; relu(1) = 1), so that its product adds it and the residual:
    ffn2 is then (weights, None). reduced (float32 on a CPU, product.reducible): the q, k,
    v and feed-forward products on int8 weights (Int8Product; the shortlist's too,
    DraftDecoder.logits), whose rounding changes proposals a little and no output (head 1
    verifies them in float32); square_reduced (the compiled kernels built, kernels.py): the
    C x C products too, and `layer`, for relu drafts, the compiled batch-1 step
    (csrc/draft_step.cpp) on these int8 weights, else None."""

    def __init__(self, draft):
        decoder, width = draft.decoder, draft.fc_in.weight.size(0)
        w_in = draft.fc_in.weight.detach()  # C x (C + E): the features' columns, then the token's
        embedded = decoder.embed_scale * decoder.embed_tokens.weight.detach()  # V x E
        self.table = torch.addmm(draft.fc_in.bias.detach(), embedded, w_in[:, width:].t())  # V x C
        self.features_in = w_in[:, :width].t().contiguous()  # C x C
        attention, source = draft.self_attn, draft.encoder_attn
        self.qkv = folded(draft.self_attn_norm, attention.q_proj, attention.k_proj, attention.v_proj)  # C x 3C
        self.self_out, self.source_out = transposed(attention.out_proj), transposed(source.out_proj)
        self.source_query = folded(draft.encoder_attn_norm, source.q_proj)
        self.ffn1, self.ffn2 = folded(draft.ffn_norm, draft.ffn1), transposed(draft.ffn2)
        self.fc_out = folded(draft.final_norm, draft.fc_out)
        self.heads, self.activation_fn = attention.num_heads, draft.activation_fn
        if draft.activation_fn is F.relu:
            (w1, b1), (w2, b2) = self.ffn1, self.ffn2
            self.ffn1 = Product(F.pad(w1, (0, 1)), F.pad(b1, (0, 1), value=1.0))  # C x F+1: the unit
            self.ffn2, self.activation_fn = (torch.cat([w2, b2[None]]), None), torch.relu_  # F+1 x C
        self.reduced = reducible(self.qkv[0])
        if self.reduced:  # the widest products on int8 weights (Int8Product)
            self.qkv, (self.ffn1, self.ffn2) = Int8Product(*self.qkv), reduced_feed_forward(self.ffn1, self.ffn2)
        self.square_reduced = self.reduced and kernels.module() is not None
        if self.square_reduced:  # the C x C ones too, where the compiled kernel (not torch's) serves them
            self.features_in = Int8Product(self.features_in, None)
            self.self_out, self.source_out = Int8Product(*self.self_out), Int8Product(*self.source_out)
            self.source_query, self.fc_out = Int8Product(*self.source_query), Int8Product(*self.fc_out)
        self.eps = tuple(norm.eps for norm in (draft.self_attn_norm, draft.encoder_attn_norm, draft.ffn_norm,
                                                draft.final_norm))
        self.layer = compiled_layer(self) if self.square_reduced and self.activation_fn is torch.relu_ else None

    def __getstate__(self):
        # copy.deepcopy and pickle: the compiled layer is made again from the copied products
        # (a compiled object cannot be copied; it holds the products' packed copies).
        return {**self.__dict__, "layer": self.layer is not None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.layer = compiled_layer(self) if self.layer and kernels.module() is not None else None


def compiled_layer(w):
    """The compiled batch-1 step (csrc/draft_step.cpp) on these weights' int8 copies."""
    products = (w.features_in, w.qkv, w.self_out, w.source_query, w.source_out, w.ffn1, w.ffn2, w.fc_out)
    none = w.table.new_zeros(0)
    return kernels.module().DraftLayer(w.table, [p.packed for p in products], [p.scales32 for p in products],
                                       [none if p[1] is None else p[1] for p in products], w.heads, list(w.eps))


class DraftState:
    """What the draft keeps across a batch's blocks, one row per sentence.

    cache: b x L x 3C, each entry's self-attention query, keys and values side by side, as
    its product makes them (zeros where never written; columns past `length` are a
    proposal's and are overwritten); length: b, entries of the accepted prefix, at most
    `longest` (host int; at batch 1 the row's own); source: the encoder output's keys and
    values b x H x S x d and its additive mask b x 1 x 1 x S (None where no row has
    padding); pending: Waiting, or None; deferred: the last accepted positions of blocks
    that proposed nothing (a width of 1, whose first step is not made), oldest first, each
    (features b x C, token b) as propose() was given them, waiting after pending's (settle
    makes them one Waiting); proposed: whether the block being verified is this state's
    proposal (its first step made: the next proposal's waits for keep); skipped: whether it
    followed a proposal of nothing instead (deferred); root: that first step's drafted
    features b x C, which a tree's nodes read after propose() made them; encoder: the
    encoder tensor these belong to; weights: DraftWeights.
    """

    def __init__(self, cache, source_keys, source_values, source_mask, encoder, weights):
        self.cache, self.weights, self.encoder = cache, weights, encoder
        self.length = torch.zeros(cache.size(0), dtype=torch.long, device=cache.device)
        self.longest, self.pending, self.proposed, self.root = 0, None, False, None
        self.deferred, self.skipped = [], False
        self.source_keys, self.source_values, self.source_mask = source_keys, source_values, source_mask
        self.rows = torch.arange(cache.size(0), device=cache.device)
        self.column_rows = self.rows[:, None]  # b x 1: each row's index beside its columns
        self.positions = torch.arange(cache.size(1), device=cache.device)
        self.last_window = None

    @property
    def kv(self):
        """The cache's keys and values, b x 2 x H x L x d (a view)."""
        b, columns, width = self.cache.shape
        return self.cache[..., width // 3:].view(b, columns, 2, self.weights.heads, -1).permute(0, 2, 3, 1, 4)

    def defer(self, features, token):
        """The last accepted position (features b x C, token b) waits, unfed: its block
        proposes nothing. Held, not copied: no operation."""
        self.deferred.append((features, token))
        self.skipped = True

    def settle(self):
        """pending and the deferred positions after it as one Waiting (None where nothing
        waits), deferred emptied: each row's deferred entries follow its own real ones
        (index_put past each row's count, as the first step places the last). What a batch's
        rows are selected on, and what a first step at batch > 1 feeds."""
        deferred, self.deferred = self.deferred, []
        if not deferred:
            return self.pending
        features = torch.stack([f for f, _ in deferred], dim=1)  # b x D x C
        tokens = torch.stack([t for _, t in deferred], dim=1)  # b x D
        added, pending = len(deferred), self.pending
        if pending is None:
            self.pending = Waiting(features, tokens, self.length.new_full(self.length.shape, added),
                                   self.longest + added + 1)
            return self.pending
        merged = torch.cat([pending.features, features], dim=1)  # b x M+D x C
        following = torch.cat([pending.tokens, tokens], dim=1)  # b x M+D
        if merged.size(0) > 1:  # a row with fewer real than M: its deferred ones after its own
            self.reserve(merged.size(1))
            columns = pending.count[:, None] + self.positions[:added]  # b x D
            merged[self.column_rows, columns] = features
            following[self.column_rows, columns] = tokens
        self.pending = Waiting(merged, following, pending.count + added, pending.longest + added)
        return self.pending

    def alone_entries(self, features=None, token=None):
        """At batch 1, where every waiting position is real: the waiting ones, then
        (features 1 x C, token 1) if given, as m x C and m (one cat each); nothing waits
        after."""
        pending, deferred = self.pending, self.deferred
        self.pending, self.deferred = None, []
        real = pending is not None and pending.features.size(1) > 0
        inputs = ([pending.features[0]] if real else []) + [f for f, _ in deferred]
        tokens = ([pending.tokens[0]] if real else []) + [t for _, t in deferred]
        if features is not None:
            if not inputs:
                return features, token
            inputs, tokens = inputs + [features], tokens + [token]
        return torch.cat(inputs), torch.cat(tokens)

    def select(self, rows):
        self.settle()
        for name in ("cache", "length", "source_keys", "source_values"):
            setattr(self, name, getattr(self, name)[rows])
        if self.source_mask is not None:
            self.source_mask = self.source_mask[rows]
        if self.pending is not None:
            self.pending = self.pending._replace(features=self.pending.features[rows],
                                                 tokens=self.pending.tokens[rows], count=self.pending.count[rows])
        if len(rows) == 1:  # batch 1 steps on the row's own lengths: made exact on the host here
            self.alone()
        self.rows = self.rows[: len(rows)]
        self.column_rows, self.last_window = self.rows[:, None], None
        self.encoder = None  # the generator reorders the encoder output too: adopt the next one

    def alone(self):
        """The one row left of a batch: `longest` its own prefix, and its waiting positions
        only the real ones (longest after them its own), as keep() leaves them at batch 1.
        One device round trip, where sentences leave the batch."""
        if self.pending is None:
            self.longest = int(self.length[0])
            return
        self.longest, count = torch.stack([self.length[0], self.pending.count[0]]).tolist()
        self.pending = Waiting(self.pending.features[:, :count], self.pending.tokens[:, :count],
                               self.pending.count, self.longest + count + 1)

    def reserve(self, columns):
        """Room for `columns` entries in every row (doubling, so that growth is rare)."""
        if columns > self.cache.size(1):
            grown = self.cache.new_zeros(self.cache.size(0), max(columns, 2 * self.cache.size(1)), self.cache.size(2))
            grown[:, : self.cache.size(1)] = self.cache
            self.cache, self.last_window = grown, None
            self.positions = torch.arange(grown.size(1), device=grown.device)

    def window(self, used):
        """The cache's first `used` columns as keys and values, b x H x used x d: strided
        views, made again when `used` changes (a proposal's steps share one window, except
        at batch 1, where each sees one column more)."""
        if self.last_window is None or self.last_window[0] != used:
            b, columns, width = self.cache.shape
            heads, channels = self.weights.heads, width // 3
            shape, strides = (b, heads, used, channels // heads), (columns * width, channels // heads, width, 1)
            offset = self.cache.storage_offset()
            self.last_window = (used, self.cache.as_strided(shape, strides, offset + channels),
                                self.cache.as_strided(shape, strides, offset + 2 * channels))
        return self.last_window[1:]

    def slot(self, start, m):
        """Columns start..start+m of the one row's cache (batch 1), m x 3C: where the step's
        product writes its queries, keys and values."""
        width = self.cache.size(2)
        return self.cache.as_strided((m, width), (width, 1), self.cache.storage_offset() + start * width)

    def mask(self, columns, used):
        """The additive self-attention mask of entries at `columns` (b x m): each sees the
        columns up to its own, b x 1 x m x used."""
        later = self.positions[:used] > columns[..., None]  # b x m x used
        return self.cache.new_zeros(later.shape).masked_fill_(later, -math.inf)[:, None]

    def tree_mask(self, plan, used):
        """The additive self-attention mask of a tree's entries (TreePlan: entry o in column
        length + o of its row): each sees its row's accepted prefix and its own ancestors'
        entries and itself, never a sibling's or a cousin's, b x 1 x O x used."""
        past = (self.positions[:used] - self.length[:, None] + 1).clamp_(0, plan.table.size(1) - 1)  # b x used
        hidden = ~plan.table[:, past].transpose(0, 1)  # b x O x used
        return self.cache.new_zeros(hidden.shape).masked_fill_(hidden, -math.inf)[:, None]


class TreePlan:
    """Where a tree's drafted entries go (DraftDecoder.nodes): the nodes with children below
    the root, O of them in tree.hydra's order (depth by depth), entry o in column length + o.
    starts: per depth of tree.hydra, the offset of its parents' first entry (the root's
    depth: none, its step is the accepted prefix's last entry); table: O x O+2 bools, which
    columns entry o sees by the column's offset past the prefix plus one: 0 (the prefix) and
    its own and its ancestors' entries, never O+1 (every column past the tree)."""

    def __init__(self, tree):
        parents = [depth[0] for depth in tree.hydra[1:]]
        self.starts, start = [None], 0
        for nodes in parents:
            self.starts.append(start)
            start += len(nodes)
        self.entries = start
        order = torch.cat(parents) if parents else tree.ancestors.new_zeros(0, dtype=torch.long)
        seen = tree.ancestors[order][:, order]  # O x O: its own and its ancestors' entries
        self.table = torch.cat([seen.new_ones(start, 1), seen, seen.new_zeros(start, 1)], dim=1)


_plans = weakref.WeakKeyDictionary()  # per tree, made once: a generator keeps its trees


def tree_plan(tree):
    """TreePlan(tree), made again only where the tree moved to another device."""
    plan = _plans.get(tree)
    if plan is None or plan.table.device != tree.ancestors.device:
        plan = _plans[tree] = TreePlan(tree)
    return plan


def enter(state, features, tokens, columns, start=None):
    """Entries' inputs z = W_in [f; E x] (DraftDecoder.entry) and their self-attention
    queries, keys and values, written in the cache: features b*m x C, tokens b*m, at
    `columns` (b x m) of their rows, or at batch 1 at columns start.. (a host int), where
    the product writes them itself (DraftState.slot). Returns z b*m x C and qkv b*m x 3C."""
    w = state.weights
    if w.square_reduced:
        z = w.features_in(features, add=w.table.index_select(0, tokens))  # b*m x C
    else:
        z = torch.addmm(w.table.index_select(0, tokens), features, w.features_in)  # b*m x C
    normed = torch.layer_norm(z, (features.size(1),), None, None, w.eps[0])
    if start is not None:
        return z, w.qkv(normed, out=state.slot(start, features.size(0)))  # in the cache
    qkv = product(normed, w.qkv)  # b*m x 3C
    state.cache[state.column_rows, columns] = qkv.view(*columns.shape, -1)
    return z, qkv


def feed_waiting(state):
    """The waiting positions' entries (pending's and the deferred ones) written in the cache,
    their keys and values being all the draft keeps of them, and no step made: where so many
    wait that the next first step should not carry them all (DraftDecoder.waiting_most)."""
    if state.cache.size(0) == 1:
        inputs, tokens = state.alone_entries()
        state.reserve(state.longest + inputs.size(0))
        enter(state, inputs, tokens, None, state.longest)
        state.length, state.longest = state.length + inputs.size(0), state.longest + inputs.size(0)
        return
    pending, state.pending = state.settle(), None
    m = pending.features.size(1)
    # A row with fewer than m writes its spare entries past its prefix (overwritten later).
    state.reserve(state.longest + m)
    columns = state.length[:, None] + state.positions[:m]  # b x m
    enter(state, pending.features.reshape(-1, pending.features.size(-1)), pending.tokens.reshape(-1), columns)
    state.length, state.longest = state.length + pending.count, pending.longest - 1


def decode_step(state, features, tokens, columns, mask, start=None, last=None):
    """The draft layer's function (DraftDecoder.entry and .layer) in decoding, on
    DraftWeights: b sentences' m entries each, row by row (features b*m x C, tokens b*m),
    written at `columns` (b x m) of their rows' cache, under `mask` (b x 1 x m x L,
    DraftState.mask) -> drafted features b*m x C.

    At batch 1 `start` (a host int) places the m entries at columns start.. instead
    (columns None), where the product writes them itself (DraftState.slot), under `mask`
    (m x L, a tree's) or none: then they see the columns up to the last of them, which is
    all that one entry sees. last: only one entry's features of each row are made, b x C
    (the others are accepted positions, of which the draft keeps only their keys and
    values): each row's entry last (b), under `mask` b x 1 x 1 x L for them; at batch 1
    (True, no mask) the last entry.

    At batch 1 without a mask, one entry or only the last one's features made, the compiled
    step (DraftWeights.layer) does all of this in one call where it is built.
    """
    w, channels, eps = state.weights, features.size(1), state.weights.eps
    if start is not None and mask is None and w.layer is not None and (last or features.size(0) == 1) \
            and features.dtype == torch.float32 and not features.requires_grad and kernels.module() is not None:
        return w.layer.step(features, tokens, state.cache, start, state.source_keys, state.source_values,
                            state.source_mask)
    z, qkv = enter(state, features, tokens, columns, start)
    if start is None:
        (b, m), used = columns.shape, mask.size(-1)
        if last is not None:
            made = state.rows * m + last  # b: each row's entry
            z, features, qkv, m = z.index_select(0, made), features.index_select(0, made), qkv.index_select(0, made), 1
    else:
        b, m = 1, features.size(0)
        used = start + m if mask is None else mask.size(-1)
        if last and m > 1:
            z, features, qkv, m = z[-1:], features[-1:], qkv[-1:], 1
    kern = kernels.serve(z)
    y = attention(kern, qkv, *state.window(used), mask, b, m, w.heads, channels)
    z, normed = residual(kern, z, product(y, w.self_out), eps[1])
    y = attention(kern, product(normed, w.source_query), state.source_keys, state.source_values, state.source_mask,
                  b, m, w.heads, channels)
    z, normed = residual(kern, z, product(y, w.source_out), eps[2])
    if w.reduced and w.activation_fn is torch.relu_:
        hidden = w.ffn1(normed, relu=True)  # relu inside the product where the compiled kernel serves
    else:
        hidden = w.activation_fn(product(normed, w.ffn1))
    if w.reduced:  # an Int8Product's (bf16 where torch's kernel serves and the bias unit adds the bias)
        z, normed = residual(kern, z, w.ffn2(hidden), eps[3])
    elif w.ffn2[1] is None:  # the bias unit: the product adds the bias and the residual
        z = torch.addmm(z, hidden, w.ffn2[0])
        normed = torch.layer_norm(z, (channels,), None, None, eps[3])
    else:
        z, normed = residual(kern, z, product(hidden, w.ffn2), eps[3])
    if w.square_reduced:
        return w.fc_out(normed, add=features)
    return features + product(normed, w.fc_out)


def residual(kern, z, y, eps):
    """The draft layer's stream after a sublayer whose output is y (b*m x C, fresh: the
    kernel writes into it), z + y, and its layer norm (no weights: the next sublayer's input)."""
    if kern is not None and y.dtype == z.dtype:
        return kern.residual_norm(z, y, None, None, eps, True)
    z = z + y
    return z, torch.layer_norm(z, (z.size(1),), None, None, eps)


def attention(kern, q, keys, values, mask, b, m, heads, channels):
    """Queries: the first C columns of q (b*m x C or wider, as the q, k, v product makes
    them), over keys, values b x H x L x d under the additive mask (b x 1 x m x L, b x 1 x 1 x
    L, m x L, or None) -> b*m x C: the compiled kernel's (kernels.serve) where it serves."""
    q = split_heads(q, b, m, heads, 0, channels)
    if kern is not None and q.dtype == keys.dtype:
        return kern.attend(q, keys, values, mask, None).reshape(b * m, channels)
    return merge_heads(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask), b, m)
