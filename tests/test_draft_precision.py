"""The draft's products on int8 weights (product.Int8Product) in a float32 model on a CPU:
its proposals change a little, decoding's output not at all (verification is head 1's)."""
import pytest
import torch

from conftest import random_sample
from test_draft import draft
from test_generator import blockwise, greedy

from fairseq_bpd import kernels
from fairseq_bpd.draft_step import reduced_feed_forward
from fairseq_bpd.product import INT8_MOST_ROWS, REDUCED_VARIABLE, Int8Product, Product, reducible


def reduced_model(data_dir, k, seed):
    task, model, args = draft(data_dir, k, seed=seed, dtype=torch.float32)
    return task, model.eval()


def assert_tokens_greedy(model, task, sample, k, **options):
    """Blockwise decoding's tokens are greedy's, on the draft's reduced weights (asserted
    before greedy's SequenceGenerator calls model.eval(), which drops them)."""
    hypos, _ = blockwise(model, task, sample, k, **options)
    heads = model.decoder.heads
    weights = heads.weights()
    assert weights.reduced and isinstance(weights.qkv, Int8Product) and isinstance(weights.ffn2, Int8Product)
    assert isinstance(heads._reduced_projection[1], Int8Product)  # the shortlist's too
    assert [h[0]["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in greedy(model, task, sample)]


def test_the_kernel_is_here():
    """The machines these tests run on reduce: the tests below would otherwise test float32."""
    assert reducible(torch.zeros(16, 8))
    assert not reducible(torch.zeros(16, 8, dtype=torch.float64)) and not reducible(torch.zeros(24, 8))


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("seed", range(2))
def test_reduced_draft_decodes_exactly_greedy(data_dir, bsz, k, seed):
    task, model = reduced_model(data_dir, k, seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    with torch.no_grad():
        assert_tokens_greedy(model, task, sample, k)


@pytest.mark.parametrize("seed", range(2))
def test_reduced_tree_decodes_exactly_greedy(data_dir, seed):
    task, model = reduced_model(data_dir, 4, seed)
    sample = random_sample(task, bsz=2, seed=seed)
    with torch.no_grad():
        assert_tokens_greedy(model, task, sample, 4, tree=8)


def proposal_lprobs(model, task, seed):
    """The log-probs of a k=8 chain's proposals on one sentence, from a fresh state."""
    heads = model.decoder.heads
    sample = random_sample(task, bsz=1, seed=seed)
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    features = 3 * torch.randn(1, 16, generator=torch.Generator().manual_seed(seed))
    heads.state = None
    with torch.no_grad():
        return heads.propose(features, torch.tensor([5]), 8, 0, 1, encoder_out)


def test_reduced_proposals_differ_from_float32_and_stay_close(data_dir, monkeypatch):
    """$FAIRSEQ_BPD_REDUCED=0 (read when arranged: model.eval()) keeps the float32 step."""
    task, model = reduced_model(data_dir, 8, 1)
    reduced = proposal_lprobs(model, task, 1)[1]
    monkeypatch.setenv(REDUCED_VARIABLE, "0")
    model.eval()
    assert not model.decoder.heads.weights().reduced
    exact = proposal_lprobs(model, task, 1)[1]
    assert not torch.equal(reduced, exact)
    assert torch.allclose(reduced, exact, atol=0.1)


def test_an_int8_product_is_close_and_falls_back():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(32, 40, generator=g), torch.randn(40, generator=g)
    product = Int8Product(weight, bias)
    x = torch.randn(INT8_MOST_ROWS, 32, generator=g)
    y = product(x)
    assert y.dtype == torch.float32 and not torch.equal(y, torch.addmm(bias, x, weight))
    assert torch.allclose(y, torch.addmm(bias, x, weight), rtol=0.03, atol=0.1)
    more = torch.randn(INT8_MOST_ROWS + 1, 32, generator=g)  # the float32 Product's, bit for bit
    assert torch.equal(product(more), Product(weight, bias)(more))
    wide = product.full[0].double(), bias.double()
    assert torch.equal(Int8Product(*wide)(x.double()), torch.addmm(wide[1], x.double(), wide[0]))
    out = torch.empty(INT8_MOST_ROWS, 40)
    assert product(x, out=out) is out and torch.equal(out, y)
    assert Int8Product(weight, None)(x).dtype == torch.float32  # the compiled kernel's
    with pytest.raises(ValueError, match="multiples of 16"):
        Int8Product(torch.randn(24, 8), None)


def test_torchs_int8_kernel_serves_without_the_compiled_one(monkeypatch):
    """$FAIRSEQ_BPD_KERNELS=0: torch's weight-only kernel (x in bf16; bf16 out where no bias)."""
    monkeypatch.setenv(kernels.VARIABLE, "0")
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(32, 40, generator=g), torch.randn(40, generator=g)
    x, add = torch.randn(3, 32, generator=g), torch.randn(3, 40, generator=g)
    exact = torch.addmm(bias, x, weight)
    assert Int8Product(weight, None)(x).dtype == torch.bfloat16  # summed into float32 by the step
    y = Int8Product(weight, bias)(x, add=add, relu=True)
    assert y.dtype == torch.float32 and torch.allclose(y, torch.relu(exact + add), rtol=0.03, atol=0.1)


def test_the_reduced_feed_forward_pads_its_hidden_units():
    """A hidden width the kernel cannot take (25, with relu's bias unit) padded to 32 by units
    that add nothing."""
    g = torch.Generator().manual_seed(1)
    w1, b1, w2 = torch.randn(16, 25, generator=g), torch.randn(25, generator=g), torch.randn(25, 16, generator=g)
    ffn1, ffn2 = reduced_feed_forward((w1, b1), (w2, None))
    assert ffn1[0].shape == (16, 32) and ffn2[0].shape == (32, 16)
    x = torch.randn(2, 16, generator=g)
    exact = torch.relu(x @ w1 + b1) @ w2
    assert torch.allclose(ffn2(torch.relu(ffn1(x))).float(), exact, rtol=0.05, atol=0.2)
