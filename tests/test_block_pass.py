"""The decoder's compiled batch-1 block pass (csrc/block_pass.cpp, static_pass.compiled): the
Python lean pass's function, bit for bit where both run MKL's products; taken at batch 1 in
float32 only, and decoding through it gives the Python pass's tokens."""
import copy
import pickle

import pytest
import torch

from conftest import build, random_sample
from test_generator import blockwise
from test_static_cache import TREE, Sentences

from fairseq_bpd import kernels
from fairseq_bpd.product import PACKED_VARIABLE
from fairseq_bpd.static_pass import LeanWeights


@pytest.fixture
def kern():
    module = kernels.module()
    assert module is not None  # they build on this machine (and CI's): a fallback would hide a failure
    return module


class Counted:
    """A compiled pass whose runs are counted."""

    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    def run(self, *args):
        self.runs += 1
        return self.inner.run(*args)


def counting(monkeypatch):
    """Every LeanWeights' compiled pass counted; returns the list of counters."""
    counters = []
    original = LeanWeights.block_pass

    def block_pass(self, kern):
        made = original(self, kern)
        if made and not isinstance(made, Counted):
            made = self.compiled = Counted(made)
            counters.append(made)
        return made

    monkeypatch.setattr(LeanWeights, "block_pass", block_pass)
    return counters


def without_compiled_pass(monkeypatch):
    monkeypatch.setattr(LeanWeights, "block_pass", lambda self, kern: False)


def feed_and_keep(sentences, widths, alignment=False):
    sentences.alignment = alignment  # as fairseq's commands decode: no attention weights asked for
    features = []
    for width in widths:
        with torch.no_grad():
            block, out, tree = sentences.feed(width)
        features.append(out)
        sentences.check(block, out, tree, atol=1e-5)  # float32: a full-prefix pass, to rounding
        sentences.keep(block, tree)
    return features


