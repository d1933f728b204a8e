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

A static cache (preallocated per batch and length, written in place) is a sibling class
with the same methods, not a branch here.
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

    def crop(self, cached, block_width, keep, kept):
        """Keep, after each sentence's cached prefix, only the chosen entries of the last block.

        Before the call each layer's self-attention cache holds, per sentence, `cached`
        (b) valid entries among its first W columns, the others hidden by the key padding
        mask (fairseq's attention reads it with the cache), then the `block_width` entries
        of the block just fed. keep: b x m, block positions in the order they stay (a
        chain's accepted prefix 0, 1, ...; a tree's accepted path); the first `kept` (b)
        of them stay. Returns cached + kept.

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
        longest = int(kept.max())
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
