"""Breaking product.Product against fairseq's stock behaviour: the packed products of the
lean pass, the static cache, the decoder's projections and the draft step, in float32 on a
CPU (where oneDNN's packed weights serve, or the compiled kernel's: `faster`), with weights changed in place between decodes,
tied embeddings, mkldnn and $FAIRSEQ_BPD_PACKED switched after a decode, dtype and mode
changes, copies of a model that has decoded, a projection that is not a plain Linear, and
fairseq-generate.

A decode after a change is compared with the same decode on a model built anew with the
changed weights (the same code paths, arranged from scratch: bit for bit), and its tokens
with fairseq's SequenceGenerator(beam_size=1) on it; each change is checked to change the
output, so that weights kept from before it would fail.
"""
import copy
import io
import pickle

import pytest
import torch

from cli_support import BLOCK_SIZE as CLI_BLOCK_SIZE, assert_same_hypotheses, hypotheses, trained
from conftest import build, random_sample
from test_chained import CHAINED
from test_draft import DRAFT
from test_generator import assert_same, blockwise, greedy
from test_lean_iteration import Operations
from test_reliability import generate

from fairseq_bpd import kernels
from fairseq_bpd.product import PACKED_VARIABLE

HEAD_TYPES = {"independent": (), "chained": CHAINED, "draft": DRAFT}
BLOCK_SIZE = 4
PACKED_OP = "mkldnn._linear_pointwise"


def model_of(data_dir, head_type, *extra, seed=1, dtype=torch.float32):
    """A tiny float32 model of `head_type` (a draft's output layer random, not zero)."""
    task, model, _ = build(data_dir, "--block-size", str(BLOCK_SIZE), *HEAD_TYPES[head_type], *extra,
                           seed=seed, dtype=dtype)
    if head_type == "draft":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.decoder.heads.fc_out.weight.normal_(0, 0.5, generator=generator)
    return task, model


COMPILED_CALLS = [0]  # the compiled kernel's products run (counted where `faster` is "compiled")


@pytest.fixture(autouse=True)
def libraries_unless_asked(request, monkeypatch):
    """The compiled kernels off, unless the test asks for `faster`: at a few rows their
    product would serve instead of oneDNN's packed copies, which these tests break."""
    if "faster" not in request.fixturenames:
        monkeypatch.setenv(kernels.VARIABLE, "0")


@pytest.fixture(params=["packed", "compiled"])
def faster(request, monkeypatch):
    """The faster products a test's decodes run, each kept from one decode to the next:
    oneDNN's packed copies (the compiled kernels off) or the compiled kernel's (its packed
    copies, product.blocked), whose calls decoded() counts with the packed ones."""
    if request.param == "packed":
        monkeypatch.setenv(kernels.VARIABLE, "0")
        return request.param
    module = kernels.module()
    assert module is not None  # built here (and in CI): a fallback would hide a failure
    original = module.float_product

    def float_product(*args, **kwargs):
        COMPILED_CALLS[0] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(module, "float_product", float_product)
    return request.param


def decoded(model, task, sample, **options):
    """Blockwise output: (tokens, positional scores) per sentence, and the faster products
    run (oneDNN's packed ones, and the compiled kernel's where `faster` counts them)."""
    before = COMPILED_CALLS[0]
    with Operations() as operations:
        hypos, _ = blockwise(model, task, sample, BLOCK_SIZE, **options)
    packed = sum(PACKED_OP in name for name in operations.names) + COMPILED_CALLS[0] - before
    return [(h[0]["tokens"].tolist(), h[0]["positional_scores"]) for h in hypos], packed


def same(a, b):
    """Bit for bit the same tokens and scores."""
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def greedy_tokens(model, task, sample):
    return [h["tokens"].tolist() for h in greedy(model, task, sample)]


def assert_decodes_its_weights(model, reference, task, sample, before):
    """model's next decode is the decode of `reference` (built alike, changed alike, nothing
    decoded before: arranged from scratch) and greedy's tokens on it; `before` (model's
    decode before the change) differs from it. Greedy runs on the reference: fairseq's
    generator calls eval(), which would drop what model arranged."""
    after, _ = decoded(model, task, sample)
    expected, _ = decoded(reference, task, sample)
    assert same(after, expected)
    assert not same(after, before)  # the change matters: weights kept from before would fail
    assert [tokens for tokens, _ in after] == greedy_tokens(reference, task, sample)


