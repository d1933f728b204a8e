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
