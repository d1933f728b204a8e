"""The decoder's key/value cache: fairseq's incremental-state format, read and written here only.

fairseq's MultiheadAttention keeps, per attention module, under that module's key of the
incremental_state dict: prev_key and prev_value, b x h x T x d, and
prev_key_padding_mask, b x T (True or 1 where an entry is hidden) or None. A decoder
layer has two such caches: its self-attention's, which grows with the output, and its
encoder attention's, the source's keys and values computed on the first call (static_kv).
IncrementalCache is the block pass's view of that dict: block_layer appends a block to it
and reads the source's keys from it, forward_block asks its width, and the generator's
crop (through the decoder) keeps the accepted entries. fairseq's own step and
reorder_incremental_state read and write the same dict, so they keep working on it.

StaticCache, its sibling with the same methods, is the lean path's: keys and values
preallocated for the batch and written in place, which fairseq's own layers do not read;
the decoder picks it where block_layer understands every layer (decoder.cache).
"""
import math

import torch

# crop compacts the self-attention cache once masked holes make it this much wider than
# its longest prefix (0.5: 50% wider). Holes cost attention and fairseq's per-step copy
# of the cache; compacting costs one such copy.
COMPACT_AT = 0.5


class IncrementalCache:
    """fairseq's incremental_state for `layers` (a decoder's), seen as the cache of a block pass.

    It keeps nothing of its own: every method reads or writes the dict, so making one per
    decoder invocation costs nothing and fairseq's code sees every change.
    """

    def __init__(self, layers, incremental_state):
        self.layers, self.state = layers, incremental_state

    def width(self):
        """Columns of the self-attention cache (its longest prefix plus padding): an int."""
        buffer = self.layers[0].self_attn._get_input_buffer(self.state)
        return buffer["prev_key"].size(2) if "prev_key" in buffer else 0

    def uniform_length(self):
        """Every sentence's cached entries where they are all alike (no column is a hole): the
        width, an int; else None."""
        buffer = self.layers[0].self_attn._get_input_buffer(self.state)
        return self.width() if buffer.get("prev_key_padding_mask") is None else None

    def append(self, attention, k, v, mask):
        """Append a block's keys and values (b x h x n x d) to `attention`'s self-attention cache.

        mask: n x W+n additive (W cached entries, then the block) or None. Returns the
        keys and values to attend to, b x h x W+n x d, and the mask with the cache's holes
        at -inf: b x 1 x n x W+n, or `mask` itself where there are none.
        """
        n = k.size(2)
        buffer = attention._get_input_buffer(self.state)
        holes = None
        if "prev_key" in buffer:
            k = torch.cat([buffer["prev_key"], k], dim=2)
            v = torch.cat([buffer["prev_value"], v], dim=2)
            holes = buffer.get("prev_key_padding_mask")
            if holes is not None:  # the block's own entries are no holes
                holes = torch.cat([holes.bool(), holes.new_zeros(holes.size(0), n, dtype=torch.bool)], dim=1)
        buffer["prev_key"], buffer["prev_value"], buffer["prev_key_padding_mask"] = k, v, holes
        attention._set_input_buffer(self.state, buffer)
        if holes is not None:  # b x 1 x n x W+n, -inf at holes
            base = mask if mask is not None else k.new_zeros(n, k.size(2))
            mask = base.masked_fill(holes[:, None, None, :], -math.inf)
        return k, v, mask

    def source(self, attention):
        """The source's keys and values cached for `attention` (b x h x S x d each), or None."""
        buffer = attention._get_input_buffer(self.state)
        if "prev_key" not in buffer:
            return None
        return buffer["prev_key"], buffer["prev_value"]

    def keep_source(self, attention, k, v, padding_mask):
        """Cache the source's keys and values for `attention`, as fairseq's own step does (static_kv)."""
        buffer = attention._get_input_buffer(self.state)
        buffer["prev_key"], buffer["prev_value"], buffer["prev_key_padding_mask"] = k, v, padding_mask
        attention._set_input_buffer(self.state, buffer)

    def crop(self, cached, block_width, keep, kept, counts=None):
        """Keep, after each sentence's cached prefix, only the chosen entries of the last block.

        Before the call each layer's self-attention cache holds, per sentence, `cached`
        (b) valid entries among its first W columns, the others hidden by the key padding
        mask (fairseq's attention reads it with the cache), then the `block_width` entries
        of the block just fed. keep: b x m, block positions in the order they stay (a
        chain's accepted prefix 0, 1, ...; a tree's accepted path); the first `kept` (b)
        of them stay (counts: the same on the host, a list, or None). Returns cached + kept.

        Attention ignores where a key sits (positions were added to the inputs), so a
        chain's rejected entries need no moving: they are cut off the end where every
        sentence rejected them and masked where only some did, which costs no copy.
        The cache is compacted (one gather) only for a tree's path, or once such holes
        widen it by more than COMPACT_AT of its longest prefix.
        """
        lengths = cached + kept
        if block_width == 1:
            return lengths  # a block of one is kept whole: nothing to cut
        old_width = self.width() - block_width
        holes = self.layers[0].self_attn._get_input_buffer(self.state).get(
            "prev_key_padding_mask")  # b x W + block_width, or None: no holes
        longest = int(kept.max()) if counts is None else max(counts)
        offsets = torch.arange(longest, device=kept.device)
        beyond = offsets >= kept[:, None]  # b x longest: block entries a sentence rejected
        if bool(((keep[:, :longest] == offsets) | beyond).all()):  # every sentence keeps a chain prefix
            width = old_width + longest
            if holes is None and not bool(beyond.any()):  # all keep the same: cut the tail
                self.rewrite(width)
                return lengths
            if width <= (1 + COMPACT_AT) * int(lengths.max()):
                prefix = beyond.new_zeros(kept.size(0), old_width) if holes is None else holes[:, :old_width].bool()
                self.rewrite(width, padding=torch.cat([prefix, beyond], dim=1))
                return lengths
        self.compact(cached, old_width, holes, keep, lengths)
        return lengths

    def compact(self, cached, old_width, holes, keep, lengths):
        """Gather each sentence's valid prefix entries, then its kept block entries, to the front."""
        width = int(lengths.max())
        columns = torch.arange(width, device=cached.device).unsqueeze(0)  # 1 x W'
        if holes is None:
            prefix = columns.expand(cached.size(0), -1)
        else:  # the valid columns first, in their order (a stable sort of the hole flags)
            prefix = holes[:, :old_width].to(torch.uint8).sort(dim=1, stable=True).indices
            prefix = torch.cat([prefix, prefix.new_zeros(prefix.size(0), max(width - old_width, 0))], dim=1)
            prefix = prefix[:, :width]
        from_block = (columns - cached[:, None]).clamp(0, keep.size(1) - 1)  # b x W'
        index = torch.where(columns < cached[:, None], prefix, old_width + keep.gather(1, from_block))
        padding = columns >= lengths[:, None]  # b x W'
        # No mask where no sentence is shorter (batch 1 always): attention then skips it.
        self.rewrite(width, index, padding=padding if bool(padding.any()) else None)

    def rewrite(self, width, index=None, padding=None):
        """Every layer's self-attention cache becomes its first `width` columns, or, given
        index (b x width), those columns per sentence; `padding` (b x width or None) hides columns."""
        for layer in self.layers:
            buffer = layer.self_attn._get_input_buffer(self.state)
            for key in ("prev_key", "prev_value"):
                cache = buffer[key]  # b x heads x W+n x d
                if index is None:
                    buffer[key] = cache[:, :, :width]
                else:
                    expanded = index[:, None, :, None].expand(-1, cache.size(1), -1, cache.size(3))
                    buffer[key] = cache.gather(2, expanded)
            buffer["prev_key_padding_mask"] = padding
            layer.self_attn._set_input_buffer(self.state, buffer)


