"""The loop's reused memory (generator.Scratch): head 1's log-probs and exact_chain's sums are
made in the same memory every invocation of a batch, and nothing a sentence keeps across
invocations (its tokens, scores, running score, hypothesis) may be a view of it."""
import math

import pytest
import torch

from conftest import build, random_sample
from test_generator import assert_same, blockwise, greedy

from fairseq_bpd import generator as module
from fairseq_bpd.acceptance import exact_chain
from fairseq_bpd.generator import BlockwiseGenerator, Scratch, plain_normalizer

EOS = 2


def test_scratch_gives_a_name_the_same_memory_and_grows_it():
    scratch = Scratch(True)
    like = torch.zeros(2, 3, 5)
    first = scratch.take("a", like)
    assert first.shape == like.shape and first.is_contiguous() and first.dtype == like.dtype
    assert scratch.take("a", like) is first  # the same shape: the same tensor
    assert scratch.take("a", torch.zeros(1, 2, 5)).data_ptr() == first.data_ptr()  # a smaller one fits
    assert scratch.take("b", like).data_ptr() != first.data_ptr()
    wider = scratch.take("a", torch.zeros(4, 3, 5))
    assert wider.shape == (4, 3, 5) and wider.is_contiguous()
    assert scratch.take("a", like, torch.float64).dtype == torch.float64
    again = scratch.take("a", like)
    assert again.dtype == like.dtype and again.shape == like.shape


@pytest.mark.parametrize("speculate", [False, True])
def test_exact_chains_outputs_outlive_the_memory_its_sums_were_made_in(speculate):
    torch.manual_seed(0)
    b, n, V = 3, 4, 30
    lprobs = torch.randn(b, n, V).log_softmax(-1)
    block = torch.randint(3, V, (b, n))
    block[:, 1:] = (lprobs + 0).argmax(-1)[:, :-1]  # mostly accepted
    score = torch.randn(b)
    want = exact_chain(lprobs, block, score, None, EOS, speculate)
    out = torch.empty(b, n, V)
    got = exact_chain(lprobs, block, score, None, EOS, speculate, out)
    out.fill_(math.nan)  # the next invocation's sums
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_the_plain_normalizer_is_fairseqs_own_only(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4")
    assert plain_normalizer(model)
    model.get_normalized_probs = lambda net_output, log_probs, sample=None: None
    assert not plain_normalizer(model)
    del model.get_normalized_probs
    model.decoder.onnx_trace = True
    assert not plain_normalizer(model)


def test_a_model_with_its_own_normalizer_decodes_with_it(data_dir):
    """Log-probs fairseq's log_softmax does not make (a normalizer of the instance's own) are
    the model's, every invocation."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=2, seed=2)
    expected = greedy(model, task, sample)
    calls = []
    normalize = model.get_normalized_probs
    model.get_normalized_probs = lambda *a, **k: calls.append(1) or normalize(*a, **k)
    hypos, _ = blockwise(model, task, sample, 4)
    del model.get_normalized_probs
    assert_same(expected, hypos)
    assert len(calls) == max(h[0]["steps"] for h in hypos)  # once an invocation


class Watched(BlockwiseGenerator):
    """Records where head 1's log-probs lie, invocation by invocation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.addresses = []

    def head1_lprobs(self, *args, **kwargs):
        lprobs = super().head1_lprobs(*args, **kwargs)
        self.addresses.append(lprobs.data_ptr())
        return lprobs


@pytest.mark.parametrize("block_size,tree", [(1, 0), (2, 0), (4, 0), (4, 5)])
def test_decoding_on_reused_memory_is_greedys_as_the_batch_shrinks(data_dir, block_size, tree):
    """float64 against SequenceGenerator(beam_size=1): tokens, running scores and attention of
    every finished sentence, the batch shrinking as sentences reach their own maximum length,
    on log-probs (and sums) made in the same memory each invocation."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=3)
    sample = random_sample(task, bsz=6, seed=3, min_len=2, max_len=12)
    options = dict(max_len_a=1.0, max_len_b=2)
    expected = greedy(model, task, sample, **options)
    generator = Watched(model, task.target_dictionary, block_size=block_size, tree=tree, **options)
    hypos = generator.generate([model], sample)
    assert_same(expected, hypos)
    lengths = {len(h[0]["tokens"]) for h in hypos}
    assert len(lengths) > 1  # the batch shrank
    assert len(set(generator.addresses)) < len(generator.addresses) / 2  # the memory was reused


@pytest.mark.parametrize("block_size", [1, 4])
def test_reused_memory_decodes_bit_for_bit_as_fresh_tensors(data_dir, monkeypatch, block_size):
    """float32 (the products packed where oneDNN serves): outputs, scores and attention the same
    to the bit whether each invocation's scratch tensors are fresh or reused."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=5, dtype=torch.float32)
    sample = random_sample(task, bsz=5, seed=5, min_len=2, max_len=12)
    options = dict(max_len_a=1.0, max_len_b=2)
    reused, _ = blockwise(model, task, sample, block_size, **options)
    monkeypatch.setattr(module.Scratch, "take", lambda self, name, like, dtype=None: torch.empty(
        like.shape, dtype=dtype or like.dtype))
    fresh, _ = blockwise(model, task, sample, block_size, **options)
    for r, f in zip(reused, fresh):
        for key in ("tokens", "positional_scores", "score", "attention"):
            assert torch.equal(r[0][key], f[0][key]), key
