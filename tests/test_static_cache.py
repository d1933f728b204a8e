"""The static cache and the lean pass (cache.StaticCache, static_pass.py): every block's
features equal recomputing each sentence's whole prefix and equal fairseq's incremental
state, over random acceptance lengths and widths, trees, growth and sentences leaving;
the generator over it gives fairseq's greedy output; other layers fall back, and say so."""
import logging

import pytest
import torch

from conftest import build, random_sample

from fairseq_bpd import cache as cache_room
from fairseq_bpd.cache import IncrementalCache, StaticCache
from fairseq_bpd.tree import Tree

TREE = Tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])  # nodes: root, (0), (1), (0, 0), (1, 0), (0, 0, 0)


def full_prefix_features(model, encoder_out, i, tokens):
    """Sentence i's features after `tokens` (a list, BOS first), from one pass without a cache."""
    one = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([i]))
    full, _ = model.decoder.extract_features(torch.tensor([tokens]), one)
    return full[0]


class Sentences:
    """Blocks of random tokens, random widths (or a tree), fed through forward_block after each
    sentence's kept prefix; random kept lengths; sentences leave at `leave` rounds."""

    def __init__(self, data_dir, bsz, seed, static=True, tree=None, dtype=torch.float64, extra=()):
        self.task, self.model, _ = build(data_dir, "--block-size", "4", *extra, seed=seed, dtype=dtype)
        self.decoder, self.eos = self.model.decoder, self.task.target_dictionary.eos()
        self.decoder.static_cache = static
        sample = random_sample(self.task, bsz=bsz, seed=seed)
        self.encoder_out = self.model.encoder.forward_torchscript(sample["net_input"])
        self.random = torch.Generator().manual_seed(seed)
        self.prefixes = [[] for _ in range(bsz)]  # the kept tokens of each sentence still there
        self.rows = list(range(bsz))  # which sentence each row is
        self.cached = torch.zeros(bsz, dtype=torch.long)
        self.state, self.tree, self.first = {}, tree, True
        self.alignment = True  # the alignment layer's attention asked for (the hub's, when asked)

    def block(self, width):
        b = len(self.rows)
        n = 1 if self.first else width
        block = torch.randint(4, 28, (b, n), generator=self.random)
        if self.first:
            block[:, 0] = self.eos
        return block

    def feed(self, width=4):
        """One block: its features (b x n x C); the tree's when there is one."""
        tree = self.tree if self.tree is not None and not self.first else None
        block = self.block(tree.size if tree is not None else width)
        depth = tree.depth if tree is not None else torch.arange(block.size(1))
        mask = tree.mask if tree is not None else None
        features, _ = self.decoder.forward_block(block, self.cached[:, None] + depth, self.encoder_out, self.state,
                                                 mask, alignment=self.alignment)
        self.first = False
        return block, features, tree

    def check(self, block, features, tree, atol=1e-6):
        for i, prefix in enumerate(self.prefixes):
            if tree is None:  # a chain: one pass over the prefix and the whole block
                full = full_prefix_features(self.model, self.encoder_out, i, prefix + block[i].tolist())
                torch.testing.assert_close(features[i], full[-block.size(1):], atol=atol, rtol=0)
                continue
            for j in range(tree.size):
                path = tree.paths[j, : int(tree.depth[j]) + 1]
                full = full_prefix_features(self.model, self.encoder_out, i, prefix + block[i, path].tolist())
                torch.testing.assert_close(features[i, j], full[-1], atol=atol, rtol=0)

    def keep(self, block, tree):
        """Random kept lengths (a random node's path in a tree); returns kept."""
        b, n = block.shape
        if tree is None:
            kept = torch.randint(1, n + 1, (b,), generator=self.random)
            keep = torch.arange(n).expand(b, -1)
        else:
            node = torch.randint(0, tree.size, (b,), generator=self.random)
            keep, kept = tree.paths[node], tree.depth[node] + 1
        for i in range(b):
            self.prefixes[i] += block[i, keep[i, : kept[i]]].tolist()
        self.cached = self.decoder.crop_cache(self.state, self.cached, n, keep, kept)
        assert self.cached.tolist() == [len(p) for p in self.prefixes]
        return kept

    def leave(self, active):
        """The rows `active` stay, as when the others' sentences finished."""
        active = torch.tensor(active)
        self.decoder.reorder_incremental_state_scripting(self.state, active)
        self.encoder_out = self.model.encoder.reorder_encoder_out(self.encoder_out, active)
        self.cached = self.cached[active]
        self.prefixes = [self.prefixes[i] for i in active.tolist()]
        self.rows = [self.rows[i] for i in active.tolist()]


