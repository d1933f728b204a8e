"""End to end: fairseq-preprocess and fairseq-train with --user-dir on a tiny corpus, and the
checkpoints they write loading under torch's weights-only unpickler."""
import datetime
import io
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.distributed.utils import _split_tensors_from_obj
from omegaconf import DictConfig, OmegaConf

from conftest import PLUGIN

from fairseq_bpd.errors import CheckpointError
from fairseq_bpd.model import BlockwiseTransformerModel

BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = [
    "--source-lang", "de", "--target-lang", "en", "--share-all-embeddings",
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "500", "--max-epoch", "1",
    "--label-smoothing", "0.1", "--cpu", "--num-workers", "0", "--seed", "1",
    "--log-format", "simple", "--log-interval", "1", "--no-progress-bar", "--no-epoch-checkpoints",
]
BLOCKWISE = [
    "--user-dir", PLUGIN, "--task", "translation_blockwise", "--arch", "transformer_blockwise",
    "--block-size", "3", "--criterion", "blockwise_cross_entropy",
]


def write_corpus(directory, seed=0):
    """Pairs of 2-6 words whose translation is the reversed sentence."""
    rng = random.Random(seed)
    for split, n in (("train", 200), ("valid", 20)):
        with open(f"{directory}/{split}.de", "w") as de, open(f"{directory}/{split}.en", "w") as en:
            for _ in range(n):
                words = [f"w{rng.randrange(12)}" for _ in range(rng.randint(2, 6))]
                de.write(" ".join(words) + "\n")
                en.write(" ".join(reversed(words)) + "\n")


def fairseq(command, *args):
    return subprocess.Popen(
        [os.path.join(BIN, command), *args], env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def finish(process, timeout=300):
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0]
    assert process.returncode == 0, output[-3000:]
    return output


def binarised_corpus(root):
    """The test corpus, written and binarised with a joined dictionary under root/bin."""
    raw, data = root / "raw", str(root / "bin")
    raw.mkdir()
    write_corpus(raw)
    finish(fairseq(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
        "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--destdir", data,
        "--workers", "1",
    ))
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain transformer, a blockwise model, and heads trained on the frozen plain one."""
    root = tmp_path_factory.mktemp("train")
    data = binarised_corpus(root)
    base = fairseq(
        "fairseq-train", data, *TINY, "--task", "translation", "--arch", "transformer",
        "--criterion", "label_smoothed_cross_entropy", "--save-dir", f"{root}/base",
    )
    # --eval-bleu keeps numpy arrays in the checkpoint's meters: the allow-list must cover them.
    blockwise = fairseq(
        "fairseq-train", data, *TINY, *BLOCKWISE, "--save-dir", f"{root}/blockwise",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1}',
    )
    finish(base)
    heads = fairseq(
        "fairseq-train", data, *TINY, *BLOCKWISE, "--save-dir", f"{root}/heads",
        "--finetune-from-model", f"{root}/base/checkpoint_last.pt", "--freeze-base",
    )
    checkpoints = {run: f"{root}/{run}/checkpoint_last.pt" for run in ("base", "blockwise", "heads")}
    return {
        "root": root, "data": data, "blockwise_log": finish(blockwise), "heads_log": finish(heads),
        **checkpoints,
    }


def test_log_reports_every_head_and_the_block(runs):
    for log, subset in ((runs["blockwise_log"], "train"), (runs["blockwise_log"], "valid"), (runs["heads_log"], "valid")):
        line = re.search(rf"\| {subset} \| epoch 001 \|.*", log).group(0)
        for h in (1, 2, 3):
            assert f"| loss_h{h} " in line and f"| acc_h{h} " in line, line
        assert "loss_h4" not in line and "| ppl " in line
        assert 1 <= float(re.search(r"\| block ([\d.]+)", line).group(1)) <= 3, line
    assert "| bleu " in runs["blockwise_log"]


def test_frozen_training_says_head_1_is_not_computed(runs):
    """A frozen base's head 1 is a constant: its train lines give heads 2..k only, no made-up ppl."""
    log = runs["heads_log"]
    assert "head 1 is the frozen base: its loss is a constant, not computed in training" in log
    line = re.search(r"\| train \| epoch 001 \|.*", log).group(0)
    assert all(f"| loss_h{h} " in line and f"| acc_h{h} " in line for h in (2, 3)), line
    assert not any(f"| {key} " in line for key in ("loss_h1", "acc_h1", "nll_loss", "ppl", "block")), line


