"""The proposal heads' products on weights packed once (heads_step: product.Product, Plus):
within float32 rounding of the heads' modules where they run packed, bit for bit the
arranged weights' addmms in float64 and at batch 1, and decoding still fairseq's greedy.
The compiled kernels are off here (libraries_only): at a few rows their product would
serve instead of oneDNN's."""
import collections

import pytest
import torch

from conftest import build, random_sample
from test_chained import chained
from test_generator import assert_same, blockwise, greedy
from test_lean_iteration import Operations

from fairseq_bpd import heads_step, kernels, product
from fairseq_bpd.heads import decoding_logits
from fairseq_bpd.heads_step import ChainWeights, HeadWeights
from fairseq_bpd.product import packing_applies

PACKED = "mkldnn._linear_pointwise.default"
# The links' hidden width below the features' (relu: a later head's logits through W2 P) and above.
HIDDEN = {"narrow": ("--head-ffn-dim", "8"), "wide": ()}


@pytest.fixture(autouse=True)
def libraries_only(monkeypatch):
    monkeypatch.setenv(kernels.VARIABLE, "0")


def pack_everywhere(monkeypatch):
    """Every product packed at any number of rows: the tiny models' weights are far below
    the sizes from which decoding packs them."""
    monkeypatch.setattr(product, "ONE_ROW_PACKED_SIZE", 1)
    monkeypatch.setattr(heads_step, "ONE_ROW_PACKED_SIZE", 1)


@pytest.fixture
def packed_everywhere(monkeypatch):
    pack_everywhere(monkeypatch)


def chained_model(data_dir, hidden, dtype):
    task, model, _ = chained(data_dir, 5, *HIDDEN[hidden], seed=3, dtype=dtype)
    for fc in (*model.decoder.heads.fc_in, *model.decoder.heads.fc_out):  # biases carried from link to link
        fc.bias.data.normal_(0, 0.5)
    return task, model


def independent_model(data_dir, layout, dtype):
    task, model, _ = build(data_dir, "--block-size", "5", "--head-layout", layout, seed=2, dtype=dtype)
    model.decoder.heads.fc1.bias.data.normal_(0, 0.5)
    model.decoder.heads.fc2.bias.data.normal_(0, 0.5)
    return task, model


def inputs(model, bsz, seed=0):
    """Features b x C (scaled up, so that heads differ), head 1's tokens b and an encoder
    output whose tensor tells the heads a batch."""
    g = torch.Generator().manual_seed(seed)
    decoder, dtype = model.decoder, model.decoder.output_projection.weight.dtype
    features = 3 * torch.randn(bsz, decoder.output_embed_dim, generator=g).to(dtype)
    tokens = torch.randint(4, len(decoder.dictionary), (bsz,), generator=g)
    return features, tokens, {"encoder_out": [torch.zeros(2, bsz, 1, dtype=dtype)]}


def lean_chain(weights, features, tokens, width):
    """ChainWeights' links after features b x C, each reading the best token before:
    logits b x width-1 x N."""
    logits = []
    for i in range(width - 1):
        features, scores = weights.link(i, features, tokens, logits[-1] if logits else None, i == width - 2)
        tokens = scores.argmax(dim=-1)
        logits.append(scores)
    return torch.stack(logits, dim=1)


def module_chain(heads, features, tokens, chosen, vocab):
    """The same by the modules (link(), decoding_logits()), each link reading the token the
    lean chain chose (b x width-1 x N: its logits), so that a near tie it breaks otherwise
    does not part the chains."""
    logits = []
    for i in range(chosen.size(1)):
        features = heads.link(i, features, chosen[:, i - 1].argmax(dim=-1) if i else tokens)
        logits.append(decoding_logits(heads.decoder, features, vocab))
    return torch.stack(logits, dim=1)


def addmm_link(weights, i, g, tokens, logits, last):
    """ChainWeights.link as raw addmms on the arranged weights (the code before Products)."""
    features_in, table, out, bias, ahead = weights.links[i]
    hidden = weights.activation(torch.addmm(table.index_select(0, tokens), g, features_in.weight))
    if ahead is None:
        g = torch.addmm(g, hidden, out.weight)
        return g, torch.addmm(bias, g, weights.projection.weight)
    return None if last else torch.addmm(g, hidden, out.weight), torch.addmm(logits, hidden, ahead.weight)


