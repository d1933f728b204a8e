"""The draft's compiled int8 products and its compiled batch-1 step (csrc/few_rows.cpp,
csrc/draft_step.cpp): the products are the int8 weights' products, the step is the Python
step's function on the same weights, and decoding with them gives greedy's tokens."""
import copy
import math
import pickle

import pytest
import torch

from conftest import random_sample
from test_draft_precision import proposal_lprobs, reduced_model
from test_generator import blockwise, greedy

from fairseq_bpd import draft_step, kernels
from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd import product as product_module
from fairseq_bpd.product import INT8_MOST_ROWS, Int8Product


@pytest.fixture
def kern():
    module = kernels.module()
    assert module is not None  # they build on this machine (and CI's): a fallback would hide a failure
    return module


def quantized_rows(x):
    """x M x C float32 rounded as the int8 kernel rounds its rows on VNNI: each row times
    127 / its largest magnitude (float32), to the nearest integer; and the scale back,
    largest / 127. Rows too small for that factor to be finite are zeros, scale 0."""
    largest = x.abs().amax(1, keepdim=True)
    factor = torch.tensor(127.0) / largest
    ok = torch.isfinite(factor)
    q = torch.where(ok, (x * factor).round().clamp(-127, 127), torch.zeros_like(x))
    return q, torch.where(ok, largest / 127.0, torch.zeros_like(largest))


def int8_reference(product, x):
    """x' · W' (+ bias) in float64, W' the int8 weights times their scales and x' the rows
    (rounded to int8 times theirs where the kernel runs on VNNI): what the kernel computes,
    its sums exact or in float32."""
    if kernels.module().int8_channel_group() == 4:
        q, row_scale = quantized_rows(x.float())
        y = (q.double() @ product.quantized.double().t()) * product.scales32.double() * row_scale.double()
    else:
        y = x.double() @ (product.quantized.double().t() * product.scales32.double())
    return y if product[1] is None else y + product[1].double()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(16, 40), (32, 64), (48, 130), (256, 2000)])
def test_an_int8_product_is_the_int8_weights_product(kern, rows, shape):
    """Any row count (four at a time), outputs past the last whole block of 64, rows at a
    stride, a residual added in place, relu; both sides of the split between threads."""
    channels, outputs = shape
    g = torch.Generator().manual_seed(rows * outputs)
    weight, bias = torch.randn(channels, outputs, generator=g), torch.randn(outputs, generator=g)
    product = Int8Product(weight, bias)
    wide = torch.randn(rows, channels + 8, generator=g)
    x, add = wide[:, 3 : 3 + channels], torch.randn(rows, outputs, generator=g)  # x's rows at a stride
    expected = int8_reference(product, x)
    y = kern.int8_product(x, product.packed, product.scales32, bias)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)
    out = add.clone()
    summed = kern.int8_product(x, product.packed, product.scales32, bias, out, True, out)
    assert summed.data_ptr() == out.data_ptr()
    assert torch.allclose(out.double(), torch.relu(expected + add.double()), rtol=1e-5, atol=1e-4)
    bare = Int8Product(weight, None)
    assert torch.allclose(kern.int8_product(x, bare.packed, bare.scales32).double(), int8_reference(bare, x),
                          rtol=1e-5, atol=1e-4)


def test_an_int8_products_rows_of_zeros_tiny_values_and_nans(kern):
    """A row of zeros gives the bias; a row too small to scale to 127 gives the bias too
    where its rows are rounded (and near it elsewhere); a NaN or an infinity makes each of
    its own row's outputs NaN or infinite, and no other row's."""
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(64, 70, generator=g), torch.randn(70, generator=g)
    product = Int8Product(weight, bias)
    x = torch.randn(5, 64, generator=g)
    x[0] = 0
    x[1] = torch.randn(64, generator=g) * 1e-38  # 127 / its largest is infinite
    x[2, 7] = float("nan")
    x[3, 9] = float("inf")
    y = kern.int8_product(x, product.packed, product.scales32, bias)
    assert torch.equal(y[0], bias)
    assert torch.allclose(y[1], bias, atol=1e-30)
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[3]).any()
    assert torch.allclose(y[4].double(), int8_reference(product, x[4:]).squeeze(0), rtol=1e-5, atol=1e-4)


