"""block_layer against fairseq's own decoder layer: same outputs, same cache, same attention."""
import math

import pytest
import torch

from fairseq_bpd.block_layer import block_layer, understands
from fairseq_bpd.cache import IncrementalCache
from conftest import build, random_sample


def copy_state(state):
    return {key: {name: None if t is None else t.clone() for name, t in buffer.items()}
            for key, buffer in state.items()}


def causal_after(width, n, dtype):
    """n x width+n: the block sees the whole cache and, inside itself, what came before."""
    mask = torch.zeros(n, width + n, dtype=dtype)
    mask[:, width:] = torch.triu(torch.full((n, n), -math.inf, dtype=dtype), 1)
    return mask


def layer_inputs(model, bsz, seed):
    """The encoder output of a left-padded batch, as forward_block passes it."""
    sample = random_sample(model.task_for_test, bsz, seed)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    padding = encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
    return encoder_out["encoder_out"][0], padding


def run_both(layer, x, enc, padding, state, mask, need_attn):
    """fairseq's layer and block_layer on copies of `state`: outputs, attentions, states."""
    fairseq_state, lean_state = copy_state(state), copy_state(state)
    expected, expected_attn, _ = layer(x, enc, padding, fairseq_state, self_attn_mask=mask,
                                       need_attn=need_attn, need_head_weights=need_attn)
    if expected_attn is not None:
        expected_attn = expected_attn.float().to(x).mean(dim=0)
    out, attn = block_layer(layer, x, enc, padding, IncrementalCache([layer], lean_state), mask, need_attn)
    return (expected, expected_attn, fairseq_state), (out, attn, lean_state)


def assert_same_state(layer, fairseq_state, lean_state, atol):
    for attention in (layer.self_attn, layer.encoder_attn):
        want, got = attention._get_input_buffer(fairseq_state), attention._get_input_buffer(lean_state)
        assert sorted(want) == sorted(got)
        for name in ("prev_key", "prev_value"):
            assert want[name].shape == got[name].shape
            torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0)
        mask_want, mask_got = want.get("prev_key_padding_mask"), got.get("prev_key_padding_mask")
        assert (mask_want is None) == (mask_got is None)
        if mask_want is not None:
            assert torch.equal(mask_got.bool(), mask_want.bool())


@pytest.fixture(params=["post-norm", "pre-norm"])
def model(request, data_dir):
    extra = ["--decoder-normalize-before"] if request.param == "pre-norm" else []
    task, model, _ = build(data_dir, *extra)
    model.task_for_test = task
    return model


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-7), (torch.float32, 1e-5)])
@pytest.mark.parametrize("need_attn", [False, True])
def test_a_block_after_a_cache_with_holes(model, dtype, atol, need_attn):
    """First call (empty cache, the encoder's keys cached), then a block of 4 after a cache
    where some entries are holes (a key padding mask), batch 3 with source padding."""
    model = model.to(dtype)
    torch.manual_seed(3)
    enc, padding = layer_inputs(model, 3, seed=5)
    assert padding is not None and padding.any()  # the source is padded
    for layer in model.decoder.layers:
        assert understands(layer)
        state = {}
        first = torch.randn(5, 3, 16, dtype=dtype)
        (want, want_attn, fairseq_state), (got, got_attn, lean_state) = run_both(
            layer, first, enc, padding, state, causal_after(0, 5, dtype), need_attn)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert_same_state(layer, fairseq_state, lean_state, atol)
        # Holes: sentence 0 masks cache entries 1 and 3, sentence 2 entry 4.
        holes = torch.zeros(3, 5, dtype=torch.bool)
        holes[0, [1, 3]] = holes[2, 4] = True
        buffer = layer.self_attn._get_input_buffer(fairseq_state)
        buffer["prev_key_padding_mask"] = holes
        layer.self_attn._set_input_buffer(fairseq_state, buffer)
        block = torch.randn(4, 3, 16, dtype=dtype)
        (want, want_attn, fairseq_state), (got, got_attn, lean_state) = run_both(
            layer, block, enc, padding, fairseq_state, causal_after(5, 4, dtype), need_attn)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert (got_attn is None) == (not need_attn)
        if need_attn:
            assert got_attn.shape == (3, 4, enc.size(0))
            torch.testing.assert_close(got_attn, want_attn, atol=atol, rtol=0)
        assert_same_state(layer, fairseq_state, lean_state, atol)