# A finished sentence's row stays in the static cache, masked, until this fraction of the
# rows is finished; then the last live rows move into the finished rows' places (a copy of
# the moved rows' entries only). A finished row costs its share of every later pass. On a CPU, whose cost follows the rows, compacting at once
# (0) measured as fast as any fraction and faster than never; a fixed-shape replay (a
# CUDA graph per batch size) is what a positive fraction is for.
ROWS_COMPACT_AT = 0.0
# The columns a static cache starts with; it doubles when a block would not fit.
COLUMNS = 64


class StaticCache:
    """The decoder's keys and values preallocated for the batch, written in place (the lean path).

    kv: L x B x T x 3C, layer i's at i: per column the block's one product of queries, keys
    and values side by side (each the heads side by side in C), as static_pass makes it.
    Where a block's rows are one matrix of the buffer (equal lengths and one row or one
    token a row: batch 1 always, and every width-1 block), the product is made in place
    there (write); otherwise it is made apart and copied in with one index_copy. The
    queries' columns are no one's after their block. Attention reads the keys and values
    of the first max(lengths) + n columns as strided B x h x W x d views, with a mask only
    where lengths differ or the block has more than one token (at equal lengths a slice
    of one kept per block mask, not made per block). Cache row r holds its sentence's
    entries in its first lengths[r] columns. A rejected suffix needs no crop: the length
    stops before it and the next block overwrites it; a tree's accepted path is one gather
    of its entries.
    A finished sentence's row is masked, not copied out (rows: the cache rows of the
    decoder's rows, in any order), until ROWS_COMPACT_AT of them are; then the last live
    rows move into the finished ones' places (compact). The source's keys and values
    (encoder attention) are kept per layer, B x h x S x d, with the source mask additive.

    Same methods as IncrementalCache (width, crop, source, keep_source), plus begin
    (the block's rows and mask), write (a layer's block product) and reorder.
    """

    def __init__(self, layers, columns=None):
        self.layers, self.columns = layers, columns or COLUMNS
        self.kv = self.lengths = self.rows = self.source_mask = None
        self.sources = [None] * len(layers)
        self.longest, self.equal, self.tree, self.n = 0, True, False, 0
        self.chain_masks, self.block_masks = {}, {}
        self.slab = self.index = None  # where write puts a block's product (begin)
        self.position_rows = None  # the decoder's position table for this batch (decoder.positions_for)

    def width(self):
        """Columns before the next block: the longest row's length, an int."""
        return self.longest

    def uniform_length(self):
        """Every row's length where they are all equal (batch 1 always), an int; else None."""
        return self.longest if self.equal else None

    def begin(self, x, block_mask):
        """Before a block pass: x b x n x C over the decoder's rows -> x over the cache rows
        (B x n x C; finished rows' zeros), and the self-attention mask over the first
        max(lengths)+n columns: None (one token, equal lengths), n x W, or B x 1 x n x W.
        block_mask: n x n additive (the chain's or a tree's; None: the chain's)."""
        b, n, channels = x.shape
        if self.kv is None:  # zeros, not empty: -inf masking a NaN in fresh memory is NaN
            self.kv = x.new_zeros(len(self.layers), b, max(self.columns, n), 3 * channels)
            self.lengths = torch.zeros(b, dtype=torch.long, device=x.device)
        elif self.longest + n > self.kv.size(2):  # doubled: a copy now and then, never per block
            self.resize(max(2 * self.kv.size(2), self.longest + n))
        if self.rows is not None:
            x = x.new_zeros(self.kv.size(1), n, channels).index_copy_(0, self.rows, x)
        rows, columns = self.kv.shape[1:3]
        if block_mask is None:  # the chain's
            block_mask = self.causal(n, x)
        self.n, self.tree = n, n > 1 and not self.is_chain(block_mask)
        # The block's product goes straight into the buffer where its rows are one matrix
        # there (row stride: a column's, or a cache row's); else one index_copy of it.
        self.slab = None
        if self.equal and (rows == 1 or n == 1):
            self.slab = self.kv.stride(2) if rows == 1 else self.kv.stride(1)
        else:
            self.index = ((torch.arange(rows, device=x.device) * columns + self.lengths)[:, None]
                          + torch.arange(n, device=x.device)).view(-1)  # B*n: the block's flat columns
        if self.equal:
            if n == 1:
                return x, None
            return x, self.prefix_mask(block_mask).narrow(1, columns - self.longest, self.longest + n)
        width = self.longest + n
        where = (torch.arange(width, device=x.device) - self.lengths[:, None] + 1).clamp_(0, n + 1)  # B x W
        return x, self.row_table(block_mask, x)[:, where].transpose(0, 1).unsqueeze(1)

    def causal(self, n, x):
        """The chain's n x n mask (-inf above the diagonal), kept per width."""
        key = ("causal", n, x.dtype, x.device)
        if key not in self.block_masks:
            self.block_masks[key] = (None, torch.triu(x.new_full((n, n), -math.inf), 1))
        return self.block_masks[key][1]

    def prefix_mask(self, block_mask):
        """n x T+n: T zeros (the cache's columns, all seen), then block_mask; the mask over a
        prefix of L columns and the block is its slice from column T-L, so that a block
        makes no mask of its own. Kept per block mask (the mask itself is held, so its
        address is not another's) and made again when the buffer widens."""
        columns = self.kv.size(2)

        def make():
            mask = self.kv.new_zeros(block_mask.size(0), columns + block_mask.size(0))
            mask[:, columns:] = block_mask
            return mask

        return self.kept_for(("prefix", id(block_mask), columns), block_mask, make)

    def row_table(self, block_mask, x):
        """n x n+2 in x's dtype: per block token, what it sees of a row's column before its block
        (0), in it (block_mask) and after it (-inf), which begin gathers at each row's
        offsets. Kept per block mask (held, as in prefix_mask)."""
        n = block_mask.size(0)
        return self.kept_for(("table", id(block_mask), x.dtype, x.device), block_mask, lambda: torch.cat(
            [block_mask.new_zeros(n, 1), block_mask, block_mask.new_full((n, 1), -math.inf)], 1).to(x))

    def kept_for(self, key, block_mask, make):
        """make() kept under `key` (holding an id of block_mask) beside the mask itself, and made
        again where the key's entry was made for another mask (one freed, its address reused)."""
        kept = self.block_masks.get(key)
        if kept is None or kept[0] is not block_mask:
            kept = self.block_masks[key] = (block_mask, make())
        return kept[1]

    def is_chain(self, block_mask):
        """Whether block_mask (n x n) is the causal one: crop then has no path to gather."""
        key = (block_mask.data_ptr(), tuple(block_mask.shape), block_mask.stride())
        if key not in self.chain_masks:
            n = block_mask.size(0)
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=block_mask.device), 1)
            self.chain_masks[key] = bool(((block_mask == -math.inf) == causal).all())
        return self.chain_masks[key]

    def write(self, layer, y, weights, heads):
        """Layer `layer`'s block product, y (B*n x C) · weights (a product.Product of C x 3C and
        its 3C bias: the queries', keys' and values' side by side), made into the cache (begin
        says where).
        Returns the product (B*n x 3C, any row stride: its queries are the block's) and the
        keys and values to attend to, B x h x W x d each (W = max(lengths) + n): strided
        views of the buffer, made directly (slicing, viewing and transposing each is three
        operations a layer and invocation)."""
        buffer = self.kv
        rows, columns, width = buffer.shape[1:]
        layer_stride, row_stride, column_stride = buffer.stride()[:3]
        start = buffer.storage_offset() + layer * layer_stride
        if self.slab is not None:
            out = buffer.as_strided((rows * self.n, width), (self.slab, 1), start + self.longest * column_stride)
            if y.requires_grad:  # out= is refused under autograd (decoding runs without it)
                product = out.copy_(weights(y))
            else:
                product = weights(y, out=out)
        else:
            product = weights(y)
            buffer.as_strided((rows * columns, width), (column_stride, 1), start).index_copy_(0, self.index, product)
        channels = width // 3
        shape, strides = (rows, heads, self.longest + self.n, channels // heads), (row_stride, channels // heads,
                                                                                   column_stride, 1)
        return (product, buffer.as_strided(shape, strides, start + channels),
                buffer.as_strided(shape, strides, start + 2 * channels))

    def source(self, layer):
        """The source's keys and values for layer `layer` (B x h x S x d each), or None."""
        return self.sources[layer]

    def source_lists(self):
        """Every layer's source keys, and values, as two lists (B x h x S x d each), or None
        before the first pass has kept them all."""
        if any(source is None for source in self.sources):
            return None
        return [k for k, _ in self.sources], [v for _, v in self.sources]

    def keep_source(self, layer, k, v, padding_mask):
        """Keep the source's keys and values for `layer`; padding_mask b x S (True: padding) or None."""
        self.sources[layer] = (k, v)
        if layer == 0 and padding_mask is not None and bool(padding_mask.any()):
            self.source_mask = k.new_zeros(padding_mask.shape).masked_fill_(padding_mask.bool(), -math.inf)[:, None, None]

    def crop(self, cached, block_width, keep, kept, counts=None):
        """Each row's length becomes cached + kept (b, the decoder's rows); a tree's kept path
        keep b x m (block positions) is gathered to follow the prefix. Returns cached + kept.
        counts: kept on the host (a list), where the caller read it: rows as long before the
        block then need no read for the longest and shortest after it."""
        lengths = cached + kept
        if self.tree:
            self.gather_path(cached, keep.clamp(max=block_width - 1))
        if self.rows is None:
            self.lengths = lengths
        else:
            self.lengths.index_copy_(0, self.rows, lengths)
        if block_width == 1:  # a block of one is kept whole: every row one longer, nothing to ask
            self.longest += 1
            return lengths
        if counts is not None and self.equal:  # every live row at self.longest before the block
            self.longest, self.equal = self.longest + max(counts), max(counts) == min(counts)
        else:
            self.measure(lengths)
        return lengths

    def measure(self, lengths):
        """longest and equal from the live rows' lengths (b, at least one): one host read."""
        longest, shortest = torch.stack([lengths.max(), lengths.min()]).tolist()
        self.longest, self.equal = longest, longest == shortest

    def gather_path(self, cached, keep):
        """Every layer's entries at block positions keep (b x m) move to the columns after cached (b)."""
        rows, columns, channels = self.kv.shape[1:]
        row = self.rows if self.rows is not None else torch.arange(cached.size(0), device=cached.device)
        start = (row * columns + cached)[:, None]
        flat = self.kv.view(self.kv.size(0), rows * columns, channels)
        path = flat.index_select(1, (start + keep).view(-1))
        flat.index_copy_(1, (start + torch.arange(keep.size(1), device=keep.device)).view(-1), path)

    def reorder(self, order):
        """Keep the decoder's rows `order` (b', ascending: finished sentences leave). Their
        rows are masked, or, once ROWS_COMPACT_AT of the cache rows are, the batch compacted."""
        rows = order if self.rows is None else self.rows[order]
        total = self.kv.size(1)
        if total - rows.numel() < ROWS_COMPACT_AT * total:
            lengths = torch.zeros_like(self.lengths)  # a finished row attends to its own garbage
            self.lengths, self.rows = lengths.index_copy_(0, rows, self.lengths[rows]), rows
            return
        self.rows = self.compact(rows)

    def compact(self, rows):
        """Keep only the cache rows `rows` (b', the decoder's rows' own): the live rows past
        the first b' move into the holes before it, one copy of those rows' entries only
        (not of the whole cache, as shifting every row down would be), and every buffer
        keeps its first b' rows. Returns the decoder's rows' cache rows now, or None where
        they are 0..b'-1 in order."""
        count = rows.numel()
        live = torch.zeros(self.kv.size(1), dtype=torch.bool, device=rows.device)
        live[rows] = True
        holes, movers = (~live[:count]).nonzero()[:, 0], live[count:].nonzero()[:, 0] + count
        buffers = [self.kv[:, :, : self.longest], self.lengths]  # cache rows at dim 1, then 0
        buffers += [t for source in self.sources if source is not None for t in source]
        if self.source_mask is not None:
            buffers.append(self.source_mask)
        for i, t in enumerate(buffers):
            dim = 1 if i == 0 else 0
            t.index_copy_(dim, holes, t.index_select(dim, movers))
        self.kv, self.lengths = self.kv[:, :count], self.lengths[:count]
        self.sources = [None if s is None else (s[0][:count], s[1][:count]) for s in self.sources]
        if self.source_mask is not None:
            self.source_mask = self.source_mask[:count]
        if count:  # the rows that left may have been the longest, or the only ones of another length
            self.measure(self.lengths)
        remap = torch.arange(live.numel(), device=rows.device)
        remap[movers] = holes
        rows = remap[rows]
        return None if bool((rows == torch.arange(count, device=rows.device)).all()) else rows

    def resize(self, columns):
        """A new buffer of `columns` per row, the valid entries copied."""
        kv = self.kv.new_zeros(*self.kv.shape[:2], columns, self.kv.size(3))
        kv[:, :, : self.longest] = self.kv[:, :, : self.longest]
        self.kv = kv
        self.block_masks = {key: kept for key, kept in self.block_masks.items() if key[0] != "prefix"}