def optimizer_step(model, task, sample, other):
    """One Adam step on a loss through every head's features, the model left in eval mode
    (no train() to drop what decoding arranged): torch.optim updates in place."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    tokens = sample["net_input"]["src_tokens"].clamp(min=task.target_dictionary.nspecial)
    logits, extra = model(**sample["net_input"], prev_output_tokens=tokens)
    loss = logits.log_softmax(-1)[..., task.target_dictionary.nspecial].mean() + extra["block_features"].square().mean()
    loss.backward()
    optimizer.step()


def load_other(model, task, sample, other):
    model.load_state_dict(other.state_dict())


def copy_other(model, task, sample, other):
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)


def copy_under_inference_mode(model, task, sample, other):
    with torch.inference_mode():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)


def to_double(model, task, sample, other):
    model.double()


def through_data_then_eval(model, task, sample, other):
    """A change through .data moves no version counter: the documented remedy is eval()."""
    for p, q in zip(model.parameters(), other.parameters()):
        p.data.copy_(q.data)
    model.eval()


CHANGES = [optimizer_step, load_other, copy_other, copy_under_inference_mode, to_double,
           through_data_then_eval]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_weights_changed_between_decodes_are_decoded_with(data_dir, head_type, change, faster):
    """Each change after a packed decode: the next decode is a model's changed alike before
    any decode (bit for bit) and greedy's, for every head type (the draft's own products too)."""
    task, model = model_of(data_dir, head_type, seed=1)
    _, reference = model_of(data_dir, head_type, seed=1)
    _, other = model_of(data_dir, head_type, seed=2)
    sample = random_sample(task, bsz=4, seed=3)
    before, packed = decoded(model, task, sample)
    assert packed  # blocks of several rows ran on packed weights
    for changed in (model, reference):
        change(changed, task, sample, other)
    assert_decodes_its_weights(model, reference, task, sample, before)


def to_half(model, task, sample, other):
    model.half()


def to_bfloat16(model, task, sample, other):
    model.bfloat16()


@pytest.mark.parametrize("change", [to_half, to_bfloat16], ids=lambda f: f.__name__)
@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_a_model_moved_to_half_precision_after_a_decode_decodes_in_it(data_dir, head_type, change, faster):
    """No packed product in half precision (MKL's, or torch's CPU kernels): the decode is the
    one of a model moved before any decode, bit for bit, and runs no packed product."""
    task, model = model_of(data_dir, head_type, seed=1)
    _, reference = model_of(data_dir, head_type, seed=1)
    sample = random_sample(task, bsz=4, seed=3)
    before, _ = decoded(model, task, sample)
    for changed in (model, reference):
        change(changed, task, sample, None)
    after, packed = decoded(model, task, sample)
    expected, _ = decoded(reference, task, sample)
    assert same(after, expected) and not same(after, before) and not packed


def scale_rows(model, task, sample):
    """Some rows of the decoder's embedding scaled in place (under no_grad, as a user would):
    tied, the output projection's rows too."""
    with torch.no_grad():
        model.decoder.embed_tokens.weight[task.target_dictionary.nspecial::3].mul_(-3)


@pytest.mark.parametrize("extra", [("--share-decoder-input-output-embed",), ("--share-all-embeddings",),
                                   ("--share-all-embeddings", "--head-vocab", "12")], ids=" ".join)
@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_tied_embeddings_changed_in_place_are_decoded_with(data_dir, head_type, extra, faster):
    """The embedding that is also the output projection (and the encoder's), changed in place
    through a slice and by an optimizer step: both read by the next decode, with a
    shortlist's projection too."""
    task, model = model_of(data_dir, head_type, *extra, seed=1)
    decoder = model.decoder
    assert decoder.output_projection.weight is decoder.embed_tokens.weight
    if "--share-all-embeddings" in extra:
        assert model.encoder.embed_tokens.weight is decoder.embed_tokens.weight
    _, reference = model_of(data_dir, head_type, *extra, seed=1)
    sample = random_sample(task, bsz=4, seed=3)
    before, packed = decoded(model, task, sample)
    assert packed
    for changed in (model, reference):
        scale_rows(changed, task, sample)
    assert_decodes_its_weights(model, reference, task, sample, before)
    before, _ = decoded(model, task, sample)
    for changed in (model, reference):
        optimizer_step(changed, task, sample, None)
    assert_decodes_its_weights(model, reference, task, sample, before)