def test_a_single_token_without_a_mask(model):
    """A block of one (fairseq's own step: no mask) after a cache without holes."""
    torch.manual_seed(4)
    enc, padding = layer_inputs(model, 2, seed=7)
    layer = model.decoder.layers[-1]
    state = {}
    layer(torch.randn(3, 2, 16, dtype=torch.float64), enc, padding, state,
          self_attn_mask=causal_after(0, 3, torch.float64))
    (want, want_attn, fairseq_state), (got, got_attn, lean_state) = run_both(
        layer, torch.randn(1, 2, 16, dtype=torch.float64), enc, padding, state, None, True)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    torch.testing.assert_close(got_attn, want_attn, atol=1e-7, rtol=0)
    assert_same_state(layer, fairseq_state, lean_state, 1e-7)


def test_layers_it_does_not_reproduce_run_as_fairseqs(model):
    """Head scaling (c_attn), training mode or a hooked projection: fairseq's layer runs,
    and forward_block still gives the same features (c_attn of ones changes nothing)."""
    decoder = model.decoder
    sample = random_sample(model.task_for_test, 2, seed=9)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    tokens = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
    positions = torch.arange(4).expand(2, -1)
    lean = decoder.forward_block(tokens, positions, encoder_out, {})[0]
    layer = decoder.layers[0]
    assert decoder.lean_layers() == [True] * len(decoder.layers)
    layer.c_attn = torch.nn.Parameter(torch.ones(layer.nh, dtype=torch.float64))
    assert not understands(layer)
    model.eval()  # the verdicts are made again after train() / eval()
    assert decoder.lean_layers()[0] is False
    torch.testing.assert_close(decoder.forward_block(tokens, positions, encoder_out, {})[0], lean,
                               atol=1e-7, rtol=0)
    layer.c_attn = None
    assert understands(layer)
    handle = layer.fc1.register_forward_hook(lambda *args: None)
    assert not understands(layer)
    handle.remove()
    layer.train()
    assert not understands(layer)


@pytest.mark.parametrize("where", ["layer", "self_attn", "encoder_attn", "pre-hook on layer"])
def test_a_hook_on_a_module_block_layer_bypasses_runs_as_fairseqs(model, where):
    """block_layer calls the layer's linears and layer norms but not the layer itself nor its
    attention modules: a hook on those (one that reads attention, or one that changes the
    output) must still run, so such a layer runs as fairseq's."""
    decoder = model.decoder
    sample = random_sample(model.task_for_test, 2, seed=9)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    tokens = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
    positions = torch.arange(4).expand(2, -1)
    layer = decoder.layers[0]
    module = layer if where.endswith("layer") else getattr(layer, where)
    calls = []

    def halve(module, args, output):  # changes the output, as a pruning or steering hook may
        calls.append(1)
        return (output[0] / 2, *output[1:])

    def halve_input(module, args):
        calls.append(1)
        return (args[0] / 2, *args[1:])

    if where.startswith("pre-hook"):
        handle = module.register_forward_pre_hook(halve_input)
    else:
        handle = module.register_forward_hook(halve)
    try:
        assert not understands(layer)
        decoder.lean_layers()
        decoder._lean_layers = [False] * len(decoder.layers)  # fairseq's own layers
        want = decoder.forward_block(tokens, positions, encoder_out, {})[0]
        model.eval()  # the verdicts decided again
        calls.clear()
        got = decoder.forward_block(tokens, positions, encoder_out, {})[0]
        assert calls
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    finally:
        handle.remove()


def test_a_hook_registered_after_a_decode_runs(model):
    """The verdicts are kept across invocations; a hook registered after the first (as one
    that reads attention, on a hub whose model.eval() no longer reaches the decoder after
    fairseq's make_generation_fast_) still runs, and the outputs are fairseq's."""
    decoder = model.decoder
    sample = random_sample(model.task_for_test, 2, seed=9)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    tokens = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
    positions = torch.arange(4).expand(2, -1)
    model.make_generation_fast_()
    decoder.forward_block(tokens, positions, encoder_out, {})
    assert decoder.lean_layers() == [True] * len(decoder.layers)
    calls = []

    def halve(module, args, output):
        calls.append(1)
        return (output[0] / 2, *output[1:])

    layer = decoder.layers[-1]
    handle = layer.encoder_attn.register_forward_hook(halve)
    try:
        model.eval()  # what a user would try: after make_generation_fast_ it reaches no module
        got = decoder.forward_block(tokens, positions, encoder_out, {})[0]
        assert calls
        calls.clear()
        decoder._lean_layers = [False] * len(decoder.layers)  # fairseq's own layers
        want = decoder.forward_block(tokens, positions, encoder_out, {})[0]
        assert calls
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    finally:
        handle.remove()
