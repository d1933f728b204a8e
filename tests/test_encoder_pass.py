"""The lean encoder pass (encoder_pass.py) computes fairseq's encoder output, and decoding on
it gives SequenceGenerator(beam_size=1)'s; encoders it does not understand run as fairseq's."""
import logging

import pytest
import torch

from conftest import build, random_sample
from test_generator import assert_same, blockwise, greedy
from test_lean_iteration import Operations

from fairseq_bpd import encoder_pass
from fairseq_bpd.encoder_pass import encode, unsupported

VARIANTS = [
    [],
    ["--encoder-normalize-before"],
    ["--layernorm-embedding"],
    ["--encoder-learned-pos"],
    ["--encoder-normalize-before", "--layernorm-embedding", "--encoder-learned-pos", "--no-scale-embedding"],
    ["--activation-fn", "gelu"],
]


def shift_norms(model, seed):
    """Random scales and shifts in the encoder's layer norms (a fresh one's are 1 and 0, under
    which a layer norm of the zeroed padding stays zero either way)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.encoder.modules():
        if isinstance(module, torch.nn.LayerNorm):
            for p in (module.weight, module.bias):
                p.data.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))


def fairseq_encoder_out(model, sample):
    with torch.inference_mode():
        return model.encoder.forward_torchscript(sample["net_input"])


def lean_encoder_out(model, sample):
    with torch.inference_mode():
        return encode(model, sample["net_input"])


def assert_close(expected, got, tolerance):
    """Every entry of fairseq's encoder-output dict, tensors within `tolerance`."""
    assert set(got) == set(expected)
    for key, tensors in expected.items():
        assert len(got[key]) == len(tensors), key
        for e, g in zip(tensors, got[key]):
            assert g.shape == e.shape and g.dtype == e.dtype, key
            if e.is_floating_point():
                assert torch.allclose(g, e, rtol=0, atol=tolerance), (key, (g - e).abs().max())
            else:
                assert torch.equal(g, e), key


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("bsz,seed", [(1, 1), (3, 2), (5, 3)])
def test_lean_encoder_is_fairseqs_encoder_in_float64(data_dir, flags, bsz, seed):
    """Padded batches of different lengths (left padding, as fairseq's dataset makes) and
    batch 1, post- and pre-norm, layer norm on the embeddings, learned and sinusoidal positions."""
    task, model, _ = build(data_dir, "--block-size", "3", *flags, seed=seed)
    shift_norms(model, seed)
    sample = random_sample(task, bsz=bsz, seed=seed, max_len=12)
    if bsz > 1:
        assert sample["net_input"]["src_tokens"].eq(task.source_dictionary.pad()).any()
    assert unsupported(model.encoder, sample["net_input"]) is None
    assert_close(fairseq_encoder_out(model, sample), lean_encoder_out(model, sample), 1e-12)
    assert model.decoder._encoder_weights is not None  # the lean pass ran


def test_lean_encoder_in_float32_and_its_operations(data_dir):
    """float32 (packed products where oneDNN is there) within float32 rounding of fairseq's, in
    under half of fairseq's encoder's tensor operations."""
    task, model, _ = build(data_dir, "--block-size", "3", seed=4, dtype=torch.float32)
    sample = random_sample(task, bsz=1, seed=4, max_len=12)
    lean_encoder_out(model, sample)  # arranges the weights
    with Operations() as fairseqs:
        expected = fairseq_encoder_out(model, sample)
    with Operations() as leans:
        got = lean_encoder_out(model, sample)
    assert_close(expected, got, 1e-5)
    assert len(leans.names) < len(fairseqs.names) / 2 and leans.waits() == 1  # has_pads: one read


def test_positions_past_the_kept_table_and_longer_inputs(data_dir):
    """A source longer than the positions first kept (64 rows) grows the table."""
    task, model, _ = build(data_dir, "--block-size", "3", "--encoder-learned-pos", seed=5)
    short, long = random_sample(task, bsz=1, seed=5), random_sample(task, bsz=1, seed=6, min_len=90, max_len=99)
    for sample in (short, long, short):
        assert_close(fairseq_encoder_out(model, sample), lean_encoder_out(model, sample), 1e-12)
    assert model.decoder._encoder_weights[1].table.size(0) >= 91


def test_weights_changed_between_encodings_are_read(data_dir):
    """load_state_dict (a version change) arranges the weights again; a change through .data
    is read after eval(), as the decoder's own kept weights are."""
    task, model, _ = build(data_dir, "--block-size", "3", seed=6)
    _, other, _ = build(data_dir, "--block-size", "3", seed=7)
    sample = random_sample(task, bsz=2, seed=6)
    before = lean_encoder_out(model, sample)
    model.load_state_dict(other.state_dict())
    after = lean_encoder_out(model, sample)
    assert not torch.allclose(before["encoder_out"][0], after["encoder_out"][0])
    assert_close(fairseq_encoder_out(model, sample), after, 1e-12)
    model.encoder.layers[0].fc1.weight.data.mul_(2)
    model.eval()
    assert_close(fairseq_encoder_out(model, sample), lean_encoder_out(model, sample), 1e-12)
    _, third, _ = build(data_dir, "--block-size", "3", seed=8)
    model.encoder = third.encoder  # another encoder in its place, no train() or eval()
    assert_close(fairseq_encoder_out(third, sample), lean_encoder_out(model, sample), 1e-12)


