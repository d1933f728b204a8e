"""transformer_blockwise: k heads on fairseq's decoder, sharing its output projection."""
import os
from argparse import Namespace

import pytest
import torch
from fairseq import checkpoint_utils, tasks
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.trainer import Trainer

from conftest import build, parse
from test_criterion import criterion, translation_batch

from fairseq_bpd.model import DEFAULT_PROPOSAL_HEADS, BlockwiseDecoder, BlockwiseTransformerModel

ARCHS = {  # name: (embed dim, layers) the architecture gives when the command line does not
    "transformer_blockwise": (512, 6),
    "transformer_blockwise_small": (256, 3),
    "transformer_blockwise_iwslt_de_en": (512, 6),
    "transformer_blockwise_wmt_en_de_big": (1024, 6),
}


def run(model, sample):
    """Logits B x T x V and the heads' features B x T x k x C."""
    logits, extra = model(**sample["net_input"])
    return logits, extra["block_features"]


def test_components_are_registered(data_dir):
    parse(data_dir)  # imports the plugin through --user-dir, as the CLIs do
    assert MODEL_REGISTRY["transformer_blockwise"] is BlockwiseTransformerModel
    assert "blockwise_cross_entropy" in CRITERION_REGISTRY
    assert "translation_blockwise" in TASK_REGISTRY
    for arch, (dim, layers) in ARCHS.items():
        assert ARCH_MODEL_REGISTRY[arch] is BlockwiseTransformerModel
        args = Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        assert (args.decoder_embed_dim, args.decoder_layers) == (dim, layers), arch
        assert args.block_size == args.proposal_heads == DEFAULT_PROPOSAL_HEADS
        assert (args.head_layout, args.freeze_base) == ("base", False)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_parses(data_dir, arch):
    args = parse(data_dir, "--block-size", "2", arch=arch)
    assert (args.arch, args.block_size, args.decoder_embed_dim) == (arch, 2, 16)


@pytest.mark.parametrize("layout", ["base", "paper"])
def test_head_shapes(data_dir, layout):
    task, model, _ = build(data_dir, "--block-size", "3", "--head-layout", layout)
    sample = translation_batch(task, 4, seed=1)
    B, T = sample["target"].shape
    logits, block = run(model, sample)
    assert isinstance(model.decoder, BlockwiseDecoder)
    assert logits.shape == (B, T, len(task.target_dictionary))
    assert block.shape == (B, T, 3, 16)


@pytest.mark.parametrize("layout", ["base", "paper"])
def test_heads_share_the_output_projection(data_dir, layout):
    task, model, _ = build(data_dir, "--block-size", "3", "--head-layout", layout)
    logits, block = run(model, translation_batch(task, 4, seed=2))
    projection = model.decoder.output_projection
    assert torch.equal(logits, projection(block[:, :, 0]))
    for i in range(3):
        assert torch.equal(model.decoder.output_layer(block[:, :, i]), projection(block[:, :, i]))
    # The heads add one feed-forward layer and nothing of vocabulary size.
    heads = {name for name, _ in model.decoder.heads.named_parameters()}
    assert heads == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    vocab = len(task.target_dictionary)
    assert all(vocab not in p.shape for p in model.decoder.heads.parameters())


@pytest.mark.parametrize("layout, first", [("base", 1), ("paper", 0)])
def test_heads_are_independent_slices(data_dir, layout, first):
    """Head `first + j` is output slice j of the layer: changing it changes that head only."""
    task, model, _ = build(data_dir, "--block-size", "4", "--head-layout", layout)
    sample = translation_batch(task, 3, seed=3)
    _, block = run(model, sample)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(block[:, :, i], block[:, :, j])
    fc2 = model.decoder.heads.fc2
    C = block.size(-1)
    assert fc2.out_features == (4 - first) * C
    for j in range(4 - first):
        with torch.no_grad():
            fc2.weight[j * C : (j + 1) * C] += 0.1
            fc2.bias[j * C : (j + 1) * C] -= 0.1
        _, changed = run(model, sample)
        moved = [i for i in range(4) if not torch.equal(changed[:, :, i], block[:, :, i])]
        assert moved == [first + j]
        block = changed


