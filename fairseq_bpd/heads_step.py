"""The proposal heads' decoding step (heads.py): their weights arranged once per change.

Decoding runs the heads on one position's few rows each invocation, so their cost is the
weights' reads and per-operation overhead, not arithmetic: HeadWeights and ChainWeights
compute the same functions as the heads' modules (ProposalHeads.block_features, ChainedHeads.link,
each followed by decoding_logits) on weights transposed, split and folded into tables once
per change, in a few products a head. Training, hooks and weights that keep no version run the
modules instead (Arranged.decoding_weights). They round differently from the modules, which
is why the tests compare them in float64.

At batch 8 and up (and a tree's depth at any batch) each product runs a block of rows, so
the products are product.Products, on oneDNN's packed copy or MKL's addmm, whichever was
timed faster there. A product that adds a matrix (a residual, a table's rows) or a link's own
bias is a Plus: the packed product and one add where that pays, addmm otherwise.
"""
import math

import torch
import torch.nn.functional as F

from .product import ONE_ROW_PACKED_SIZE, Product, packing_applies
from .static_pass import transposed


class Plus:
    """x -> x · W + addend, the addend a matrix (a residual, a table's rows) or a vector other
    than a bias of W's own (a link's, on the projection all links share): where the packed
    copy pays, product.Product's packed product of no bias and an add, else one addmm (bit for
    bit the arranged weights' product before Products: float64, autograd, batch 1)."""

    def __init__(self, weight):
        """weight W C x N, contiguous."""
        self.weight, self.product = weight, Product(weight, weight.new_zeros(weight.size(1)))
        # The add is one more operation, which a small weight's packed product pays for only
        # over many rows (a link's 256 x 129: slower packed at 8 rows, even at 32, faster at
        # 64): packed from the rows where rows x W's entries reach ONE_ROW_PACKED_SIZE.
        self.rows = math.ceil(ONE_ROW_PACKED_SIZE / weight.numel()) if packing_applies(weight) else math.inf

    def __call__(self, x, addend):
        """x M x C, addend M x N or N -> M x N."""
        if x.size(0) >= self.rows and self.product.packs(x):  # packs: float32, no autograd
            return self.product.on_packed(x).add_(addend)
        return torch.addmm(addend, x, self.weight)


class Arranged:
    """What decoding runs a proposer's heads on: weights arranged once per change (arrange(),
    given decoder.proposal_projection()), or None where they run as their modules do: in
    training, under hooks, on a projection that is not a plain product, or on weights that
    keep no version (inference_mode's: they would be arranged on every call)."""

    def reads(self):
        """The decoder's modules the heads read beyond their own (the embedding's table)."""
        return ()

    def arrange(self, columns, padding):
        raise NotImplementedError

    def decoding_weights(self, vocab, encoder_out=None):
        """arrange()'s weights for proposals over the first `vocab` entries, arranged again
        when any weight they come from changes (weights_key), or None (above).

        Checked once per encoder output (a batch's, until sentences leave it): the check
        reads every parameter, which costs as much as a link of a chain."""
        from .decoder import weights_key  # the decoder imports the heads: no cycle at import

        encoder = encoder_out["encoder_out"][0] if encoder_out and encoder_out.get("encoder_out") else None
        if encoder is not None and getattr(self, "_checked", None) is encoder and self._weights_key[1] == vocab:
            return self._weights
        decoder, self._checked = self.decoder, None
        # a hook put on the projection after a decode: proposals scored as by a model hooked before any
        if (self.training or not decoder.plain_projection()
                or any(m._forward_hooks or m._forward_pre_hooks for m in (*self.modules(), *self.reads()))):
            return None
        key = weights_key(*self.parameters(), *(m.weight for m in self.reads()), decoder.output_projection.weight)
        if key is None:
            return None
        if getattr(self, "_weights_key", None) != (key, vocab):
            self._weights = self.arrange(*decoder.proposal_projection(vocab))  # plain: checked above
            self._weights_key = (key, vocab)
        self._checked = encoder
        return self._weights

    def forget_arranged(self):
        self._weights = self._weights_key = self._checked = None  # arranged for decoding only

    def train(self, mode=True):
        self.forget_arranged()
        return super().train(mode)