def test_checkpoint_loads_weights_only(runs):
    path = runs["blockwise"]
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    state = torch.load(path)  # weights_only=True, torch's default
    assert state["cfg"]["model"].arch == "transformer_blockwise"
    meters = state["extra_state"]["metrics"]["valid"]
    assert any(isinstance(v, np.ndarray) for _, _, _, meter in meters for v in meter.values())
    # Without the plugin's allow-list torch refuses the file: the test above means something.
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1])", path],
        env=ENV, capture_output=True, text=True,
    )
    assert bare.returncode != 0 and "argparse.Namespace" in bare.stderr


def test_checkpoint_from_before_head_vocab_loads(runs, tmp_path):
    state = torch.load(runs["blockwise"])
    del state["cfg"]["model"].head_vocab  # saved before the option existed
    old = tmp_path / "old.pt"
    torch.save(state, old)
    models, cfg = checkpoint_utils.load_model_ensemble([str(old)])
    assert models[0].decoder.head_vocab == 0 and cfg.model.head_vocab == 0


def test_checkpoint_loads_as_an_ensemble(runs):
    models, cfg = checkpoint_utils.load_model_ensemble([runs["blockwise"]])
    assert isinstance(models[0], BlockwiseTransformerModel)
    assert models[0].decoder.block_size == 3 and cfg.model.block_size == 3


def test_resume_broadcast_loads_weights_only(runs):
    """Ranks > 0 torch.load what rank 0 torch.save's in distributed_utils.broadcast_object."""
    state = checkpoint_utils.load_checkpoint_to_cpu(runs["blockwise"])
    assert isinstance(state["cfg"], DictConfig)
    buffer = io.BytesIO()
    torch.save(_split_tensors_from_obj(state, []), buffer)
    buffer.seek(0)
    received = torch.load(buffer, map_location="cpu")
    assert OmegaConf.to_container(received["cfg"]) == OmegaConf.to_container(state["cfg"])


def test_two_process_resume(runs):
    """The real broadcast: rank 0 reads checkpoint_last.pt, rank 1 receives it (gloo on CPU)."""
    save_dir = runs["root"] / "resume"
    save_dir.mkdir()
    shutil.copy(runs["blockwise"], save_dir / "checkpoint_last.pt")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    ranks = [
        fairseq(
            "fairseq-train", runs["data"], *TINY, *BLOCKWISE, "--save-dir", str(save_dir),
            "--eval-bleu", "--eval-bleu-args", '{"beam": 1}', "--max-epoch", "2",
            "--distributed-world-size", "2", "--distributed-rank", str(rank),
            "--distributed-init-method", f"tcp://localhost:{port}", "--distributed-no-spawn",
            "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
        )
        for rank in (0, 1)
    ]
    logs = [finish(rank) for rank in ranks]
    assert "Loaded checkpoint" in logs[0] and "| valid | epoch 002 |" in logs[0]