def unpacked(model, task, sample, monkeypatch):
    """The decode of `model` (one that has not decoded) with packing off
    ($FAIRSEQ_BPD_PACKED=0): MKL's addmm throughout."""
    with monkeypatch.context() as patch:
        patch.setenv(PACKED_VARIABLE, "0")
        expected, packed = decoded(model, task, sample)
    assert not packed
    return expected


@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_mkldnn_disabled_after_a_decode_runs_no_packed_product(data_dir, head_type, monkeypatch):
    """torch.backends.mkldnn.flags(enabled=False) is read on every product: inside it the
    products arranged by an earlier decode run MKL's addmm (the decode of a model that never
    packed, bit for bit), and after it packed ones again (the first decode's, bit for bit).
    Products arranged while it was disabled are packed on their first use after it."""
    task, model = model_of(data_dir, head_type, seed=1)
    sample = random_sample(task, bsz=4, seed=3)
    first, packed = decoded(model, task, sample)
    assert packed
    expected = unpacked(model_of(data_dir, head_type, seed=1)[1], task, sample, monkeypatch)
    with torch.backends.mkldnn.flags(enabled=False):
        inside, packed = decoded(model, task, sample)
        _, late = model_of(data_dir, head_type, seed=1)
        arranged_inside, _ = decoded(late, task, sample)
    assert not packed and same(inside, expected) and same(arranged_inside, expected)
    after, packed = decoded(model, task, sample)
    assert packed and same(after, first)
    late_after, packed = decoded(late, task, sample)
    assert packed and same(late_after, first)


@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_the_variable_set_after_a_decode_takes_effect_at_eval(data_dir, head_type, monkeypatch):
    """$FAIRSEQ_BPD_PACKED is read when the weights are arranged (product.py): set after a
    decode, the next decodes keep their packed products until model.eval() drops them; then
    the decode is a model's that never packed, bit for bit."""
    task, model = model_of(data_dir, head_type, seed=1)
    sample = random_sample(task, bsz=4, seed=3)
    first, _ = decoded(model, task, sample)
    expected = unpacked(model_of(data_dir, head_type, seed=1)[1], task, sample, monkeypatch)
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    kept, packed = decoded(model, task, sample)
    assert packed and same(kept, first)
    model.eval()
    off, packed = decoded(model, task, sample)
    assert not packed and same(off, expected)
    monkeypatch.delenv(PACKED_VARIABLE)
    model.eval()
    on, packed = decoded(model, task, sample)
    assert packed and same(on, first)


@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_grad_modes_and_requires_grad_decode_alike(data_dir, head_type, faster):
    """The generator decodes under inference_mode whatever the caller's mode: under no_grad,
    under inference_mode, and with weights that require no gradient, the same packed decode."""
    task, model = model_of(data_dir, head_type, seed=1)
    sample = random_sample(task, bsz=4, seed=3)
    first, _ = decoded(model, task, sample)
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with mode():
            again, packed = decoded(model, task, sample)
        assert packed and same(again, first)
    model.requires_grad_(False)
    again, packed = decoded(model, task, sample)
    assert packed and same(again, first)


@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_weights_made_under_inference_mode_are_read_on_every_decode(data_dir, head_type, faster):
    """A model converted under inference_mode holds inference tensors, which keep no version
    counter: nothing is kept across decodes (weights_key None), so a change in place (allowed
    under inference_mode) is read by the next decode, and it is greedy's."""
    task, model = model_of(data_dir, head_type, seed=1)
    _, other = model_of(data_dir, head_type, seed=2)
    sample = random_sample(task, bsz=4, seed=3)
    with torch.inference_mode():
        model.double()
        model.float()
    assert all(p.is_inference() for p in model.parameters())
    hypos, _ = blockwise(model, task, sample, BLOCK_SIZE)
    assert_same(greedy(model_of(data_dir, head_type, seed=1)[1], task, sample), hypos)
    with torch.inference_mode():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)
    hypos, _ = blockwise(model, task, sample, BLOCK_SIZE)
    assert_same(greedy(other, task, sample), hypos)


