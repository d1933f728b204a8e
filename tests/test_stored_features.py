"""--stored-features: frozen-base head training on the base's features stored once
(scripts/store_features.py) gives the losses and gradients of training on the base's own."""
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils, options, tasks

from conftest import PLUGIN, parse
from test_criterion import criterion
from test_train import ENV, binarised_corpus, fairseq, finish

from fairseq_bpd.bench import load
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.stored_features import StoredFeatures, sha256, store_subset

ROOT = os.path.dirname(PLUGIN)
SCRIPT = os.path.join(ROOT, "scripts", "store_features.py")
# conftest.parse's model (2+2 layers of width 16), as a plain fairseq transformer
BASE = [
    "--source-lang", "de", "--target-lang", "en", "--share-all-embeddings", "--dropout", "0",
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
QUIET = ["--cpu", "--num-workers", "0", "--no-progress-bar", "--seed", "1"]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A binarised corpus, a plain transformer base trained 3 updates, and its stored features."""
    root = tmp_path_factory.mktemp("stored")
    data = binarised_corpus(root)
    finish(fairseq("fairseq-train", data, *BASE, *QUIET, "--task", "translation", "--arch", "transformer",
                   "--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "0.005",
                   "--max-tokens", "500", "--max-update", "3", "--disable-validation", "--save-dir", f"{root}/base"))
    base, features = f"{root}/base/checkpoint_last.pt", f"{root}/features"
    subprocess.run([sys.executable, SCRIPT, data, base, features, "--cpu", "--max-tokens", "300"],
                   env=ENV, check=True, capture_output=True)
    return SimpleNamespace(root=root, data=data, base=base, features=features)


def heads_task(stored, *extra, features=None):
    """The training task on the stored features (or `features`), and its parsed options."""
    args = parse(stored.data, "--share-all-embeddings", "--block-size", "3", "--stored-features",
                 features or stored.features, *extra)
    return tasks.setup_task(args), args


def heads_model(task, args, seed=3):
    """A frozen base loaded as --finetune-from-model loads it, with random (not zero) heads."""
    model = task.build_model(args)
    model.load_state_dict(checkpoint_utils.load_checkpoint_to_cpu(args.finetune_from_model)["model"])
    generator = torch.Generator().manual_seed(seed)
    for param in model.decoder.heads.parameters():
        param.data.normal_(0, 0.3, generator=generator)
    return model


def store(data, checkpoint, out, *extra):
    """scripts/store_features.py, run in this process (fairseq imported once)."""
    argv = sys.argv
    try:
        sys.argv = [SCRIPT, data, checkpoint, out, "--cpu", *extra]
        runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = argv


def first_batch(task, split="valid", max_tokens=150):
    task.load_dataset(split)
    return next(iter(task.get_batch_iterator(task.dataset(split), max_tokens=max_tokens).next_epoch_itr(shuffle=False)))


def without_stored(sample):
    net_input = {k: v for k, v in sample["net_input"].items() if k != "stored_features"}
    return {**sample, "net_input": net_input}


def copy_features(stored, tmp_path):
    copy = str(tmp_path / "features")
    shutil.copytree(stored.features, copy)
    return copy


def edit_meta(directory, edit):
    path = os.path.join(directory, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    edit(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


def test_stored_features_are_each_sentences_own(stored):
    """Every sentence's stored rows are the base's features with that sentence alone in its
    batch (fairseq's positions count real tokens only), up to float32 rounding."""
    model, task, _ = load(stored.base, stored.data)
    with open(os.path.join(stored.features, "meta.json")) as f:
        meta = json.load(f)
    assert meta["checkpoint_sha256"] == sha256(stored.base) and (meta["encoder_dim"], meta["decoder_dim"]) == (16, 16)
    eos = task.target_dictionary.eos()
    for split, sentences in (("train", 200), ("valid", 20)):
        task.load_dataset(split)
        dataset = task.dataset(split)
        entry = meta["subsets"][split]
        assert entry["sentences"] == sentences and entry["unstored"] == []
        names = [f"{split}.de-en.{lang}.{ext}" for lang in ("de", "en") for ext in ("bin", "idx")]
        assert entry["files"] == {name: sha256(f"{stored.data}/{name}") for name in names}
        offsets = np.load(f"{stored.features}/{split}.offsets.npy")
        encoder, decoder = (np.load(f"{stored.features}/{split}.{side}.npy") for side in ("encoder", "decoder"))
        assert encoder.shape == (entry["source_tokens"], 16) and decoder.shape == (entry["target_tokens"], 16)
        for i in range(sentences):
            source, target = dataset[i]["source"][None], dataset[i]["target"]
            previous = torch.cat([target.new_tensor([eos]), target[:-1]])[None]
            with torch.no_grad():
                encoder_out = model.encoder(source, src_lengths=torch.tensor([source.size(1)]))
                x, _ = model.decoder.extract_features(previous, encoder_out=encoder_out)
            np.testing.assert_allclose(encoder[offsets[i, 0]:offsets[i + 1, 0]], encoder_out["encoder_out"][0][:, 0],
                                       atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(decoder[offsets[i, 1]:offsets[i + 1, 1]], x[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_type", ["draft", "chained", "independent"])
def test_stored_features_give_the_loss_and_gradients_of_the_base(stored, head_type):
    """A batch of other sentences and padding than the stored ones: the frozen training loss
    (heads 2..k), its gradients and validation's every-head loss are those of the base's own features."""
    task, args = heads_task(stored, "--head-type", head_type, "--freeze-base", "--finetune-from-model", stored.base)
    model = heads_model(task, args)
    sample = first_batch(task)
    net_input, pad = sample["net_input"], task.target_dictionary.pad()
    assert set(net_input["stored_features"]) == {"encoder_out", "decoder"}
    assert net_input["src_tokens"].eq(pad).any() and net_input["prev_output_tokens"].eq(pad).any()
    loss = criterion(task)
    base_runs = []  # the base's encoder and first decoder layer run only without stored features
    for module in (model.encoder, model.decoder.layers[0]):
        module.register_forward_pre_hook(lambda module, args: base_runs.append(module))
    results = []
    for batch in (sample, without_stored(sample)):
        model.train()
        model.zero_grad()
        value, _, log = loss(model, batch)
        value.backward()
        grads = [p.grad.clone() for p in model.decoder.heads.parameters()]
        model.eval()
        with torch.no_grad():
            _, _, valid_log = loss(model, batch)
        results.append((value, log, grads, valid_log))
        assert len(base_runs) == (0 if batch is sample else 4)
    (value, log, grads, valid_log), (own_value, own_log, own_grads, own_valid_log) = results
    assert torch.allclose(value, own_value, rtol=1e-5) and "loss_h3" in log
    for key in ("loss_h2", "loss_h3"):
        assert torch.allclose(log[key], own_log[key], rtol=1e-5), key
    assert all(torch.allclose(g, own, rtol=1e-4, atol=1e-7) for g, own in zip(grads, own_grads))
    assert any(g.abs().sum() > 0 for g in grads)
    for key in ("loss", "nll_loss", "loss_h1", "loss_h2", "loss_h3"):
        assert torch.allclose(valid_log[key], own_valid_log[key], rtol=1e-5), key
    assert valid_log["block_sum"] == own_valid_log["block_sum"]


def test_the_first_batch_is_checked_once_against_the_base(stored, tmp_path):
    """Features a different base made are refused on the first training step, naming that
    base; the base's own pass the check, made once a process."""
    other = str(tmp_path / "other.pt")
    state = torch.load(stored.base)
    for key, value in state["model"].items():
        if value.is_floating_point():
            state["model"][key] = value + 0.05 * torch.randn_like(value)
    torch.save(state, other)
    store(stored.data, other, str(tmp_path / "other"), "--subsets", "valid")
    optimizer = SimpleNamespace(backward=lambda loss: loss.backward())
    for features, refused in ((stored.features, False), (str(tmp_path / "other"), True)):
        task, args = heads_task(stored, "--freeze-base", "--finetune-from-model", stored.base, features=features)
        model = heads_model(task, args)
        sample = first_batch(task)
        step = (sample, model, criterion(task), optimizer, 0)
        if refused:
            message = (f"--stored-features {re.escape(features)}: they differ from this base's own features on the "
                       rf"first batch \(by up to [\d.e-]+\): they were made from another base \({re.escape(other)}, "
                       f"sha256 {sha256(other)}\\)")
            with pytest.raises(BlockwiseRequestError, match=message):
                task.train_step(*step)
            continue
        task.train_step(*step)
        assert task.stored_features().checked
        sample["net_input"]["stored_features"]["decoder"] += 1.0  # no second check: no refusal
        task.train_step(*step)


def test_refusals_name_the_flag_and_the_file(stored, tmp_path):
    task, args = heads_task(stored)
    with pytest.raises(BlockwiseRequestError, match="^--stored-features needs --freeze-base: "):
        task.build_model(args)
    task, args = heads_task(stored, "--freeze-base", "--encoder-embed-dim", "24", "--decoder-embed-dim", "24")
    with pytest.raises(BlockwiseRequestError, match=r"features are 16 \(encoder\) and 16 \(decoder\) wide, "
                                                    "this model's 24 and 24: they were made from another base"):
        task.build_model(args)

    def refused(features, message, split="valid"):
        task, _ = heads_task(stored, "--freeze-base", features=features)
        with pytest.raises(BlockwiseRequestError, match=f"^--stored-features {re.escape(features)}: {message}"):
            task.load_dataset(split)

    empty = str(tmp_path / "empty")
    os.mkdir(empty)
    refused(empty, "no meta.json there")
    copy = copy_features(stored, tmp_path)
    edit_meta(copy, lambda meta: meta["subsets"].pop("valid"))
    refused(copy, r"no features of 'valid' there \(only of train\)")
    copy = copy_features(stored, tmp_path / "files")
    edit_meta(copy, lambda meta: meta["subsets"]["valid"]["files"].update({"valid.de-en.en.bin": "0" * 64}))
    refused(copy, rf"'valid' in {re.escape(stored.data)} is not the data they were made from "
                  r"\(valid.de-en.en.bin: not the file they were made from\)")
    with open(f"{copy}/meta.json", "w") as f:
        f.write("{cut")
    refused(copy, r"\S+meta.json is not the meta.json scripts/store_features.py .* writes \(JSONDecodeError")
    copy = copy_features(stored, tmp_path / "rows")
    rows = np.load(f"{copy}/valid.decoder.npy")
    np.save(f"{copy}/valid.decoder.npy", rows[:-2])
    refused(copy, rf"valid.decoder.npy holds float32 rows \({rows.shape[0] - 2}, 16\), not float32 \({rows.shape[0]}, 16\)")
    os.remove(f"{copy}/valid.decoder.npy")
    refused(copy, r"cannot read valid.decoder.npy")
    task, _ = heads_task(stored, "--freeze-base", "--stored-features", stored.features)
    task.cfg.data = f"{stored.data}:{stored.data}"
    with pytest.raises(BlockwiseRequestError, match="^--stored-features reads the features of one data directory"):
        task.load_dataset("train")
    copy = copy_features(stored, tmp_path / "sizes")
    offsets = np.load(f"{copy}/valid.offsets.npy")
    np.save(f"{copy}/valid.offsets.npy", offsets[:-1])
    refused(copy, "'valid' has 20 sentences here, 19 stored")
    offsets[5:, 1] += 1  # sentence 4's target one longer
    np.save(f"{copy}/valid.offsets.npy", offsets)
    refused(copy, r"sentence 4 of 'valid' has \d+ source and (\d+) target tokens here, \d+ and (?!\1)\d+ stored")
    # Flags that change the data's sentences, and the other direction of the same files, are named.
    for flag in (["--truncate-source"], ["--num-batch-buckets", "2"]):
        task, _ = heads_task(stored, "--freeze-base", *flag)
        with pytest.raises(BlockwiseRequestError, match=f"^--stored-features cannot be used with {flag[0]}: "):
            task.load_dataset("valid")
    task, _ = heads_task(stored, "--freeze-base", "--source-lang", "en", "--target-lang", "de")
    with pytest.raises(BlockwiseRequestError, match=r"^--stored-features \S+: they were made for de-en \(the base's "
                                                    r"direction\), and this run trains en-de: train with "
                                                    "--source-lang de --target-lang en$"):
        task.load_dataset("valid")


def test_a_base_trained_with_truncate_source_or_batch_buckets_stores_the_sentences_as_held(stored, tmp_path):
    """store_features.py reads the data as training with --stored-features does, whatever
    the base's own task settings: fairseq's sizes under either flag are not the sentences'."""
    state = torch.load(stored.base, map_location="cpu", weights_only=False)
    state["cfg"]["task"]["truncate_source"], state["cfg"]["task"]["num_batch_buckets"] = True, 2
    base = str(tmp_path / "base.pt")
    torch.save(state, base)
    store(stored.data, base, str(tmp_path / "features"), "--subsets", "valid", "--max-tokens", "300")
    np.testing.assert_array_equal(np.load(tmp_path / "features" / "valid.offsets.npy"),
                                  np.load(f"{stored.features}/valid.offsets.npy"))
    np.testing.assert_allclose(np.load(tmp_path / "features" / "valid.decoder.npy"),
                               np.load(f"{stored.features}/valid.decoder.npy"), atol=1e-6, rtol=1e-6)


def test_sentences_too_long_for_the_base_are_named(stored, tmp_path, monkeypatch):
    """A sentence longer than the base's positions has no stored rows: the entry names it, and
    a batch holding it is refused."""
    model, task, _ = load(stored.base, stored.data)
    monkeypatch.setattr(model, "max_positions", lambda: (5, 5))
    entry = store_subset(model.float(), task, "valid", str(tmp_path), 4096)
    dataset = task.dataset("valid")
    long = [i for i in range(len(dataset)) if max(dataset.size(i)) > 5]
    assert long and entry["unstored"] == long
    offsets = np.load(tmp_path / "valid.offsets.npy")
    decoder = np.load(tmp_path / "valid.decoder.npy")
    assert not decoder[offsets[long[0], 1]:offsets[long[0] + 1, 1]].any()
    (tmp_path / "meta.json").write_text(json.dumps({"subsets": {"valid": entry}, "encoder_dim": 16, "decoder_dim": 16}))
    wrapped = StoredFeatures(str(tmp_path)).wrap("valid", dataset, stored.data, ("de", "en"), False)
    wrapped.collater([wrapped[i] for i in range(len(dataset)) if i not in long])
    with pytest.raises(BlockwiseRequestError, match=f"sentence {long[0]} of 'valid' was too long"):
        wrapped.collater([wrapped[long[0]]])


def test_the_flag_is_the_tasks_alone():
    """--stored-features is one option of the task, in training's and decoding's parsers alike."""
    for parser, extra in ((options.get_training_parser(), ["--arch", "transformer_blockwise"]),
                          (options.get_generation_parser(), [])):
        argv = ["data", "--user-dir", PLUGIN, "--task", "translation_blockwise", *extra]
        args = options.parse_args_and_arch(parser, argv)
        assert args.stored_features is None
        assert [a.dest for a in parser._actions].count("stored_features") == 1


def test_heads_train_through_train_heads_sh(stored, tmp_path):
    """scripts/train_heads.sh frozen --stored-features: the base is the checkpoint's, unchanged,
    the heads train, --eval-bleu decodes, and the saved checkpoint loads without the directory
    and, as a base itself (a transformer_blockwise checkpoint), stores the same features."""
    script = os.path.join(ROOT, "scripts", "train_heads.sh")
    tiny = [*BASE[2:], *QUIET, "--max-tokens", "300", "--log-interval", "1"]
    save = tmp_path / "heads"
    log = finish(subprocess.Popen(
        [script, stored.data, stored.base, str(save), "3", "frozen", *tiny, "--head-type", "draft",
         "--stored-features", stored.features, "--max-update", "4", "--eval-bleu", "--eval-bleu-args", '{"beam": 1}'],
        env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert "the first batch's stored features are the base's own" in log and "| bleu " in log
    base, trained = torch.load(stored.base)["model"], torch.load(save / "checkpoint_last.pt")["model"]
    for key, value in base.items():
        assert torch.equal(trained[key], value), key
    assert trained["decoder.heads.fc_out.weight"].abs().sum() > 0  # zero at the start
    _, _, task = checkpoint_utils.load_model_ensemble_and_task([str(save / "checkpoint_last.pt")],
                                                                arg_overrides={"data": stored.data})
    assert task.cfg.stored_features is None
    store(stored.data, str(save / "checkpoint_last.pt"), str(tmp_path / "again"), "--subsets", "valid")
    for side in ("encoder", "decoder"):
        np.testing.assert_allclose(np.load(tmp_path / "again" / f"valid.{side}.npy"),
                                   np.load(f"{stored.features}/valid.{side}.npy"), atol=1e-6, rtol=1e-6)
    # A refusal made during training reads as one line.
    shutil.rmtree(save)
    copy = copy_features(stored, tmp_path)
    for side in ("encoder", "decoder"):
        rows = np.load(f"{copy}/train.{side}.npy")
        np.save(f"{copy}/train.{side}.npy", rows + 1)
    stale = subprocess.run([script, stored.data, stored.base, str(save), "3", "frozen", *tiny,
                            "--stored-features", copy, "--max-update", "4"],
                           env=ENV, text=True, capture_output=True)
    assert stale.returncode == 1
    assert stale.stderr.splitlines()[-1].startswith(f"error: --stored-features {copy}: they differ from this base's")


def test_a_second_run_keeps_what_is_stored_and_stores_again_for_other_files(stored, tmp_path, capsys):
    copy = copy_features(stored, tmp_path)
    before = os.path.getmtime(os.path.join(copy, "train.decoder.npy"))
    store(stored.data, stored.base, copy, "--max-tokens", "300")
    assert capsys.readouterr().out.count("kept (stored from this checkpoint and these files)") == 2
    assert os.path.getmtime(os.path.join(copy, "train.decoder.npy")) == before
    edit_meta(copy, lambda meta: meta["subsets"]["valid"]["files"].update({"valid.de-en.de.bin": 1}))
    store(stored.data, stored.base, copy, "--max-tokens", "300")
    out = capsys.readouterr().out
    assert "train: kept" in out and "valid: kept" not in out and "valid: " in out
    metas = []
    for directory in (copy, stored.features):
        with open(os.path.join(directory, "meta.json")) as f:
            metas.append(json.load(f)["subsets"]["valid"]["files"])
    assert metas[0] == metas[1]  # stored again from the files as they are


def test_recipe_draft_stores_the_features_once_and_trains_on_them(stored, tmp_path):
    """scripts/recipe_draft.sh: FEATURES made from BASE on its first run, kept on the next,
    and its training reads them (the first batch checked against the base)."""
    env = {**ENV, "WORK": str(tmp_path), "BASE": stored.base, "DATA": stored.data, "SAVE": str(tmp_path / "draft"),
           "FEATURES": str(tmp_path / "features"), "HOURS": "1"}
    tiny = [*BASE[2:], *QUIET, "--max-tokens", "300", "--head-vocab", "0"]
    first = finish(subprocess.Popen([os.path.join(ROOT, "scripts", "recipe_draft.sh"), *tiny, "--max-update", "2"],
                                    env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert "train: kept" not in first and "the first batch's stored features are the base's own" in first
    again = finish(subprocess.Popen([os.path.join(ROOT, "scripts", "recipe_draft.sh"), *tiny, "--max-update", "3"],
                                    env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert "train: kept" in again and "valid: kept" in again
    assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", again)


def test_recipe_draft_anneals_the_whole_dictionary_step_over_full_updates(stored, tmp_path):
    """FULL_UPDATES=N: the second step's learning rate falls linearly to zero at update N,
    where that step stops; a FULL_UPDATES that is not a positive count, or that no second
    step or the flags given cannot take, is refused before anything runs."""
    env = {**ENV, "WORK": str(tmp_path), "BASE": stored.base, "DATA": stored.data, "SAVE": str(tmp_path / "draft"),
           "FEATURES": str(tmp_path / "features"), "HOURS": "1", "FULL_HOURS": "1"}
    recipe = os.path.join(ROOT, "scripts", "recipe_draft.sh")
    def refused(changes, *flags):
        run = subprocess.run([recipe, *flags], env={**env, **changes}, text=True, capture_output=True)
        assert run.returncode == 2 and not os.path.exists(tmp_path / "features")  # before anything ran
        return run.stderr

    for bad in ("0", "2.5", "x"):
        assert f"FULL_UPDATES must be a positive number of updates, not '{bad}'" in refused({"FULL_UPDATES": bad})
    assert "FULL_UPDATES anneals the second step, and FULL_HOURS=0 runs none" in refused(
        {"FULL_UPDATES": "3", "FULL_HOURS": "0"})
    assert "--warmup-init-lr does not combine with FULL_UPDATES" in refused(
        {"FULL_UPDATES": "3"}, "--warmup-init-lr", "1e-7")
    tiny = [*BASE[2:], *QUIET, "--max-tokens", "300", "--head-vocab", "0", "--warmup-updates", "1"]
    log = finish(subprocess.Popen([recipe, *tiny, "--max-update", "2"], env={**env, "FULL_UPDATES": "3"},
                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert "done training" in log
    state = torch.load(str(tmp_path / "draft-full" / "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    scheduler = state["cfg"]["lr_scheduler"]
    assert scheduler["_name"] == "polynomial_decay" and scheduler["total_num_update"] == 3
    assert state["optimizer_history"][-1]["num_updates"] == 3
    assert [group["lr"] for group in state["last_optimizer_state"]["param_groups"]] == [0.0]


def test_a_failed_or_partial_store_leaves_the_other_subsets_usable(stored, tmp_path, capsys):
    copy = copy_features(stored, tmp_path)
    with pytest.raises(SystemExit, match="^error: test: "):
        store(stored.data, stored.base, copy, "--subsets", "test")
    with open(os.path.join(copy, "meta.json")) as f:
        assert sorted(json.load(f)["subsets"]) == ["train", "valid"]
    os.remove(os.path.join(copy, "train.decoder.npy"))  # a subset whose rows are gone is stored again
    store(stored.data, stored.base, copy, "--max-tokens", "300")
    out = capsys.readouterr().out
    assert "valid: kept" in out and "train: kept" not in out
    assert os.path.exists(os.path.join(copy, "train.decoder.npy"))
