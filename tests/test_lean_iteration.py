"""The lean iteration's pieces against what they replace: greedy_choice is torch.topk's first
choice (fairseq's beam 1) on unique maxima, ties, -inf and NaN rows; the proposals' one-addmm
projection is the decoder's projection with padding at -inf."""
import math

import pytest
import torch

from conftest import build

from fairseq_bpd import acceptance
from fairseq_bpd.acceptance import greedy_choice
from fairseq_bpd.heads import decoding_logits


def topk_first(scores):
    values, tokens = torch.topk(scores, k=2, dim=-1)
    return values[..., :1], tokens[..., :1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 8])  # below and above CHOICE_BY_MAXIMUM
def test_greedy_choice_is_topks_first(dtype, rows):
    torch.manual_seed(rows)
    scores = torch.randn(3, rows, 50, dtype=dtype).log_softmax(-1) - 7.0
    values, tokens = greedy_choice(scores, 1)
    want_values, want_tokens = topk_first(scores)
    assert tokens.dtype == torch.long and tokens.shape == (3, rows, 1)
    assert torch.equal(tokens, want_tokens) and torch.equal(values, want_values)


@pytest.mark.parametrize("spoil", ["tie", "all -inf", "nan"])
def test_greedy_choice_falls_back_to_topk(monkeypatch, spoil):
    """A tie at the top, a row with no finite score or a NaN anywhere: topk's own choice."""
    torch.manual_seed(0)
    scores = torch.randn(2, 8, 40)
    if spoil == "tie":
        scores[1, 3, 7] = scores[1, 3, 30] = scores[1, 3].max() + 1
    elif spoil == "all -inf":
        scores[0, 5] = -math.inf
    else:
        scores[1, 2, 9] = math.nan
    calls = []
    topk = torch.topk
    monkeypatch.setattr(acceptance.torch, "topk", lambda *a, **k: calls.append(1) or topk(*a, **k))
    values, tokens = greedy_choice(scores, 1)
    want_values, want_tokens = topk_first(scores)
    assert calls, "topk was not called"
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(values.isnan(), want_values.isnan())
    assert torch.equal(values.nan_to_num(), want_values.nan_to_num())


def test_greedy_choice_of_several_ranks_is_topk():
    scores = torch.randn(4, 6, 30)
    values, tokens = greedy_choice(scores, 3)
    assert torch.equal(tokens, torch.topk(scores, 3, dim=-1)[1])


@pytest.mark.parametrize("vocab", [0, 9])
def test_proposal_logits_are_the_projection_with_padding_hidden(data_dir, vocab):
    task, model, _ = build(data_dir, "--block-size", "4", seed=1, dtype=torch.float64)
    decoder = model.decoder
    features = torch.randn(3, 2, decoder.output_embed_dim, dtype=torch.float64)
    with torch.inference_mode():
        got = decoding_logits(decoder, features, vocab)
    want = decoder.output_layer(features)
    want = want[..., :vocab] if vocab else want
    want[..., task.target_dictionary.pad()] = -math.inf
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # decoding sees a weight changed in place
        decoder.output_projection.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(decoding_logits(decoder, features, vocab)[..., 3:], 2 * want[..., 3:])


@pytest.mark.parametrize("confidence", [0.0, 0.2])
def test_a_hydra_tree_runs_no_chain_of_proposals(data_dir, confidence):
    """Chained heads under a tree propose every node after its own parent (nodes()), so the
    chain propose() would make is not made, unless --blockwise-confidence reads its log-probs;
    the output is greedy's either way."""
    from conftest import random_sample
    from test_chained import chained
    from test_generator import assert_same, blockwise, greedy

    task, model, _ = chained(data_dir, 4, seed=5)
    sample = random_sample(task, bsz=3, seed=5)
    expected = greedy(model, task, sample, max_len_b=12)
    heads, calls = model.decoder.heads, []
    propose = heads.propose
    heads.propose = lambda *args, **kwargs: calls.append(1) or propose(*args, **kwargs)
    hypos, _ = blockwise(model, task, sample, 4, tree=8, max_len_b=12, confidence=confidence)
    del heads.propose
    assert_same(expected, hypos)
    assert bool(calls) == (confidence > 0)


def test_greedy_choice_in_half_precision_is_topks_first():
    """Indices past 2048 are not exact in float16: topk there, whatever the rows."""
    scores = torch.randn(2, 8, 5000).half()
    scores[:, :, 4999] = 10.0  # the best token's index has no float16 of its own
    assert torch.equal(greedy_choice(scores, 1)[1], topk_first(scores)[1])


