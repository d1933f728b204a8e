"""Proposals on weights arranged once per change (ChainWeights, HeadWeights): the same function
as the heads' modules, in few operations, and no log-softmax where no one reads log-probs."""
import collections

import pytest
import torch

from conftest import build, random_sample
from test_chained import chained
from test_draft import draft
from test_generator import assert_same, blockwise, greedy
from test_lean_iteration import Operations

from fairseq_bpd.heads import decoding_logits
from fairseq_bpd.heads_step import ChainWeights, HeadWeights


def random_inputs(model, bsz=5, seed=0):
    """Features b x C (scaled up, so that proposals differ between heads), head 1's tokens b,
    and an encoder output whose tensor tells the heads a batch."""
    g = torch.Generator().manual_seed(seed)
    decoder = model.decoder
    features = 3 * torch.randn(bsz, decoder.output_embed_dim, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, len(decoder.dictionary), (bsz,), generator=g)
    return features, tokens, {"encoder_out": [torch.zeros(2, bsz, 1, dtype=torch.float64)]}


def module_chain(heads, features, token, width, vocab, topn):
    """Chained proposals by link() and decoding_logits(): tokens and log-probs b x width-1 x topn."""
    tokens, lprobs = [], []
    for i in range(width - 1):
        features = heads.link(i, features, token)
        values, best = decoding_logits(heads.decoder, features, vocab).log_softmax(dim=-1).topk(topn, dim=-1)
        tokens.append(best)
        lprobs.append(values)
        token = best[:, 0]
    return torch.stack(tokens, dim=1), torch.stack(lprobs, dim=1)


# The links' hidden width below the features' (with relu: a later head's logits through W2 P)
# and above.
HIDDEN = {"narrow": ("--head-ffn-dim", "8"), "wide": (), "narrow-gelu": ("--head-ffn-dim", "8", "--activation-fn", "gelu")}


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("vocab", [0, 9])
@pytest.mark.parametrize("topn", [1, 2])
def test_chained_proposals_are_the_modules(data_dir, hidden, vocab, topn):
    _, model, _ = chained(data_dir, 5, *HIDDEN[hidden], seed=3)
    heads = model.decoder.heads
    for fc in (*heads.fc_in, *heads.fc_out):  # nonzero biases: the carried sums are read
        fc.bias.data.normal_(0, 0.5)
    features, token, encoder_out = random_inputs(model)
    with torch.no_grad():
        weights = heads.decoding_weights(vocab, encoder_out)
        assert isinstance(weights, ChainWeights)
        assert all((link[-1] is None) == (i == 0 or hidden != "narrow") for i, link in enumerate(weights.links))
        for width in range(2, 6):
            want, want_lprobs = module_chain(heads, features, token, width, vocab, topn)
            got, lprobs = heads.propose(features, token, width, vocab, topn, encoder_out)
            assert got.tolist() == want.tolist()
            torch.testing.assert_close(lprobs, want_lprobs, rtol=0, atol=1e-10)
            alone, none = heads.propose(features, token, width, vocab, topn, encoder_out, log_probs=False)
            assert none is None and alone.tolist() == want.tolist()
    assert len(set(want[:, :, 0].flatten().tolist())) > 3  # the test is not about one token


@pytest.mark.parametrize("layout", ["base", "paper"])
@pytest.mark.parametrize("vocab", [0, 9])
def test_independent_proposals_are_the_modules(data_dir, layout, vocab):
    _, model, _ = build(data_dir, "--block-size", "4", "--head-layout", layout, seed=2)
    heads = model.decoder.heads
    heads.fc1.bias.data.normal_(0, 0.5)
    heads.fc2.bias.data.normal_(0, 0.5)
    features, token, encoder_out = random_inputs(model, seed=1)
    with torch.no_grad():
        assert isinstance(heads.decoding_weights(vocab, encoder_out), HeadWeights)
        for width in range(1, 5):
            want = decoding_logits(model.decoder, heads.block_features(features, width)[:, 1:], vocab)
            torch.testing.assert_close(heads.logits(features, token, width, vocab, encoder_out), want,
                                       rtol=0, atol=1e-10)
            lprobs, tokens = want.log_softmax(dim=-1).topk(2, dim=-1)
            got, got_lprobs = heads.propose(features, token, width, vocab, 2, encoder_out)
            assert got.tolist() == tokens.tolist()
            torch.testing.assert_close(got_lprobs, lprobs, rtol=0, atol=1e-10)
            best, none = heads.propose(features, token, width, vocab, 1, encoder_out, log_probs=False)
            assert none is None and best.tolist() == tokens[..., :1].tolist()