def test_an_int8_product_refuses_what_it_would_misread(kern):
    product = Int8Product(torch.randn(32, 40), torch.randn(40))
    packed, scales, x = product.packed, product.scales32, torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="float32"):
        kern.int8_product(x.double(), packed, scales)
    with pytest.raises(RuntimeError, match="packed weights"):
        kern.int8_product(torch.randn(2, 16), packed, scales)
    with pytest.raises(RuntimeError, match="packed weights"):
        kern.int8_product(x, packed, torch.randn(100))
    with pytest.raises(RuntimeError, match="bias"):
        kern.int8_product(x, packed, scales, torch.randn(39))
    with pytest.raises(RuntimeError, match="add"):
        kern.int8_product(x, packed, scales, None, torch.randn(3, 40))
    with pytest.raises(RuntimeError, match="out"):
        kern.int8_product(x, packed, scales, None, None, False, torch.randn(2, 41))


@pytest.mark.parametrize("dtype,rows", [(torch.float64, 3), (torch.bfloat16, INT8_MOST_ROWS + 1)])
def test_rows_neither_kernel_takes_run_the_float_product_in_the_weights_dtype(dtype, rows):
    weight, bias = torch.randn(32, 40), torch.randn(40)
    x = torch.randn(rows, 32).to(dtype)
    y = Int8Product(weight, bias)(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y, torch.addmm(bias, x.float(), weight), rtol=1e-5, atol=1e-5)


def test_a_later_step_is_one_compiled_call_close_to_the_python_steps(data_dir, monkeypatch):
    """A k=8 chain from a fresh state (a first step, six later steps): each step one call
    into the compiled layer; its proposals those of the Python step on the same int8
    weights, its log-probs and the cache it wrote within float32's rounding."""
    calls = []

    def recorded(weights):
        layer = compiled(weights)
        return None if layer is None else Recorded(layer, calls)
    compiled = draft_step.compiled_layer
    monkeypatch.setattr(draft_step, "compiled_layer", recorded)
    for seed in range(3):
        task, model = reduced_model(data_dir, 8, seed)
        heads = model.decoder.heads
        tokens, lprobs = proposal_lprobs(model, task, seed)
        cache = heads.state.cache.clone()
        assert calls == [1] * 7  # one row each: the first step's position and each later step's
        calls.clear()
        model.eval()  # weights arranged again, without the compiled layer
        monkeypatch.setattr(draft_step, "compiled_layer", lambda weights: None)
        python_tokens, python_lprobs = proposal_lprobs(model, task, seed)
        monkeypatch.setattr(draft_step, "compiled_layer", recorded)
        assert not calls and heads.weights().square_reduced and heads.weights().layer is None
        assert torch.equal(tokens, python_tokens)
        assert torch.allclose(lprobs, python_lprobs, atol=1e-4)
        assert torch.allclose(cache, heads.state.cache, atol=1e-4)


def propose_after_kept(data_dir, seed, features, block, kept, width, log_probs):
    """A fresh k=8 draft's heads, and its proposals of `width` at batch 1 after a block of
    8 (features 1 x 8 x C, block 1 x 8) of which `kept` positions were accepted (0: a
    first block)."""
    task, model = reduced_model(data_dir, 8, seed)
    heads = model.decoder.heads
    sample = random_sample(task, bsz=1, seed=seed)
    heads.state = None
    with torch.no_grad():
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
        if kept:
            heads.propose(features[:, 0], torch.tensor([5]), 8, 0, 1, encoder_out, log_probs=log_probs)
            heads.keep(torch.arange(8)[None], torch.tensor([kept]), features, block)
        return heads, heads.propose(features[:, max(kept, 1) - 1], torch.tensor([6]), width, 0, 1, encoder_out,
                                    log_probs=log_probs)