@pytest.mark.parametrize("layout", ["base", "paper"])
def test_the_first_heads_alone_match_all_heads(data_dir, layout):
    """A decoding block smaller than k computes only its heads' slices of the layer."""
    task, model, _ = build(data_dir, "--block-size", "4", "--head-layout", layout)
    sample = translation_batch(task, 3, seed=6)
    net_input = sample["net_input"]
    encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    x, _ = model.decoder.extract_features(net_input["prev_output_tokens"], encoder_out=encoder_out)
    every = model.decoder.heads.block_features(x)
    assert torch.equal(every, run(model, sample)[1])
    for count in (1, 2, 3):
        first = model.decoder.heads.block_features(x, count)
        assert first.shape == every[:, :, :count].shape
        assert torch.allclose(first, every[:, :, :count], rtol=0, atol=1e-12)
    assert torch.allclose(model.decoder.heads.head1_features(x), every[:, :, 0], rtol=0, atol=1e-12)


def test_base_layout_head1_is_the_decoder_output(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3")
    sample = translation_batch(task, 4, seed=4)
    net_input = sample["net_input"]
    logits, block = run(model, sample)
    encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    features, _ = model.decoder.extract_features(net_input["prev_output_tokens"], encoder_out)
    assert torch.equal(block[:, :, 0], features)
    assert torch.equal(logits, model.decoder.output_projection(features))


def test_plain_transformer_checkpoint_loads(data_dir):
    task, plain, _ = build(data_dir, seed=1, arch="transformer")
    _, blockwise, _ = build(data_dir, "--block-size", "3", seed=2)
    heads = {k: v.clone() for k, v in blockwise.decoder.heads.state_dict().items()}
    state = plain.state_dict()
    assert not any(".heads." in key for key in state)
    blockwise.load_state_dict(state, strict=True)  # upgrade_state_dict_named adds the heads
    for key, value in blockwise.decoder.heads.state_dict().items():
        assert torch.equal(value, heads[key])
    sample = translation_batch(task, 4, seed=5)
    logits, block = run(blockwise, sample)
    assert torch.equal(logits, plain(**sample["net_input"])[0])
    assert not torch.equal(block[:, :, 1], block[:, :, 0])


def test_freeze_base_trains_the_heads_only(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", "--freeze-base", dtype=torch.float32)
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # Every parameter is handed to the optimizer: the frozen ones must get no gradient.
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    crit = criterion(task)
    for seed in range(4):
        optimizer.zero_grad()
        loss, _, _ = crit(model, translation_batch(task, 4, seed=seed))
        loss.backward()
        optimizer.step()
    for name, p in model.named_parameters():
        if name.startswith("decoder.heads."):
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]), name


def test_block_size_zero_is_refused(data_dir):
    with pytest.raises(ValueError, match="--block-size must be at least 1"):
        build(data_dir, "--block-size", "0")


@pytest.mark.parametrize("vocab", ["-1", "4", "29"])  # 4 special symbols, then 24 words
def test_head_vocab_outside_the_dictionary_is_refused(data_dir, vocab):
    with pytest.raises(ValueError, match="--head-vocab must be 0 \\(all\\) or between 5 .* the dictionary's 28"):
        build(data_dir, "--block-size", "3", "--head-vocab", vocab)


def test_freeze_base_with_nothing_to_train_is_refused(data_dir):
    with pytest.raises(ValueError, match="--freeze-base"):
        build(data_dir, "--block-size", "1", "--freeze-base")


def test_project_is_the_output_layer_and_keeps_hooks(data_dir):
    _, model, _ = build(data_dir, "--block-size", "3")
    decoder = model.decoder
    for rows in (2, 8):  # 10 rows: W·xᵀ; 40 rows: x·Wᵀ
        x = torch.randn(rows, 5, 16, dtype=torch.float64)
        full = decoder.output_layer(x)
        assert torch.allclose(decoder.project(x), full, atol=1e-12)
        assert torch.allclose(decoder.project(x, 9), full[..., :9], atol=1e-12)
    # A hooked projection (here: EOS pushed up) is run as a module, hook and all.
    eos = decoder.dictionary.eos()
    decoder.output_projection.register_forward_hook(lambda module, inputs, out: out + 100.0 * (torch.arange(out.size(-1)) == eos))
    assert decoder.project(x).argmax(-1).eq(eos).all()
    assert decoder.project(x, 9).argmax(-1).eq(eos).all()