def test_draft_proposals_without_log_probs_are_the_same_tokens(data_dir):
    task, model, _ = draft(data_dir, 4, seed=1)
    heads = model.decoder.heads
    sample = random_sample(task, bsz=3, seed=1)
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    features, token, _ = random_inputs(model, bsz=3)
    with torch.no_grad():
        heads.state = None
        tokens, lprobs = heads.propose(features, token, 4, 9, 1, encoder_out)
        heads.state = None
        alone, none = heads.propose(features, token, 4, 9, 1, encoder_out, log_probs=False)
    assert none is None and alone.tolist() == tokens.tolist()
    assert lprobs.shape == (3, 3, 1) and (lprobs < 0).all()


def chained_ops(heads, features, token, width, vocab, encoder_out, log_probs):
    with Operations() as operations, torch.no_grad():
        heads.propose(features, token, width, vocab, 1, encoder_out, log_probs=log_probs)
    return collections.Counter(operations.names)


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
def test_a_link_is_a_lookup_three_products_and_a_choice(data_dir, hidden):
    """Per link: index_select, addmm, the activation, two addmms (the last narrow link one)
    and argmax; the chain's stack; log-probs one log-softmax for all heads."""
    _, model, _ = chained(data_dir, 8, *HIDDEN[hidden])
    heads, links = model.decoder.heads, 7
    features, token, encoder_out = random_inputs(model, bsz=1)
    heads.propose(features, token, 8, 9, 1, encoder_out)  # arranged, and checked for this batch
    counts = chained_ops(heads, features, token, 8, 9, encoder_out, log_probs=False)
    through = hidden == "narrow"
    activation = "aten.gelu.default" if "gelu" in hidden else "aten.relu_.default"
    assert counts["aten.index_select.default"] == counts[activation] == counts["aten.argmax.default"] == links
    assert counts["aten.addmm.default"] == 3 * links - through
    assert "aten._log_softmax.default" not in counts
    casts = counts["aten._to_copy.default"]  # fairseq's gelu computes in float32 and casts back
    assert sum(counts.values()) - casts == 6 * links - through + 2  # + stack, unsqueeze
    counts = chained_ops(heads, features, token, 8, 9, encoder_out, log_probs=True)
    assert counts["aten._log_softmax.default"] == 1


def test_arranged_weights_follow_changes_hooks_and_training(data_dir):
    _, model, _ = chained(data_dir, 4, seed=5)
    heads = model.decoder.heads
    features, token, encoder_out = random_inputs(model, seed=2)
    with torch.no_grad():
        first = heads.decoding_weights(0, encoder_out)
        assert heads.decoding_weights(0, encoder_out) is first  # the same batch: no check
        assert heads.decoding_weights(9, encoder_out) is not first  # another shortlist
        heads.fc_in[1].weight.mul_(-2.0)  # in place, between batches
        _, token, next_batch = random_inputs(model, seed=3)
        assert heads.decoding_weights(0, next_batch) is not first
        want = module_chain(heads, features, token, 4, 0, 1)[0]
        assert heads.propose(features, token, 4, 0, 1, next_batch)[0].tolist() == want.tolist()

        calls = []
        handle = heads.fc_out[0].register_forward_hook(lambda *args: calls.append(1))
        _, _, hooked_batch = random_inputs(model, seed=4)
        assert heads.decoding_weights(0, hooked_batch) is None
        heads.propose(features, token, 4, 0, 1, hooked_batch)
        assert calls == [1]  # link() ran the hooked module
        handle.remove()
    model.train()
    assert heads.decoding_weights(0, hooked_batch) is None and heads._weights is None
    model.eval()
    assert isinstance(heads.decoding_weights(0, hooked_batch), ChainWeights)


def test_training_runs_the_modules(data_dir):
    """model.train(): the criterion's path through block_features and link() has gradients
    into every head's parameters, and propose() runs the modules (dropout 0 here)."""
    task, model, _ = chained(data_dir, 3, "--head-ffn-dim", "8")
    heads = model.decoder.heads
    model.train()
    features, token, encoder_out = random_inputs(model, seed=6)
    assert heads.decoding_weights(0, encoder_out) is None
    want = module_chain(heads, features, token, 3, 0, 1)[0]
    assert heads.propose(features, token, 3, 0, 1, encoder_out)[0].tolist() == want.tolist()
    inputs = torch.randint(4, len(task.target_dictionary), (2, 5))
    block = heads.block_features(3 * torch.randn(2, 5, 16, dtype=torch.float64), inputs=inputs)  # B x T x 3 x C
    block[:, :, 1:].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("bsz", [1, 6])
def test_lean_chained_proposals_give_greedy_output(data_dir, hidden, bsz):
    task, model, _ = chained(data_dir, 5, *HIDDEN[hidden], seed=4)
    sample = random_sample(task, bsz=bsz, seed=bsz)
    expected = greedy(model, task, sample)
    assert_same(expected, blockwise(model, task, sample, 5)[0])
    assert_same(expected, blockwise(model, task, sample, 5, proposal_vocab=9)[0])
    assert_same(expected, blockwise(model, task, sample, 5, confidence=0.2)[0])