@pytest.mark.parametrize("kept", [3, 7])
def test_a_first_step_feeding_waiting_positions_is_one_compiled_call(data_dir, monkeypatch, kept):
    """Accepted positions kept after a block: the next first step feeds them (their entries in
    the cache) and makes the last one's layer in one call, as the Python step does (past 4
    entries the compiled step stays on the int8 weights: the Python step is made to, too)."""
    monkeypatch.setattr(product_module, "INT8_MOST_ROWS", 64)
    calls, results = [], []

    def recorded(weights):
        return Recorded(compiled(weights), calls)
    compiled = draft_step.compiled_layer
    g = torch.Generator().manual_seed(4)
    features, block = 3 * torch.randn(1, 8, 16, generator=g), torch.randint(4, 28, (1, 8), generator=g)
    for layer in (recorded, lambda weights: None):
        monkeypatch.setattr(draft_step, "compiled_layer", layer)
        heads, (proposals, lprobs) = propose_after_kept(data_dir, 4, features, block, kept, 4, True)
        results.append((proposals, lprobs, heads.state.cache.clone(), heads.state.longest))
    assert calls == [1] * 7 + [kept, 1, 1]  # the fresh chain's seven; the first step's entries, two later steps
    (tokens, lprobs, cache, longest), (python_tokens, python_lprobs, python_cache, python_longest) = results
    assert longest == python_longest == 1 + kept and torch.equal(tokens, python_tokens)
    assert torch.allclose(lprobs, python_lprobs, atol=1e-4) and torch.allclose(cache, python_cache, atol=1e-4)


class Recorded:
    """A compiled layer whose steps are counted by their entries."""

    def __init__(self, layer, calls):
        self.layer, self.calls = layer, calls

    def step(self, features, *args):
        self.calls.append(features.size(0))
        return self.layer.step(features, *args)

    def chain(self, features, *args):
        """Counted as its steps: the first's entries, then each later step's one."""
        self.calls.extend([features.size(0)] + [1] * (args[-1] - 1))
        self.chains = getattr(self, "chains", 0) + 1
        return self.layer.chain(features, *args)


@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("seed", range(3))
def test_decoding_with_the_compiled_step_is_greedy(data_dir, k, seed, monkeypatch):
    """Batch 1: first steps that feed several waiting positions and later steps of one, all
    compiled; the tokens greedy's (verification is head 1's)."""
    calls = []
    compiled = draft_step.compiled_layer
    monkeypatch.setattr(draft_step, "compiled_layer", lambda weights: Recorded(compiled(weights), calls))
    task, model = reduced_model(data_dir, k, seed)
    for bsz_seed in range(3):
        sample = random_sample(task, bsz=1, seed=10 * seed + bsz_seed)
        with torch.no_grad():
            expected = greedy(model, task, sample, max_len_b=30)
            hypos, _ = blockwise(model, task, sample, k, max_len_b=30)
        assert hypos[0][0]["tokens"].tolist() == expected[0]["tokens"].tolist()
    assert calls and set(calls) <= set(range(1, k + 2)), calls  # each a first step's entries or a later step's one


def test_the_compiled_step_refuses_what_it_would_misread(data_dir, kern):
    task, model = reduced_model(data_dir, 4, 0)
    proposal_lprobs(model, task, 0)
    heads = model.decoder.heads
    state, layer = heads.state, heads.weights().layer
    keys, values = state.source_keys, state.source_values
    features, tokens = torch.randn(1, 16), torch.tensor([5])
    assert layer.step(features, tokens, state.cache, 0, keys, values, None).shape == (1, 16)
    with pytest.raises(RuntimeError, match="features"):
        layer.step(torch.randn(1, 8), tokens, state.cache, 0, keys, values, None)
    with pytest.raises(RuntimeError, match="room"):
        layer.step(features, tokens, state.cache, state.cache.size(1), keys, values, None)
    with pytest.raises(RuntimeError, match="vocabulary"):
        layer.step(features, torch.tensor([10 ** 6]), state.cache, 0, keys, values, None)
    with pytest.raises(RuntimeError, match="source"):
        layer.step(features, tokens, state.cache, 0, keys, values[..., :2], None)
    with pytest.raises(RuntimeError, match="eight products"):
        kern.DraftLayer(torch.randn(30, 16), [], [], [], 2, [1e-5] * 4)
    weights = heads.weights()
    products = (weights.features_in, weights.qkv, weights.self_out, weights.source_query, weights.source_out,
                weights.ffn1, weights.ffn2, weights.fc_out)
    packed = [p.packed for p in products]
    packed[1] = packed[1].float()  # not int8
    with pytest.raises(RuntimeError, match="DraftLayer: packed weights"):
        kern.DraftLayer(weights.table, packed, [p.scales32 for p in products],
                        [torch.zeros(0) if p[1] is None else p[1] for p in products], weights.heads, list(weights.eps))