def clone_of(model, how):
    """A copy of `model` made `how`: deepcopy, pickle or torch.save."""
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    return clone


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_a_copy_of_a_model_that_has_decoded_decodes_its_own_weights(data_dir, head_type, how, faster):
    """A copy (fairseq's EMA deep-copies; a user pickles or torch.saves the model) decodes as
    the original, on packed copies of its own: changed in place, it decodes its new weights
    and the original its own."""
    task, model = model_of(data_dir, head_type, seed=1)
    _, other = model_of(data_dir, head_type, seed=2)
    sample = random_sample(task, bsz=4, seed=3)
    first, _ = decoded(model, task, sample)
    clone = clone_of(model, how)
    again, packed = decoded(clone, task, sample)
    assert packed and same(again, first)
    copy_other(clone, task, sample, other)
    assert_decodes_its_weights(clone, other, task, sample, first)
    again, packed = decoded(model, task, sample)
    assert packed and same(again, first)


def test_a_decoded_models_state_dict_holds_only_its_weights(data_dir, faster):
    """What decoding arranged is no part of a checkpoint: the state_dict of a model that has
    decoded has a fresh model's keys and loads with weights_only."""
    task, model = model_of(data_dir, "draft", seed=1)
    decoded(model, task, random_sample(task, bsz=4, seed=3))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert list(state) == list(model_of(data_dir, "draft", seed=2)[1].state_dict())


def logit_shift(task):
    """V values from -2 to 2 in a fixed random order: added to the logits, they change greedy's choices."""
    vocab = len(task.target_dictionary)
    return torch.linspace(-2, 2, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]


def shifted(model, shift):
    """A forward hook on the output projection adding `shift` (V) to its logits: fairseq's
    step and the blockwise pass both call the module, so both must see it."""
    return model.decoder.output_projection.register_forward_hook(lambda module, inputs, out: out + shift)


def biased(model, bias):
    """The output projection replaced by a Linear with a bias (not a plain projection)."""
    decoder = model.decoder
    weight = decoder.output_projection.weight
    projection = torch.nn.Linear(weight.size(1), weight.size(0), bias=True).to(weight)
    with torch.no_grad():
        projection.weight.copy_(weight)
        projection.bias.copy_(bias)
    decoder.output_projection = projection


@pytest.mark.parametrize("head_type", list(HEAD_TYPES))
def test_a_projection_that_is_not_plain_is_run_as_the_module(data_dir, head_type, faster):
    """After a packed decode, a hook on the output projection is what the next decode scores
    by (the module's fallback: greedy's tokens under the hook); with the hook removed, the
    packed products again, on weights changed while it was on (the decode of a model with
    those weights, bit for bit); a biased projection is the module's too (bit for bit the
    decode of a model changed alike before any decode)."""
    task, model = model_of(data_dir, head_type, seed=1)
    _, reference = model_of(data_dir, head_type, seed=1)
    _, other = model_of(data_dir, head_type, seed=2)
    sample = random_sample(task, bsz=4, seed=3)
    shift = logit_shift(task)
    before, _ = decoded(model, task, sample)
    hooks = [shifted(changed, shift) for changed in (model, reference)]
    hooked, _ = decoded(model, task, sample)
    assert [tokens for tokens, _ in hooked] == greedy_tokens(reference, task, sample) and not same(hooked, before)
    for changed in (model, reference):
        copy_other(changed, task, sample, other)
    for hook in hooks:
        hook.remove()
    after, packed = decoded(model, task, sample)
    assert packed and same(after, decoded(other, task, sample)[0]) and not same(after, hooked)
    for changed in (model, reference):
        biased(changed, shift)
    assert_decodes_its_weights(model, reference, task, sample, after)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_cli's and test_reliability's model (trained once a session, float32)."""
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


@pytest.mark.parametrize("packing", ["1", "0"])
def test_fairseq_generate_blockwise_in_float32_is_beam_one_with_packing_on_and_off(tiny, packing, monkeypatch):
    """fairseq-generate (its entry point, in this process) on a CPU in float32: --blockwise's
    hypotheses are --beam 1's, its blocks on packed products or, with $FAIRSEQ_BPD_PACKED=0,
    on none."""
    monkeypatch.setenv(PACKED_VARIABLE, packing)
    for batch_size in (1, 8):
        expected = hypotheses(generate(tiny, "--beam", 1, "--batch-size", batch_size))
        with Operations() as operations:
            output = generate(tiny, "--blockwise", "--block-size", CLI_BLOCK_SIZE, "--batch-size", batch_size)
        assert_same_hypotheses(expected, hypotheses(output))
        assert any(PACKED_OP in name for name in operations.names) == (packing == "1")
