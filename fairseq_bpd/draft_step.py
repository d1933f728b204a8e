"""The draft decoder's decoding step (draft.py): its cache, its weights arranged once, one step.

Decoding runs the draft's layer k-1 times an invocation on a few rows, so its cost is the
products' weights and per-operation overhead, not arithmetic: the step computes the same
function as the layer that training runs (DraftDecoder.entry, .layer), on weights arranged
once per change (one product for q, k and v; W_in's token half a table of every token's
term), writes its keys and values in place, and asks the device nothing (the host knows
every length it needs). It rounds differently from training's pass, which is why the
tests compare them in float64.
"""
import math
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .static_pass import norm, product, transposed


class Waiting(NamedTuple):
    """Accepted positions not yet fed to the draft: features b x M x C, their next tokens
    b x M, how many of the M are real in each row (b), and the longest accepted prefix once
    they and the last position are fed (a host int, so that no draft step asks the device)."""

    features: torch.Tensor
    tokens: torch.Tensor
    count: torch.Tensor
    longest: int


class DraftWeights:
    """The draft's decoding weights, arranged once per change: products as x · Wᵀ on
    contiguous copies (static_pass.transposed), the self-attention's q, k and v in one, and
    W_in's token half folded into a table: entry z = f · W_fᵀ + table[x], with
    table = (s E) W_tᵀ + b_in for every token (one row lookup instead of a product and a cat)."""

    def __init__(self, draft):
        decoder, width = draft.decoder, draft.fc_in.weight.size(0)
        w_in = draft.fc_in.weight.detach()  # C x (C + E): the features' columns, then the token's
        embedded = decoder.embed_scale * decoder.embed_tokens.weight.detach()  # V x E
        self.table = torch.addmm(draft.fc_in.bias.detach(), embedded, w_in[:, width:].t())  # V x C
        self.features_in = w_in[:, :width].t().contiguous()  # C x C
        attention, source = draft.self_attn, draft.encoder_attn
        self.qkv = transposed(attention.q_proj, attention.k_proj, attention.v_proj)  # C x 3C
        self.self_out, self.source_query = transposed(attention.out_proj), transposed(source.q_proj)
        self.source_out, self.fc_out = transposed(source.out_proj), transposed(draft.fc_out)
        self.ffn1, self.ffn2 = transposed(draft.ffn1), transposed(draft.ffn2)
        self.heads, self.activation_fn = attention.num_heads, draft.activation_fn
        self.norms = (draft.self_attn_norm, draft.encoder_attn_norm, draft.ffn_norm, draft.final_norm)


