"""The cache's room (cache.py): fairseq's incremental state cropped to the accepted entries
reads as recomputing every sentence's whole prefix, for fairseq's own step too."""
import pytest
import torch

from conftest import build, random_sample

from fairseq_bpd import cache as cache_room
from fairseq_bpd.cache import IncrementalCache


def assert_features_of_a_full_prefix_pass(model, encoder_out, prefixes, block, features):
    """Each sentence's block features (b x n x C) equal one pass over its prefix (a token
    list) and its block (b x n), without a cache."""
    for i, prefix in enumerate(prefixes):
        full_input = torch.tensor(prefix + block[i].tolist())[None]
        one = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([i]))
        full, _ = model.decoder.extract_features(full_input, one)
        assert torch.allclose(features[i], full[0, -block.size(1):], atol=1e-6)


def test_cached_blocks_match_a_full_prefix_pass(data_dir):
    """Feeding blocks and rolling back a different suffix per sentence equals recomputing."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=9)
    decoder, eos = model.decoder, task.target_dictionary.eos()
    decoder.static_cache = False  # fairseq's format, which these tests read
    sample = random_sample(task, bsz=3, seed=9)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    torch.manual_seed(0)
    prefixes = [[] for _ in range(3)]
    cached = torch.zeros(3, dtype=torch.long)
    state = {}
    for round_, kept in enumerate(([1, 1, 1], [3, 1, 2], [2, 4, 1], [4, 4, 4], [1, 3, 2], [2, 2, 2])):
        block = torch.randint(4, 28, (3, 4))
        if round_ == 0:
            block[:, 0] = eos
        positions = cached[:, None] + torch.arange(4)
        features, _ = decoder.forward_block(block, positions, encoder_out, state)
        assert_features_of_a_full_prefix_pass(model, encoder_out, prefixes, block, features)
        kept = torch.tensor(kept)
        for i in range(3):
            prefixes[i] += block[i, : kept[i]].tolist()
        cached = IncrementalCache(decoder.layers, state).crop(cached, 4, torch.arange(4).expand(3, -1), kept)
        assert cached.tolist() == [len(p) for p in prefixes]


def test_masked_holes_and_compaction_match_a_full_prefix_pass(data_dir):
    """Rejected entries left in the cache as masked holes, compacted now and then, a sentence
    leaving the batch in between: every block's features still equal recomputing the prefix."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=10)
    decoder, eos = model.decoder, task.target_dictionary.eos()
    decoder.static_cache = False
    sample = random_sample(task, bsz=4, seed=10)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    generator = torch.Generator().manual_seed(3)
    prefixes = [[] for _ in range(4)]
    rows = list(range(4))
    cached = torch.zeros(4, dtype=torch.long)
    state, saw_holes, compactions = {}, False, 0
    for round_ in range(14):
        b = len(rows)
        block = torch.randint(4, 28, (b, 4), generator=generator)
        if round_ == 0:
            block[:, 0] = eos
        features, _ = decoder.forward_block(block, cached[:, None] + torch.arange(4), encoder_out, state)
        assert_features_of_a_full_prefix_pass(model, encoder_out, [prefixes[row] for row in rows], block, features)
        kept = torch.randint(1, 3, (b,), generator=generator)
        kept[round_ % b] = 4  # one keeps all: the others' rejected entries stay as holes, then pile up
        for i, row in enumerate(rows):
            prefixes[row] += block[i, : kept[i]].tolist()
        cache = IncrementalCache(decoder.layers, state)
        width = cache.width()
        cached = cache.crop(cached, 4, torch.arange(4).expand(b, -1), kept)
        assert cached.tolist() == [len(prefixes[row]) for row in rows]
        buffer = decoder.layers[0].self_attn._get_input_buffer(state)
        mask = buffer["prev_key_padding_mask"]
        assert buffer["prev_key"].size(2) >= int(cached.max())
        if mask is not None:
            assert (~mask.bool()).sum(1).tolist() == cached.tolist()  # the unmasked entries are the prefix
            saw_holes |= bool((mask.bool()[:, :-1] & ~mask.bool()[:, 1:]).any())  # a hole before an entry
        compactions += buffer["prev_key"].size(2) < width - 4
        if round_ == 6:  # the second sentence leaves, as a finished one does
            active = torch.tensor([0, 2, 3])
            decoder.reorder_incremental_state_scripting(state, active)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, active)
            cached, rows = cached[active], [rows[i] for i in active.tolist()]
    assert saw_holes and compactions > 0