def test_arranged_weights_copy_with_a_compiled_layer_of_their_own(data_dir):
    """copy.deepcopy (and pickle) of arranged weights make the copy's compiled layer anew,
    from the copy's own products: it steps as the original does."""
    task, model = reduced_model(data_dir, 4, 1)
    proposal_lprobs(model, task, 1)
    heads = model.decoder.heads
    weights, state = heads.weights(), heads.state
    copied = copy.deepcopy(weights)
    assert copied.layer is not None and copied.layer is not weights.layer and copied.qkv is not weights.qkv
    args = (torch.randn(1, 16), torch.tensor([7]))
    cache = state.cache.clone()
    drafted = weights.layer.step(*args, state.cache, 2, state.source_keys, state.source_values, None)
    assert torch.equal(copied.layer.step(*args, cache, 2, state.source_keys, state.source_values, None), drafted)
    assert torch.equal(cache, state.cache)
    assert pickle.loads(pickle.dumps(weights)).layer is not None


def test_an_int8_product_refuses_overlaps_and_other_devices_and_serves_any_rows(kern):
    """out may be add itself, nothing else it reads; Int8Product copies rows whose channels
    are strided, and past 4 rows writes the sum with add into out."""
    product = Int8Product(torch.randn(32, 80), torch.randn(80))
    packed, scales = product.packed, product.scales32
    x = torch.randn(2, 200)
    with pytest.raises(RuntimeError, match="overlap"):  # out a view of x, written while x is read
        kern.int8_product(x[:, :32], packed, scales, None, None, False, x[:, 16:96])
    room = torch.randn(3, 80)
    with pytest.raises(RuntimeError, match="overlap"):  # add one row behind out
        kern.int8_product(torch.randn(2, 32), packed, scales, None, room[:2], False, room[1:])
    with pytest.raises(RuntimeError, match="memory location"):  # out overlapping itself
        kern.int8_product(torch.randn(2, 32), packed, scales, None, None, False, torch.randn(80).expand(2, 80))
    strided = torch.randn(32, 3)[:, 0][None].expand(2, 32)  # channels at a stride of 3
    assert torch.allclose(product(strided), product(strided.contiguous()))
    for rows in (3, 6):
        x, add = torch.randn(rows, 32), torch.randn(rows, 80)
        out = torch.empty(rows, 80)
        assert product(x, out=out, add=add) is out
        assert torch.allclose(out, product(x) + add, atol=1e-5)


def test_the_compiled_step_reads_no_masked_source_position_and_any_mask_layout(data_dir):
    """Source positions under -inf are not read (an inf behind the mask changes nothing), and
    a mask laid out at a stride gives the contiguous one's features."""
    task, model = reduced_model(data_dir, 4, 2)
    proposal_lprobs(model, task, 2)
    heads = model.decoder.heads
    state, layer = heads.state, heads.weights().layer
    keys, values = state.source_keys.clone(), state.source_values.clone()
    S = keys.size(2)
    mask = torch.zeros(1, 1, 1, S)
    mask[..., -2:] = -math.inf
    args = (torch.randn(1, 16), torch.tensor([7]), state.cache.clone(), 3)
    drafted = layer.step(*args, keys, values, mask)
    keys[:, :, -2:], values[:, :, -2:] = math.inf, math.nan
    assert torch.equal(layer.step(*args, keys, values, mask), drafted)
    strided = torch.zeros(1, 1, 1, 2 * S)[..., ::2]
    strided.copy_(mask)
    assert torch.equal(layer.step(*args, keys, values, strided), drafted)
    with pytest.raises(RuntimeError, match="tokens"):
        layer.step(torch.randn(2, 16), torch.tensor([[5, 9], [7, 11]])[:, 0], *args[2:], keys, values, None)