def test_truncated_checkpoint_is_named(runs):
    path = str(runs["root"] / "truncated.pt")
    with open(runs["blockwise"], "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    message = f"cannot read checkpoint {path}: the file is truncated or corrupt"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoint_utils.load_model_ensemble([path])
    # fairseq's CLIs reach the same loader.
    generate = subprocess.run(
        [os.path.join(BIN, "fairseq-generate"), runs["data"], "--user-dir", PLUGIN,
         "--task", "translation_blockwise", "--path", path, "--gen-subset", "valid", "--cpu"],
        env=ENV, capture_output=True, text=True,
    )
    assert generate.returncode != 0
    assert message in generate.stderr and "UnpicklingError" not in generate.stderr


def test_unknown_global_is_refused(runs):
    path = str(runs["root"] / "unsafe.pt")
    state = torch.load(runs["blockwise"])
    state["extra_state"]["saved_at"] = datetime.datetime(2018, 12, 3)
    torch.save(state, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)  # weights-only loading is still on
    with pytest.raises(CheckpointError) as refused:
        checkpoint_utils.load_model_ensemble([path])
    message = str(refused.value)
    assert path in message and "datetime.datetime" in message
    assert "torch.serialization.add_safe_globals([datetime.datetime])" in message


def test_heads_train_on_a_frozen_plain_transformer(runs):
    base, trained = torch.load(runs["base"])["model"], torch.load(runs["heads"])["model"]
    heads = {f"decoder.heads.{p}" for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    assert set(trained) - set(base) == heads
    assert f"num. trained: {sum(trained[key].numel() for key in heads):,})" in runs["heads_log"]
    for key, value in base.items():
        assert torch.equal(trained[key], value), key
    assert trained["decoder.heads.fc2.weight"].abs().sum() > 0  # initialised to zero, then trained
    common = ["--gen-subset", "valid", "--max-tokens", "500", "--cpu", "--num-workers", "0", "--beam", "1",
              "--required-batch-size-multiple", "1"]
    base_output = finish(fairseq("fairseq-generate", runs["data"], "--path", runs["base"], "--user-dir", PLUGIN, *common))
    heads_output = finish(fairseq("fairseq-generate", runs["data"], "--path", runs["heads"], "--user-dir", PLUGIN,
                                  "--task", "translation_blockwise", *common))

    def tokens(output):  # {sentence id: tokens} of fairseq's H- lines
        return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", output, re.M)}

    assert len(tokens(base_output)) == 20 and tokens(heads_output) == tokens(base_output)


def test_recipe_scripts_resume_their_checkpoints(tmp_path):
    """train_base.sh and train_heads.sh pick up checkpoint_last.pt under weights-only loading."""
    data = binarised_corpus(tmp_path)
    scripts = os.path.join(os.path.dirname(PLUGIN), "scripts")
    fast = ["--cpu", "--num-workers", "0", "--no-progress-bar", "--encoder-layers", "1", "--decoder-layers", "1"]

    def recipe(name, *args):
        return finish(subprocess.Popen([os.path.join(scripts, name), *args, *fast], env=ENV, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT))

    base = tmp_path / "base"
    for name, args in (("train_base.sh", (data, str(base))),
                       ("train_heads.sh", (data, str(base / "checkpoint_last.pt"), str(tmp_path / "heads"),
                                           "2", "frozen"))):
        recipe(name, *args, "--max-update", "1")
        resumed = recipe(name, *args, "--max-update", "2")
        assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ 1 updates\)", resumed), \
            (name, resumed[-2000:])


def test_recipe_finetunes_heads_with_head1_weight_7(tmp_path):
    """train_heads.sh finetune weighs head 1 seven times each other head (docs/speed.md), unless told otherwise."""
    data = binarised_corpus(tmp_path)
    script = os.path.join(os.path.dirname(PLUGIN), "scripts", "train_heads.sh")
    base = tmp_path / "base"
    subprocess.run([os.path.join(os.path.dirname(PLUGIN), "scripts", "train_base.sh"), data, str(base),
                    "--cpu", "--num-workers", "0", "--no-progress-bar", "--encoder-layers", "1",
                    "--decoder-layers", "1", "--max-update", "1"], env=ENV, check=True, capture_output=True)
    for save, extra, weight in (("default", [], 7.0), ("override", ["--head1-weight", "2"], 2.0)):
        subprocess.run([script, data, str(base / "checkpoint_last.pt"), str(tmp_path / save), "2", "finetune",
                        "--cpu", "--num-workers", "0", "--no-progress-bar", "--encoder-layers", "1",
                        "--decoder-layers", "1", "--max-update", "1", *extra],
                       env=ENV, check=True, capture_output=True)
        state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / save / "checkpoint_last.pt"))
        assert state["cfg"]["criterion"]["head1_weight"] == weight