class Blocks:
    """Blocks of random tokens fed through forward_block after each sentence's kept prefix."""

    def __init__(self, data_dir, bsz, seed):
        self.task, self.model, _ = build(data_dir, "--block-size", "4", seed=seed)
        self.decoder, self.eos = self.model.decoder, self.task.target_dictionary.eos()
        self.decoder.static_cache = False
        sample = random_sample(self.task, bsz=bsz, seed=seed)
        self.encoder_out = self.model.encoder.forward_torchscript(sample["net_input"])
        self.generator = torch.Generator().manual_seed(seed)
        self.prefixes = [[] for _ in range(bsz)]
        self.cached = torch.zeros(bsz, dtype=torch.long)
        self.state = {}
        self.cache = IncrementalCache(self.decoder.layers, self.state)

    def feed(self, n=4, mask=None, positions=None):
        """One block of n (BOS first in the first): its features, checked against full passes."""
        bsz = self.cached.size(0)
        block = torch.randint(4, 28, (bsz, n), generator=self.generator)
        if not any(self.prefixes):
            block[:, 0] = self.eos
        positions = self.cached[:, None] + (torch.arange(n) if positions is None else positions)
        features, _ = self.decoder.forward_block(block, positions, self.encoder_out, self.state, mask)
        if mask is None:
            assert_features_of_a_full_prefix_pass(self.model, self.encoder_out, self.prefixes, block, features)
        return block

    def keep(self, block, kept, keep=None):
        """Keep each sentence's first kept[i] entries of `keep` (default the chain 0, 1, ...)."""
        kept = torch.tensor(kept)
        keep = torch.arange(block.size(1)).expand(block.size(0), -1) if keep is None else keep
        for i in range(block.size(0)):
            self.prefixes[i] += block[i, keep[i, : kept[i]]].tolist()
        self.cached = self.cache.crop(self.cached, block.size(1), keep, kept)
        assert self.cached.tolist() == [len(p) for p in self.prefixes]

    def buffer(self):
        return self.decoder.layers[0].self_attn._get_input_buffer(self.state)


def test_an_empty_cache_has_no_width(data_dir):
    blocks = Blocks(data_dir, bsz=2, seed=1)
    assert blocks.cache.width() == 0
    blocks.feed()
    assert blocks.cache.width() == 4


@pytest.mark.parametrize("kept,holes", [
    ([2, 2, 2], None),  # every sentence keeps as much: the tail is cut
    ([1, 3, 2], [[False, True, True], [False] * 3, [False, False, True]]),  # what only some rejected is masked
])
def test_a_chains_rejected_entries_cost_no_copy(data_dir, kept, holes):
    blocks = Blocks(data_dir, bsz=3, seed=2)
    block = blocks.feed()
    keys = blocks.buffer()["prev_key"]
    blocks.keep(block, kept)
    buffer = blocks.buffer()
    assert blocks.cache.width() == max(kept)
    assert buffer["prev_key"].data_ptr() == keys.data_ptr()  # a view of the same columns
    mask = buffer["prev_key_padding_mask"]
    assert (mask if mask is None else mask.tolist()) == holes
    blocks.feed()


def test_holes_wider_than_compact_at_are_gathered_out(data_dir):
    """[4, 1] then [1, 4]: 8 columns for prefixes of 5, past 1.5 x 5; compacted, no sentence is shorter."""
    blocks = Blocks(data_dir, bsz=2, seed=4)
    blocks.keep(blocks.feed(), [4, 1])
    assert blocks.cache.width() == 4 and blocks.buffer()["prev_key_padding_mask"] is not None
    blocks.keep(blocks.feed(), [1, 4])
    assert blocks.cache.width() == 5 and blocks.buffer()["prev_key_padding_mask"] is None
    blocks.feed()


def test_compact_at_decides_when_holes_are_gathered(data_dir, monkeypatch):
    monkeypatch.setattr(cache_room, "COMPACT_AT", -1.0)  # no hole survives a block
    blocks = Blocks(data_dir, bsz=3, seed=5)
    blocks.keep(blocks.feed(), [1, 3, 2])
    assert blocks.cache.width() == 3
    assert blocks.buffer()["prev_key_padding_mask"].tolist() == [[False, True, True], [False] * 3, [False, False, True]]
    blocks.feed()


def test_a_trees_path_is_gathered_to_the_front(data_dir):
    """Kept entries that are no chain prefix (a tree's path: block positions 0, 2, 3) are compacted."""
    from fairseq_bpd.tree import Tree

    tree = Tree([(0,), (1,), (1, 0)])  # nodes: root, (0), (1), (1, 0)
    blocks = Blocks(data_dir, bsz=2, seed=6)
    block = blocks.feed(n=tree.size, mask=tree.mask, positions=tree.depth)
    blocks.keep(block, [3, 2], keep=torch.tensor([[0, 2, 3], [0, 1, 1]]))
    assert blocks.cache.width() == 3
    assert blocks.buffer()["prev_key_padding_mask"].tolist() == [[False] * 3, [False, False, True]]
    blocks.feed()


def test_fairseqs_own_step_reads_a_cropped_cache_with_holes(data_dir):
    """After crops that leave holes, fairseq's incremental step (its MultiheadAttention, its
    positions) gives each sentence the features of a pass over its whole prefix."""
    blocks = Blocks(data_dir, bsz=3, seed=7)
    blocks.keep(blocks.feed(), [1, 3, 2])
    blocks.keep(blocks.feed(), [3, 1, 2])  # 4 entries each, in 6 columns
    assert blocks.cache.width() == 6 and blocks.buffer()["prev_key_padding_mask"] is not None
    tokens = torch.tensor([prefix + [5 + i] for i, prefix in enumerate(blocks.prefixes)])  # b x 5
    step, _ = blocks.decoder.extract_features(tokens, blocks.encoder_out, incremental_state=blocks.state)
    for i in range(3):
        one = blocks.model.encoder.reorder_encoder_out(blocks.encoder_out, torch.tensor([i]))
        full, _ = blocks.decoder.extract_features(tokens[i : i + 1], one)
        assert torch.allclose(step[i, -1], full[0, -1], atol=1e-6)
    assert blocks.cache.width() == 7  # fairseq's step appended its entry in the same format