def addmm_heads(weights, features, width):
    """HeadWeights.logits as raw addmms on fc2's strided slice (the code before Products)."""
    (b, channels), proposals = features.shape, width - 1
    rows = slice(weights.first * channels, (weights.first + proposals) * channels)
    fc1, fc2, projection = weights.fc1, weights.fc2, weights.projection
    hidden = weights.activation(torch.addmm(fc1[1], features, fc1[0]))
    heads = torch.addmm(fc2[1][rows], hidden, fc2[0][:, rows]).view(b, proposals, channels)
    heads = (heads + features[:, None]).view(b * proposals, channels)
    return torch.addmm(projection[1], heads, projection[0]).view(b, proposals, -1)


def counted(function, *args):
    with Operations() as operations, torch.no_grad():
        result = function(*args)
    return result, collections.Counter(operations.names)


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("bsz", [1, 3, 32])
@pytest.mark.parametrize("vocab", [0, 9])
def test_packed_links_are_the_modules_to_float32_rounding(data_dir, packed_everywhere, hidden, bsz, vocab):
    _, model = chained_model(data_dir, hidden, torch.float32)
    heads = model.decoder.heads
    features, tokens, encoder_out = inputs(model, bsz)
    with torch.no_grad():
        weights = heads.decoding_weights(vocab, encoder_out)
        assert isinstance(weights, ChainWeights)
        got, counts = counted(lean_chain, weights, features, tokens, 5)
        want = module_chain(heads, features, tokens, got, vocab)
    products = 3 * 4 - (hidden == "narrow")  # the last narrow link makes no g
    assert counts[PACKED] == (products if packing_applies(weights.projection.weight) else 0)
    assert counts[PACKED] + counts["aten.addmm.default"] == products
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())  # padding's -inf
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    assert got[finite].std() > 1  # not near zero: the tolerance bites