def hook(model):
    model.encoder.layers[1].fc2.register_forward_hook(lambda module, inputs, output: None)


def inference_dropout(model):
    model.encoder.layers[0].dropout_module.apply_during_inference = True
    model.encoder.layers[0].dropout_module.p = 0.0  # kept on, drawing nothing: the outputs stay comparable


FALLBACKS = [  # (flags, what is done to the model, the reason said)
    (["--encoder-layerdrop", "0.5"], None, "layerdrop"),
    (["--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "8"], None, "quantization noise"),
    ([], hook, "a forward hook"),
    ([], inference_dropout, "dropout at inference"),
    ([], lambda model: model.encoder.train(), "training mode"),
]


@pytest.mark.parametrize("flags,change,reason", FALLBACKS)
def test_encoders_it_does_not_understand_run_as_fairseqs(data_dir, caplog, flags, change, reason):
    """The fallback is taken (fairseq's own output, bit for bit), said once in the log, and
    decoding on it is still greedy's."""
    task, model, _ = build(data_dir, "--block-size", "3", *flags, seed=8)
    if change is not None:
        change(model)
    sample = random_sample(task, bsz=3, seed=8)
    assert unsupported(model.encoder, sample["net_input"]) == reason
    with caplog.at_level(logging.INFO, logger=encoder_pass.__name__):
        torch.manual_seed(0)  # layerdrop's module list draws even in eval
        got = lean_encoder_out(model, sample)
        lean_encoder_out(model, sample)
    torch.manual_seed(0)
    assert_close(fairseq_encoder_out(model, sample), got, 0)
    said = [r.getMessage() for r in caplog.records if "fairseq's own encoder forward" in r.getMessage()]
    assert said == [f"blockwise: fairseq's own encoder forward, not the lean pass ({reason})"]
    if reason != "training mode":  # fairseq's generator would set eval() itself
        assert_same(greedy(model, task, sample), blockwise(model, task, sample, 3)[0])


def test_other_inputs_and_inference_mode_weights_run_as_fairseqs(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", seed=9)
    sample = random_sample(task, bsz=2, seed=9)
    net_input = dict(sample["net_input"], return_all_hiddens=True)
    assert unsupported(model.encoder, net_input) == "inputs ['return_all_hiddens']"
    with torch.inference_mode():
        got = encode(model, net_input)
        assert len(got["encoder_states"]) == 3  # fairseq's own forward returned them
        _, frozen, _ = build(data_dir, "--block-size", "3", seed=9)  # inference tensors: no versions
        assert encoder_pass.encoder_weights(frozen) is None
        assert_close(frozen.encoder.forward_torchscript(sample["net_input"]), encode(frozen, sample["net_input"]), 0)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("bsz", [1, 4])
def test_blockwise_on_the_lean_encoder_is_greedy(data_dir, flags, bsz):
    """Decoding reads the lean pass's output (one encoder output for every pass and proposal)
    and gives fairseq's SequenceGenerator(beam_size=1) output, on chains and a tree."""
    task, model, _ = build(data_dir, "--block-size", "4", *flags, seed=10 + bsz)
    shift_norms(model, bsz)
    sample = random_sample(task, bsz=bsz, seed=10 + bsz)
    calls = []
    lean = encoder_pass.lean_encode

    def watched(*args):
        calls.append(lean(*args))
        return calls[-1]

    encoder_pass.lean_encode = watched
    try:
        expected = greedy(model, task, sample)
        assert_same(expected, blockwise(model, task, sample, 4)[0])
        assert_same(expected, blockwise(model, task, sample, 4, tree=6)[0])
    finally:
        encoder_pass.lean_encode = lean
    assert len(calls) == 2


def test_a_hook_or_training_after_a_lean_encoding_is_noticed(data_dir):
    """The decision is kept across batches, and made again when a hook is registered or a
    module's training flag changes (here a layer alone, the encoder's own flag unchanged)."""
    task, model, _ = build(data_dir, "--block-size", "3", seed=12)
    sample = random_sample(task, bsz=2, seed=12)
    lean_encoder_out(model, sample)
    seen = []
    model.encoder.layers[1].fc1.register_forward_hook(lambda module, inputs, output: seen.append(output))
    got = lean_encoder_out(model, sample)
    assert len(seen) == 1  # fairseq's forward ran, calling the hooked module
    assert_close(fairseq_encoder_out(model, sample), got, 0)
    _, model, _ = build(data_dir, "--block-size", "3", seed=12)
    lean_encoder_out(model, sample)
    model.encoder.layers[0].train()
    assert encoder_pass.decided(model, sample["net_input"])[0] == "training mode"
    model.eval()
    assert encoder_pass.decided(model, sample["net_input"])[0] is None