@pytest.mark.parametrize("compact_at", [0.0, 0.25, 2.0])  # at once (the default), at a fraction, never
@pytest.mark.parametrize("tree", [None, TREE])
def test_blocks_match_a_full_prefix_pass(data_dir, monkeypatch, compact_at, tree):
    """Random widths (1 to 4: equal lengths, then rows apart) or a tree's paths, random
    kept lengths, two sentences leaving (masked or compacted): each block's features are
    a full pass over its sentence's prefix. Compacting moves the last live rows into the
    finished ones' (the decoder's rows then map to cache rows out of order)."""
    monkeypatch.setattr(cache_room, "ROWS_COMPACT_AT", compact_at)
    sentences = Sentences(data_dir, bsz=5, seed=11, tree=tree)
    saw_unequal = saw_masked = saw_moved = False
    for round_ in range(12):
        block, features, used_tree = sentences.feed(width=int(torch.randint(1, 5, (), generator=sentences.random)))
        cache = sentences.decoder.cache(sentences.state)
        assert type(cache) is StaticCache
        saw_unequal |= not cache.equal
        saw_masked |= cache.kv.size(1) > len(sentences.rows)  # a finished row still there
        saw_moved |= cache.kv.size(1) == len(sentences.rows) and cache.rows is not None
        sentences.check(block, features, used_tree)
        sentences.keep(block, used_tree)
        if round_ == 4:
            sentences.leave([0, 2, 3, 4])
        if round_ == 8:
            sentences.leave([1, 3])
    assert saw_unequal
    assert saw_masked == (compact_at > 0)  # one of five leaves first: 0.2 of the rows
    assert saw_moved == (compact_at == 0)  # row 1 leaves first: row 4 moves into it


def test_the_cache_grows_past_its_columns(data_dir, monkeypatch):
    """A cache of 4 columns is widened (copying its entries) as the prefixes outgrow it."""
    monkeypatch.setattr(cache_room, "COLUMNS", 4)
    sentences = Sentences(data_dir, bsz=3, seed=12)
    for _ in range(6):
        block, features, _ = sentences.feed()
        sentences.check(block, features, None)
        sentences.keep(block, None)
    assert sentences.decoder.cache(sentences.state).kv.size(2) >= max(map(len, sentences.prefixes))


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])  # softmax in float32, as fairseq
@pytest.mark.parametrize("tree", [None, TREE])
def test_the_static_cache_reads_as_fairseqs_incremental_state(data_dir, dtype, atol, tree):
    """The same blocks, kept lengths and leaving sentences on both caches: the same features
    and attention (the static cache's lean pass against block_layer on fairseq's format)."""
    static = Sentences(data_dir, bsz=4, seed=13, tree=tree, dtype=dtype)
    incremental = Sentences(data_dir, bsz=4, seed=13, static=False, tree=tree, dtype=dtype)
    for round_ in range(8):
        width = int(torch.randint(1, 5, (), generator=torch.Generator().manual_seed(round_)))
        (block, features, used), (other_block, other_features, _) = static.feed(width), incremental.feed(width)
        assert torch.equal(block, other_block)
        torch.testing.assert_close(features, other_features, atol=atol, rtol=0)
        assert type(static.decoder.cache(static.state)) is StaticCache
        assert type(incremental.decoder.cache(incremental.state)) is IncrementalCache
        assert torch.equal(static.keep(block, used), incremental.keep(other_block, used))
        if round_ == 3:
            static.leave([0, 2, 3])
            incremental.leave([0, 2, 3])