@pytest.mark.parametrize("flags,heads,block_size", [
    ([], DEFAULT_PROPOSAL_HEADS, DEFAULT_PROPOSAL_HEADS),
    (["--block-size", "3"], 3, 3),  # training's --block-size K: K heads, as before --proposal-heads
    (["--proposal-heads", "5"], 5, None),  # the task then decodes with all of them
    (["--proposal-heads", "5", "--block-size", "2"], 5, 2),
])
def test_the_heads_are_their_own_option(data_dir, flags, heads, block_size):
    args = parse(data_dir, *flags)
    assert (args.proposal_heads, args.block_size) == (heads, block_size)
    task, model, _ = build(data_dir, *flags)
    assert model.decoder.proposal_heads == model.decoder.block_size == heads
    assert run(model, translation_batch(task, 2, seed=1))[1].size(2) == heads


def test_proposal_heads_zero_is_refused_by_its_flag(data_dir):
    with pytest.raises(ValueError, match="--proposal-heads must be at least 1 \\(got 0\\)"):
        build(data_dir, "--proposal-heads", "0")


def save(data_dir, *flags):
    """A checkpoint of a tiny model, saved by fairseq's Trainer as fairseq-train saves one."""
    cfg = convert_namespace_to_omegaconf(parse(data_dir, *flags, "--optimizer", "adam", "--lr", "0.01", "--cpu"))
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    for p in model.decoder.heads.parameters():  # no zeros: fresh heads would not pass for these
        torch.nn.init.normal_(p)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    trainer.consolidate_optimizer()
    path = os.path.join(data_dir, "checkpoint.pt")
    trainer.save_checkpoint(path, {})
    return path, model.state_dict()


def from_before_proposal_heads(path):
    """The checkpoint as saved before --proposal-heads: block_size alone named the heads."""
    state = torch.load(path)
    del state["cfg"]["model"].proposal_heads
    old = path.replace(".pt", "_old.pt")
    torch.save(state, old)
    return old


@pytest.mark.parametrize("head_type", ["independent", "chained"])
@pytest.mark.parametrize("overrides", [None, {}, {"block_size": 2}])  # {}: fairseq-generate's
def test_a_checkpoint_from_before_proposal_heads_keeps_its_heads(data_dir, head_type, overrides):
    """Upgraded on loading (its heads: its block_size), also when an override (the hub's,
    --model-overrides) sets block_size, which fairseq applies before its upgrade."""
    path, weights = save(data_dir, "--block-size", "3", "--head-type", head_type)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [from_before_proposal_heads(path)], arg_overrides=overrides)
    assert models[0].decoder.proposal_heads == cfg.model.proposal_heads == 3
    loaded = models[0].state_dict()
    assert sorted(loaded) == sorted(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)
    block_size = (overrides or {}).get("block_size")  # the saved one is training's, no decoding request
    assert cfg.model.block_size == (block_size or 3) and cfg.task.block_size == task.cfg.block_size == block_size


def test_the_hub_sets_the_decoding_block_of_a_checkpoint_from_before_proposal_heads(data_dir):
    path = from_before_proposal_heads(save(data_dir, "--block-size", "3")[0])
    hub = BlockwiseTransformerModel.from_pretrained(data_dir, checkpoint_file=os.path.basename(path),
                                                    data_name_or_path=data_dir, blockwise=True, block_size=2)
    assert hub.models[0].decoder.proposal_heads == 3
    assert hub.task.cfg.block_size == hub.task.build_generator(hub.models, Namespace()).block_size == 2


def test_a_checkpoint_keeps_its_heads_whatever_block_size_loading_sets(data_dir):
    path, _ = save(data_dir, "--proposal-heads", "4", "--block-size", "2")
    for overrides in (None, {"block_size": 3}):
        models, cfg = checkpoint_utils.load_model_ensemble([path], arg_overrides=overrides)
        assert models[0].decoder.proposal_heads == cfg.model.proposal_heads == 4