class HeadWeights:
    """ProposalHeads' layer and projection in decoding, on weights arranged once per change
    (Products on contiguous transposes, fc2's slices views of one): the same function as
    block_features() followed by decoding_logits(), the proposals' slices of fc2 in one product."""

    def __init__(self, heads, columns, padding):
        """heads: ProposalHeads; columns C x N, padding N: decoder.proposal_projection()."""
        self.fc1, self.fc2 = (transposed(heads.fc1), transposed(heads.fc2)) if heads.num_heads else (None, None)
        self.first = 1 if heads.layout == "paper" else 0  # the layer's slice of head 2
        self.projection, self.slices = Product(columns, padding), {}
        self.activation = torch.relu_ if heads.activation_fn is F.relu else heads.activation_fn

    def fc2_slice(self, proposals):
        """fc2's columns for heads 2..proposals+1, a Product on a view of them made at the first
        block this wide: a packed copy per width in use (the whole fc2's for each would be
        k-1 copies of it, and a view is the slice addmm read before)."""
        if proposals not in self.slices:
            (weight, bias), channels = self.fc2, self.projection[0].size(0)
            rows = slice(self.first * channels, (self.first + proposals) * channels)
            self.slices[proposals] = Product(weight[:, rows], bias[rows])
        return self.slices[proposals]

    def logits(self, features, width):
        """Heads 2..width after features b x C: logits b x width-1 x N."""
        (b, channels), proposals = features.shape, width - 1
        hidden = self.activation(self.fc1(features))  # b x nh*F
        heads = self.fc2_slice(proposals)(hidden).view(b, proposals, channels)
        heads = (heads + features[:, None]).view(b * proposals, channels)  # residual slices
        return self.projection(heads).view(b, proposals, -1)


class ChainWeights:
    """ChainedHeads' links in decoding, on weights arranged once per change: the same
    function as link() followed by decoding_logits(), in a lookup and three products a link.

    Link i's first layer W1_i [f; s E y] + b1_i is split into its features' part and its
    token's, the latter a table over the tokens the link can read (head 2 reads head 1's
    choice: the dictionary; later heads a proposal: the shortlist's N). The fc_out biases
    are carried, not added: the chain runs on g_i = f_i - c_i, c_i the sum of the biases
    of links before i, which the next link's table (W1_i's features part times c_i) and
    each head's projection bias (c_i P, beside padding's -inf) add back. Where the links'
    hidden width H is below the features' C and the activation is relu, a later head's
    logits are the head before's plus its hidden layer times W2_i P (H x N, read instead of
    P's C x N) plus b2_i P, the latter as one more hidden unit, always 1 (relu(1) = 1).
    Every product adds something other than a bias of its own (the table's rows, g, the
    head before's logits, the link's projection bias on P, which all links share): Plus.
    """

    def __init__(self, heads, columns, padding):
        """heads: ChainedHeads; columns C x N, padding N: decoder.proposal_projection()."""
        decoder = heads.decoder
        channels, hidden = decoder.output_embed_dim, heads.fc_in[0].out_features
        through = hidden < channels and heads.activation_fn is F.relu
        embedded = decoder.embed_scale * decoder.embed_tokens.weight.detach()  # V x E
        carried = columns.new_zeros(channels)  # c_i
        self.projection, self.links = Plus(columns), []
        for i, (fc_in, fc_out) in enumerate(zip(heads.fc_in, heads.fc_out)):
            w_in, w_out = fc_in.weight.detach(), fc_out.weight.detach()  # H x (C + E), C x H
            readable = embedded if i == 0 else embedded[: columns.size(1)]  # R x E
            table = torch.addmm(torch.addmv(fc_in.bias.detach(), w_in[:, :channels], carried),
                                readable, w_in[:, channels:].t())  # R x H
            features_in, out, ahead = w_in[:, :channels].t(), w_out.t(), None  # C x H, H x C
            if through:  # the unit: 1 in every row of the table, read by no features, adding b2_i P
                table, features_in = F.pad(table, (0, 1), value=1.0), F.pad(features_in, (0, 1))
                ahead = Plus(torch.cat([out @ columns, (fc_out.bias.detach() @ columns)[None]])) if i else None
                out = F.pad(out, (0, 0, 0, 1))  # (H+1) x C: the unit adds nothing to g
            carried = carried + fc_out.bias.detach()
            self.links.append((Plus(features_in.contiguous()), table, Plus(out.contiguous()),
                               torch.addmv(padding, columns.t(), carried), ahead))
        self.activation = torch.relu_ if heads.activation_fn is F.relu else heads.activation_fn

    def link(self, i, g, tokens, logits, last):
        """Link i: g_i b x C, the tokens it reads (b) and head i+1's logits b x N (None at
        head 1) -> g_(i+1) (None after the `last` link, where no one reads it) and head
        i+2's logits b x N."""
        features_in, table, out, bias, ahead = self.links[i]
        hidden = self.activation(features_in(g, table.index_select(0, tokens)))  # b x H (+1)
        if ahead is None:
            g = out(hidden, g)
            return g, self.projection(g, bias)
        return None if last else out(hidden, g), ahead(hidden, logits)

    def link_parents(self, i, g, logits, sources, tokens, last):
        """Link i over a tree depth's parents (ChainedHeads.nodes), whose tokens b x P were
        chosen from the rows `sources` (P) of the depth above's g b x P' x C and logits
        b x P' x N (None at the root) -> the children's g (None after the `last` depth) and
        logits, b x P x C and b x P x N: link() over the b*P rows."""
        b, count = tokens.shape

        def rows(x):  # b x P' x ... -> b*P x ...: each parent's row
            return None if x is None else x[:, sources].reshape(b * count, x.size(-1))

        g, logits = self.link(i, rows(g), tokens.reshape(-1), rows(logits), last)
        return None if g is None else g.view(b, count, -1), logits.view(b, count, -1)