@pytest.mark.parametrize("extra", [(), ("--decoder-normalize-before",)], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_the_compiled_pass_is_the_python_pass_bit_for_bit(kern, data_dir, monkeypatch, extra, tree):
    """Blocks of random widths (or a tree) with random kept lengths at batch 1: each block's
    features are a full-prefix pass's (to float32 rounding) and, MKL's products on both
    sides, the Python lean pass's bit for bit; the compiled pass ran every block."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    widths = [1, 3, 1, 4, 2, 4, 1, 3]
    counters = counting(monkeypatch)
    compiled = feed_and_keep(Sentences(data_dir, bsz=1, seed=31, tree=tree, dtype=torch.float32, extra=extra), widths)
    assert [c.runs for c in counters] == [len(widths)]
    monkeypatch.undo()
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    without_compiled_pass(monkeypatch)
    python = feed_and_keep(Sentences(data_dir, bsz=1, seed=31, tree=tree, dtype=torch.float32, extra=extra), widths)
    for a, b in zip(compiled, python):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", [1, 3, 5])
def test_decoding_through_the_compiled_pass_gives_the_python_pass_tokens(kern, data_dir, monkeypatch, block_size):
    """Whole decodings at batch 1 in float32 (heads that agree at random, sentences ending
    inside blocks), one sentence at a time through the compiled pass, then through Python's:
    the same tokens, scores and steps. At batch 3 the compiled pass is not taken."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    task, model, _ = build(data_dir, "--block-size", str(block_size), seed=7, dtype=torch.float32)
    sample = random_sample(task, bsz=3, seed=7)
    counters = counting(monkeypatch)
    with torch.no_grad():
        blockwise(model, task, sample, block_size, attention=False)
    assert sum(c.runs for c in counters) == 0  # batch 3: the Python pass
    ones = [decode_one(model, task, sample, i, block_size) for i in range(3)]
    assert sum(c.runs for c in counters) > 3
    monkeypatch.undo()
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    without_compiled_pass(monkeypatch)
    for i, hypo in enumerate(ones):
        python = decode_one(model, task, sample, i, block_size)
        assert torch.equal(hypo["tokens"], python["tokens"])
        assert torch.equal(hypo["positional_scores"], python["positional_scores"])
        assert hypo["steps"] == python["steps"]


def decode_one(model, task, sample, i, block_size):
    """Sentence i of the sample alone: its best hypothesis."""
    one = {"id": sample["id"][i : i + 1], "net_input": {k: v[i : i + 1] for k, v in sample["net_input"].items()}}
    with torch.no_grad():
        hypos, _ = blockwise(model, task, one, block_size, attention=False)
    return hypos[0][0]


@pytest.mark.parametrize("case", ["float64", "gelu", "no-kernels", "alignment"])
def test_the_python_pass_serves_where_the_compiled_one_does_not(kern, data_dir, monkeypatch, case):
    """Float64 (the exactness tests' dtype), a gelu feed-forward, the kernels turned off,
    the alignment layer's attention asked for: the Python pass, and the features a
    full-prefix pass's."""
    extra = ("--activation-fn", "gelu") if case == "gelu" else ()
    dtype = torch.float64 if case == "float64" else torch.float32
    if case == "no-kernels":
        monkeypatch.setenv(kernels.VARIABLE, "0")
    counters = counting(monkeypatch)
    feed_and_keep(Sentences(data_dir, bsz=1, seed=33, dtype=dtype, extra=extra), [1, 3, 2], case == "alignment")
    assert sum(c.runs for c in counters) == 0


def test_copies_and_pickles_make_their_own_compiled_pass(kern, data_dir):
    _, model, _ = build(data_dir, seed=3, dtype=torch.float32)
    lean = LeanWeights(model.decoder.layers)
    made = lean.block_pass(kern)
    assert made and lean.block_pass(kern) is made
    for other in (copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
        assert other.compiled is None
        assert other.block_pass(kern) and other.compiled is not made


def test_the_compiled_pass_refuses_what_it_would_misread(kern, data_dir):
    _, model, _ = build(data_dir, seed=3, dtype=torch.float32)
    lean = LeanWeights(model.decoder.layers)
    block_pass = lean.block_pass(kern)
    layers, channels = len(model.decoder.layers), 16
    kv = torch.zeros(layers, 1, 8, 3 * channels)
    source = [torch.zeros(1, 2, 5, channels // 2)] * layers
    x = torch.zeros(2, channels)
    block_pass.run(x, kv, 0, torch.zeros(2, 2), source, source, None)  # as it should be
    bad = [
        (x.double(), kv, 0, None),  # float64 rows
        (torch.zeros(2, channels + 1), kv, 0, None),  # the wrong width
        (x, kv, 7, None),  # no room in the cache for the block
        (x, kv, 2 ** 63 - 2, None),  # no room either (longest + n would overflow)
        (x, kv[:, :, :, :channels], 0, None),  # not a 3C cache
        (x, kv.transpose(2, 3).contiguous().transpose(2, 3), 0, None),  # a cache's columns not contiguous
        (x, kv, 0, torch.zeros(2, 3)),  # a mask of the wrong width
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match="BlockPass"):
            block_pass.run(*args, source, source, None)
    with pytest.raises(RuntimeError, match="BlockPass"):
        block_pass.run(x, kv, 0, None, source[:1], source[:1], None)
    with pytest.raises(RuntimeError, match="BlockPass"):
        kern.BlockPass([], [], [], [], [])


def test_the_last_sentence_of_a_batch_takes_the_compiled_pass(kern, data_dir, monkeypatch):
    """Three sentences kept to unequal lengths, then all but the shortest leave (the cache
    compacted to its row, longer ones' columns past its length; compacting to one row makes
    its length the longest): every block after is the compiled pass's, each a full-prefix
    pass's features and bit for bit the Python pass's."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    results = []
    for compiled_on in (True, False):
        if compiled_on:
            counters = counting(monkeypatch)
        else:
            without_compiled_pass(monkeypatch)
        sentences = Sentences(data_dir, bsz=3, seed=34, dtype=torch.float32)
        feed_and_keep(sentences, [1, 3, 4])
        shortest = int(sentences.cached.argmin())
        assert sentences.cached[shortest] < sentences.cached.max()
        sentences.leave([shortest])
        results.append(feed_and_keep(sentences, [3, 1, 4, 2]))
        if compiled_on:
            assert sum(c.runs for c in counters) == 4
    for a, b in zip(*results):
        assert torch.equal(a, b)