def test_alignment_attention_matches_fairseqs_format(data_dir):
    """The alignment layer's attention over the source (b x n x S) is block_layer's."""
    static = Sentences(data_dir, bsz=3, seed=14)
    incremental = Sentences(data_dir, bsz=3, seed=14, static=False)
    for _ in range(3):
        block = static.block(3)
        incremental.block(3)
        positions = static.cached[:, None] + torch.arange(block.size(1))
        _, attn = static.decoder.forward_block(block, positions, static.encoder_out, static.state)
        _, other = incremental.decoder.forward_block(block, positions, incremental.encoder_out, incremental.state)
        static.first = incremental.first = False
        torch.testing.assert_close(attn, other, atol=1e-6, rtol=0)
        kept = torch.tensor([1, 3, 2][: block.size(1)] if block.size(1) == 3 else [1, 1, 1])
        keep = torch.arange(block.size(1)).expand(3, -1)
        static.cached = static.decoder.crop_cache(static.state, static.cached, block.size(1), keep, kept)
        incremental.cached = incremental.decoder.crop_cache(incremental.state, incremental.cached, block.size(1),
                                                            keep, kept)


def test_a_layer_not_understood_falls_back_and_says_why(data_dir, caplog):
    """A hook on one layer: fairseq's incremental state (its own layer for that one), said
    once in the log with the reason; without it the static cache."""
    sentences = Sentences(data_dir, bsz=2, seed=15)
    decoder = sentences.decoder
    handle = decoder.layers[1].fc1.register_forward_hook(lambda *args: None)
    try:
        with caplog.at_level(logging.INFO, logger="fairseq_bpd.decoder"):
            for _ in range(2):
                state = {}
                decoder.forward_block(torch.tensor([[2], [2]]), torch.zeros(2, 1, dtype=torch.long),
                                      sentences.encoder_out, state)
                assert type(decoder.cache(state)) is IncrementalCache and "blockwise_static_cache" not in state
        said = [r.getMessage() for r in caplog.records if "no static cache" in r.getMessage()]
        assert len(said) == 1 and "layer 1: a forward hook" in said[0]
    finally:
        handle.remove()
    sentences.model.eval()  # the verdicts are made again after eval() (a removal draws no new hook id)
    state = {}
    decoder.forward_block(torch.tensor([[2], [2]]), torch.zeros(2, 1, dtype=torch.long), sentences.encoder_out, state)
    assert type(decoder.cache(state)) is StaticCache


@pytest.mark.parametrize("compact_at", [0.0, 2.0])
@pytest.mark.parametrize("bsz", [1, 16])
def test_greedy_output_with_finished_rows_masked_or_compacted(data_dir, monkeypatch, compact_at, bsz):
    """The generator over the static cache, random runs and widths, EOS and the maximum
    length inside blocks, finished rows compacted at once or kept masked to the end:
    fairseq's greedy output."""
    from test_generator import RandomRuns, assert_same, blockwise, ending_model, greedy

    monkeypatch.setattr(cache_room, "ROWS_COMPACT_AT", compact_at)
    task, model = ending_model(data_dir, 6)
    sample = random_sample(task, bsz=bsz, seed=2, max_len=20)
    for max_len_b in (40, 9):
        expected = greedy(model, task, sample, max_len_b=max_len_b)
        hypos, _ = blockwise(model, task, sample, 6, RandomRuns, max_len_b=max_len_b,
                             references=[e["tokens"] for e in expected], seed=3, random_widths=True)
        assert_same(expected, hypos)