@pytest.mark.parametrize("kept", [0, 3])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_a_compiled_chain_is_the_python_loop_of_compiled_steps(data_dir, monkeypatch, kept, width):
    """propose() at batch 1 without log-probs: one DraftLayer.chain call (the first step,
    after `kept` accepted positions waiting, and each later step on the int8 projection's
    best token) gives the Python loop's proposals, and leaves the state as it does (the
    cache, the first step's features, the lengths), bit for bit: the same kernels."""
    layers, results = [], []
    compiled = draft_step.compiled_layer

    def recorded(weights):
        layers.append(Recorded(compiled(weights), []))
        return layers[-1]
    monkeypatch.setattr(draft_step, "compiled_layer", recorded)
    g = torch.Generator().manual_seed(5)
    features, block = 3 * torch.randn(1, 8, 16, generator=g), torch.randint(4, 28, (1, 8), generator=g)
    for chained in (True, False):
        if not chained:
            monkeypatch.setattr(DraftDecoder, "compiled_chain", lambda *args: None)
        heads, (proposals, lprobs) = propose_after_kept(data_dir, 5, features, block, kept, width, False)
        state = heads.state
        results.append((proposals, state.cache.clone(), state.root.clone(), state.length.clone(), state.longest))
        assert lprobs is None and proposals.shape == (1, width - 1, 1)
    assert getattr(layers[0], "chains", 0) == (2 if kept else 1)
    assert not hasattr(layers[-1], "chains")  # the Python loop's
    for chained, python in zip(*results):
        assert torch.equal(chained, python) if torch.is_tensor(chained) else chained == python


def test_a_compiled_chain_refuses_what_it_would_misread(data_dir, kern):
    task, model = reduced_model(data_dir, 4, 0)
    proposal_lprobs(model, task, 0)
    heads = model.decoder.heads
    state, layer = heads.state, heads.weights().layer
    projection = heads.reduced_projection(0)
    args = (state.source_keys, state.source_values, None, projection.packed, projection.scales32, projection[1])
    features, tokens = torch.randn(1, 16), torch.tensor([5])
    root, proposals = layer.chain(features, tokens, state.cache, 0, *args, 3)
    assert root.shape == (1, 16) and proposals.shape == (3,)
    with pytest.raises(RuntimeError, match="room"):  # the later steps' columns past the cache
        layer.chain(features, tokens, state.cache, state.cache.size(1) - 2, *args, 3)
    with pytest.raises(RuntimeError, match="room"):  # start + columns would overflow
        layer.chain(features, tokens, state.cache, 2 ** 63 - 2, *args, 3)
    with pytest.raises(RuntimeError, match="one proposal"):
        layer.chain(features, tokens, state.cache, 0, *args, 0)
    with pytest.raises(RuntimeError, match="packed"):
        layer.chain(features, tokens, state.cache, 0, *args[:3], projection.packed.float(), *args[4:], 3)


def test_a_compiled_chain_chooses_as_torch_argmax_among_nans(data_dir, kern):
    """A NaN logit is torch.argmax's choice (the first NaN): a scale made NaN at one token
    makes the chain propose that token at every step."""
    task, model = reduced_model(data_dir, 4, 0)
    proposal_lprobs(model, task, 0)
    heads = model.decoder.heads
    state, layer, projection = heads.state, heads.weights().layer, heads.reduced_projection(0)
    scales = projection.scales32.clone()
    scales[[7, 9]] = float("nan")
    _, proposals = layer.chain(torch.randn(1, 16), torch.tensor([5]), state.cache, 0, state.source_keys,
                               state.source_values, None, projection.packed, scales, projection[1], 3)
    assert proposals.tolist() == [7, 7, 7]