@pytest.mark.parametrize("layout", ["base", "paper"])
@pytest.mark.parametrize("bsz", [1, 3, 32])
@pytest.mark.parametrize("vocab", [0, 9])
def test_packed_independent_heads_are_the_modules_to_float32_rounding(data_dir, packed_everywhere, layout, bsz, vocab):
    _, model = independent_model(data_dir, layout, torch.float32)
    heads = model.decoder.heads
    features, token, encoder_out = inputs(model, bsz, seed=1)
    with torch.no_grad():
        weights = heads.decoding_weights(vocab, encoder_out)
        assert isinstance(weights, HeadWeights)
        for width in (2, 5, 3):  # a slice of fc2 for each width, made as it comes
            got, counts = counted(heads.logits, features, token, width, vocab, encoder_out)
            assert counts[PACKED] == (3 if packing_applies(weights.projection[0]) else 0)
            want = decoding_logits(model.decoder, heads.block_features(features, width)[:, 1:], vocab)
            finite = want.isfinite()
            assert torch.equal(finite, got.isfinite())
            torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)
        assert sorted(weights.slices) == [1, 2, 4]


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("bsz", [1, 3, 32])
def test_packed_tree_depths_are_the_modules_to_float32_rounding(data_dir, packed_everywhere, hidden, bsz):
    """link_parents (ChainedHeads.nodes' depth over its parents): each child's logits are the
    module's link on its own parent's row."""
    _, model = chained_model(data_dir, hidden, torch.float32)
    heads = model.decoder.heads
    features, token, encoder_out = inputs(model, bsz, seed=2)
    with torch.no_grad():
        weights = heads.decoding_weights(0, encoder_out)
        root_g, root_logits = weights.link_parents(0, features[:, None], None, torch.tensor([0, 0]),
                                                   torch.stack([token, token.flip(0)], dim=1), False)
        best = root_logits.topk(2, dim=-1)[1]  # b x 2 x 2
        sources = torch.tensor([0, 0, 1])  # the children: parent 0's two best, parent 1's best
        parents = torch.stack([best[:, 0, 0], best[:, 0, 1], best[:, 1, 0]], dim=1)  # b x 3
        _, logits = weights.link_parents(1, root_g, root_logits, sources, parents, True)
        g = heads.link(0, features[:, None].expand(-1, 2, -1), torch.stack([token, token.flip(0)], dim=1))
        want = decoding_logits(model.decoder, heads.link(1, g[:, sources], parents), 0)  # b x 3 x N
    finite = want.isfinite()
    assert logits.shape == want.shape and torch.equal(finite, logits.isfinite())
    torch.testing.assert_close(logits[finite], want[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("dtype, bsz, everywhere", [(torch.float64, 1, True), (torch.float64, 3, True),
                                                    (torch.float64, 32, True), (torch.float32, 1, False)])
def test_links_on_addmm_are_the_addmms_bit_for_bit(data_dir, monkeypatch, hidden, dtype, bsz, everywhere):
    """In float64 at any rows (packing never applies), and at batch 1 in float32 where the
    links' weights are below the sizes decoding packs from (one row by a small weight is
    MKL's matrix-vector product), the chain is the arranged weights' addmms."""
    if everywhere:
        pack_everywhere(monkeypatch)
    _, model = chained_model(data_dir, hidden, dtype)
    features, tokens, encoder_out = inputs(model, bsz)
    with torch.no_grad():
        weights = model.decoder.heads.decoding_weights(9, encoder_out)
        got, counts = counted(lean_chain, weights, features, tokens, 5)
        logits, g = [], features
        for i in range(4):
            g, scores = addmm_link(weights, i, g, got[:, i - 1].argmax(-1) if i else tokens,
                                   logits[-1] if logits else None, i == 3)
            logits.append(scores)
    assert counts[PACKED] == 0 and torch.equal(got, torch.stack(logits, dim=1))


@pytest.mark.parametrize("layout", ["base", "paper"])
@pytest.mark.parametrize("bsz", [1, 3, 32])
def test_float64_independent_heads_are_the_addmms_bit_for_bit(data_dir, packed_everywhere, layout, bsz):
    _, model = independent_model(data_dir, layout, torch.float64)
    heads = model.decoder.heads
    features, token, encoder_out = inputs(model, bsz, seed=1)
    with torch.no_grad():
        weights = heads.decoding_weights(9, encoder_out)
        for width in (2, 4, 5):
            got, counts = counted(heads.logits, features, token, width, 9, encoder_out)
            assert counts[PACKED] == 0 and torch.equal(got, addmm_heads(weights, features, width))


def test_a_small_weight_packs_from_many_rows_a_large_one_from_few():
    """Plus's add is one more operation: packed where rows x W's entries reach
    ONE_ROW_PACKED_SIZE (the shipped links' 256 x 129 from 32 rows, a 256 x 2000 shortlist from 3)."""
    small, large = heads_step.Plus(torch.randn(256, 129)), heads_step.Plus(torch.randn(256, 2000))
    if packing_applies(small.weight):
        assert (small.rows, large.rows) == (32, 3)
    for plus in (small, large):
        for rows in (1, plus.rows - 1, plus.rows, 40):
            x, addend = torch.randn(rows, plus.weight.size(0)), torch.randn(rows, plus.weight.size(1))
            got, counts = counted(plus, x, addend)
            assert counts[PACKED] == (rows >= plus.rows)
            torch.testing.assert_close(got, torch.addmm(addend, x, plus.weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hidden", sorted(HIDDEN))
@pytest.mark.parametrize("bsz", [1, 6])
def test_packed_chained_decoding_is_greedy(data_dir, packed_everywhere, hidden, bsz):
    task, model = chained_model(data_dir, hidden, torch.float32)
    sample = random_sample(task, bsz=bsz, seed=bsz)
    expected = greedy(model, task, sample)
    assert_same(expected, blockwise(model, task, sample, 5)[0])
    assert_same(expected, blockwise(model, task, sample, 5, proposal_vocab=9)[0])
    assert_same(expected, blockwise(model, task, sample, 5, tree=8)[0])
    weights = model.decoder.heads._weights
    assert weights.projection.rows == 1 and (weights.projection.product.packed is not None) == packing_applies(
        weights.projection.weight)


@pytest.mark.parametrize("bsz", [1, 6])
def test_packed_independent_decoding_is_greedy(data_dir, packed_everywhere, bsz):
    task, model = independent_model(data_dir, "base", torch.float32)
    sample = random_sample(task, bsz=bsz, seed=bsz)
    expected = greedy(model, task, sample)
    assert_same(expected, blockwise(model, task, sample, 5)[0])
    assert_same(expected, blockwise(model, task, sample, 5, proposal_vocab=9)[0])
    assert isinstance(model.decoder.heads._weights, HeadWeights)