@pytest.mark.parametrize("static", [True, False])
def test_a_chain_at_one_position_for_all_rows_is_the_per_row_positions(data_dir, static):
    """forward_block given a chain's first position as an int (every row's cache equally
    long) computes what the b x n positions compute."""
    from conftest import random_sample

    task, model, _ = build(data_dir, "--block-size", "4", seed=2, dtype=torch.float64)
    decoder = model.decoder
    decoder.static_cache = static
    encoder_out = model.encoder.forward_torchscript(random_sample(task, bsz=2, seed=2)["net_input"])
    first = torch.full((2, 1), task.target_dictionary.eos())
    block = torch.randint(4, 20, (2, 3), generator=torch.Generator().manual_seed(0))
    features = []
    with torch.inference_mode():
        for positions in (lambda p: p, lambda p: torch.full((2, 1), p) + torch.arange(block.size(1) if p else 1)):
            state, one = {}, torch.ones(2, dtype=torch.long)
            decoder.forward_block(first, positions(0), encoder_out, state)
            decoder.crop_cache(state, 0 * one, 1, 0 * one[:, None], one)
            assert decoder.cached_length(state) == 1
            features.append(decoder.forward_block(block, positions(1), encoder_out, state)[0])
    decoder.static_cache = True
    torch.testing.assert_close(features[0], features[1], rtol=0, atol=0)


def test_cached_length_is_known_only_where_all_rows_are_alike(data_dir):
    """The static cache knows its rows' common length after a crop that keeps as many
    entries in each, and not after one that keeps different counts."""
    from conftest import random_sample

    task, model, _ = build(data_dir, "--block-size", "4", seed=3, dtype=torch.float64)
    decoder = model.decoder
    encoder_out = model.encoder.forward_torchscript(random_sample(task, bsz=2, seed=3)["net_input"])
    state, cached = {}, torch.zeros(2, dtype=torch.long)
    with torch.inference_mode():
        assert decoder.cached_length(state) == 0
        decoder.forward_block(torch.full((2, 1), task.target_dictionary.eos()), 0, encoder_out, state)
        cached = decoder.crop_cache(state, cached, 1, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
        assert decoder.cached_length(state) == 1
        block = torch.randint(4, 20, (2, 3))
        decoder.forward_block(block, 1, encoder_out, state)
        path = torch.arange(3).expand(2, -1)
        cached = decoder.crop_cache(state, cached, 3, path, torch.tensor([3, 3]))
        assert decoder.cached_length(state) == 4
        decoder.forward_block(block, 4, encoder_out, state)
        decoder.crop_cache(state, cached, 3, path, torch.tensor([1, 2]))
        assert decoder.cached_length(state) is None


class Operations(torch.utils._python_dispatch.TorchDispatchMode):
    """The tensor operations run inside it, by name, and the host waits among them."""

    WAITS = ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default")

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))

    def waits(self):
        return sum(name in self.WAITS for name in self.names)


def test_a_block_of_one_at_batch_one_indexes_no_rows_and_waits_twice(data_dir):
    """Width 1 at batch 1 on the static cache: one output each invocation at a column known
    on the host, so no invocation gathers, scatters or indexes per row; the host waits
    for the NaN check and for the finished check only; the output is greedy's."""
    from conftest import random_sample
    from test_generator import assert_same, blockwise, greedy

    task, model, _ = build(data_dir, "--block-size", "4", seed=4)
    sample = random_sample(task, bsz=1, seed=4)
    expected = greedy(model, task, sample, max_len_b=12)
    decoder, seen = model.decoder, []
    forward_block = decoder.forward_block

    def counted(*args, **kwargs):  # the operations from one decoder pass to the next
        if seen:
            seen[-1].__exit__(None, None, None)
        out = forward_block(*args, **kwargs)
        seen.append(Operations())
        seen[-1].__enter__()
        return out

    decoder.forward_block = counted
    try:
        hypos, generator = blockwise(model, task, sample, 1, max_len_b=12)
    finally:
        if seen:
            seen[-1].__exit__(None, None, None)
        del decoder.forward_block
    assert_same(expected, hypos)
    invocations = seen[1:-1]  # between passes, the bookkeeping: neither the first nor the last
    assert len(invocations) >= 3
    for ops in invocations:
        assert not [n for n in ops.names if n.split(".")[1] in ("gather", "scatter_", "index", "index_select",
                                                                  "nonzero")], ops.names
        assert ops.waits() == 2, ops.names