class DraftState:
    """What the draft keeps across a batch's blocks, one row per sentence.

    kv: b x 2 x H x L x d, its self-attention keys and values (zeros where never written;
    columns past `length` are a proposal's and are overwritten); length: b, entries of the
    accepted prefix, at most `longest` (host int); source: the encoder output's keys and
    values b x H x S x d and its additive mask b x 1 x 1 x S; pending: Waiting, or None;
    proposed: whether the block being verified is this state's proposal (its first step
    made: the next proposal's waits for keep); root: that first step's drafted features
    b x C, which a tree's nodes read after propose() made them; encoder: the encoder tensor
    these belong to; weights: DraftWeights.
    """

    def __init__(self, kv, source_keys, source_values, source_mask, encoder, weights):
        self.kv, self.weights, self.encoder = kv, weights, encoder
        self.length = torch.zeros(kv.size(0), dtype=torch.long, device=kv.device)
        self.longest, self.pending, self.proposed, self.root = 0, None, False, None
        self.source_keys, self.source_values, self.source_mask = source_keys, source_values, source_mask
        self.rows = torch.arange(kv.size(0), device=kv.device)
        self.column_rows = self.rows[:, None]  # b x 1: each row's index beside its columns
        self.positions = torch.arange(kv.size(3), device=kv.device)
        self.last_window = None

    def select(self, rows):
        for name in ("kv", "length", "source_keys", "source_values", "source_mask"):
            setattr(self, name, getattr(self, name)[rows])
        if self.pending is not None:
            self.pending = self.pending._replace(features=self.pending.features[rows],
                                                 tokens=self.pending.tokens[rows], count=self.pending.count[rows])
        self.rows = self.rows[: len(rows)]
        self.column_rows, self.last_window = self.rows[:, None], None
        self.encoder = None  # the generator reorders the encoder output too: adopt the next one

    def reserve(self, columns):
        """Room for `columns` entries in every row (doubling, so that growth is rare)."""
        if columns > self.kv.size(3):
            grown = self.kv.new_zeros(*self.kv.shape[:3], max(columns, 2 * self.kv.size(3)), self.kv.size(4))
            grown[:, :, :, : self.kv.size(3)] = self.kv
            self.kv, self.last_window = grown, None
            self.positions = torch.arange(grown.size(3), device=grown.device)

    def window(self, used):
        """The cache's first `used` columns as keys and values, b x H x used x d: views,
        made once while the cache stays (a proposal's steps all see the same window)."""
        if self.last_window is None or self.last_window[0] != used:
            self.last_window = (used, self.kv[:, 0, :, :used], self.kv[:, 1, :, :used])
        return self.last_window[1:]

    def mask(self, columns, used):
        """The additive self-attention mask of entries at `columns` (b x m): each sees the
        columns up to its own, b x 1 x m x used."""
        later = self.positions[:used] > columns[..., None]  # b x m x used
        return self.kv.new_zeros(later.shape).masked_fill_(later, -math.inf)[:, None]

    def tree_mask(self, plan, used):
        """The additive self-attention mask of a tree's entries (TreePlan: entry o in column
        length + o of its row): each sees its row's accepted prefix and its own ancestors'
        entries and itself, never a sibling's or a cousin's, b x 1 x O x used."""
        past = (self.positions[:used] - self.length[:, None] + 1).clamp_(0, plan.table.size(1) - 1)  # b x used
        hidden = ~plan.table[:, past].transpose(0, 1)  # b x O x used
        return self.kv.new_zeros(hidden.shape).masked_fill_(hidden, -math.inf)[:, None]


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


def decode_step(state, features, tokens, columns, mask):
    """The draft layer's function (DraftDecoder.entry and .layer) in decoding, on
    DraftWeights: b sentences' m entries each, row by row (features b*m x C, tokens b*m),
    written at `columns` (b x m) of their rows' cache, under `mask` (b x 1 x m x L,
    DraftState.mask) -> drafted features b*m x C."""
    w, (b, m), channels = state.weights, columns.shape, features.size(1)
    z = torch.addmm(w.table.index_select(0, tokens), features, w.features_in)  # b*m x C
    qkv = product(norm(w.norms[0], z), w.qkv)  # b*m x 3C
    state.kv[state.column_rows, :, :, columns] = qkv[:, channels:].view(b, m, 2, w.heads, -1)
    y = attention(qkv[:, :channels], *state.window(mask.size(-1)), mask, b, m, w.heads)
    z = z + product(y, w.self_out)
    q = product(norm(w.norms[1], z), w.source_query)
    z = z + product(attention(q, state.source_keys, state.source_values, state.source_mask, b, m, w.heads),
                    w.source_out)
    z = z + product(w.activation_fn(product(norm(w.norms[2], z), w.ffn1)), w.ffn2)
    return features + product(norm(w.norms[3], z), w.fc_out)


def attention(q, keys, values, mask, b, m, heads):
    """Queries b*m x C over keys, values b x H x L x d under the additive mask
    (b x 1 x m x L or b x 1 x 1 x L) -> b*m x C."""
    if m == 1:  # b x 1 x H x d and b x H x 1 x d are the same memory: no transposes
        y = F.scaled_dot_product_attention(q.view(b, heads, 1, -1), keys, values, attn_mask=mask)
        return y.reshape(b, -1)
    q = q.view(b, m, heads, -1).transpose(1, 2)  # b x H x m x d
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return y.transpose(1, 2).reshape(b * m, -1)
