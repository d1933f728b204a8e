"""fairseq's own distributed training and resume, with the heads on a plain transformer,
frozen (--freeze-base) and fine-tuned: two ranks train in step, and a killed run resumes
exactly where its last checkpoint left it.

Resuming a two-process run (rank 0 reads checkpoint_last.pt, rank 1 receives it) is
test_train.test_two_process_resume.
"""
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
from fairseq import checkpoint_utils

from test_train import BLOCKWISE, ENV, TINY, binarised_corpus, fairseq, finish

from fairseq_bpd.errors import CheckpointError

MODES = {"frozen": ["--freeze-base"], "finetuned": []}
HEADS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
# fairseq saves on rank 0 only, so no file shows what rank 1 trained. This runs
# fairseq-train's own entry point with its checkpoint writer wrapped: after each save
# every rank also writes its parameters to SAVE_DIR/rank{R}.pt.
EVERY_RANK_SAVES = """
import sys
from fairseq_cli import train  # first: it sets up logging as fairseq-train does
import torch
from fairseq import checkpoint_utils

fairseq_save_checkpoint = checkpoint_utils.save_checkpoint

def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
    saved = fairseq_save_checkpoint(cfg, trainer, epoch_itr, val_loss)
    state = {"model": trainer.get_model().state_dict(), "num_updates": trainer.get_num_updates()}
    torch.save(state, f"{cfg.save_dir}/rank{trainer.data_parallel_rank}.pt")
    return saved

checkpoint_utils.save_checkpoint = save_checkpoint
sys.argv[0] = "fairseq-train"
train.cli_main()
"""
# Dies as a kill during the copy of checkpoint_1_8.pt to checkpoint_last.pt would leave
# it: half of the bytes written, then SIGKILL.
KILLED_WHILE_COPYING = """
import os, shutil, signal, sys
from fairseq_cli import train

fairseq_copyfile = shutil.copyfile

def copyfile(src, dst, **kwargs):
    if src.endswith("checkpoint_1_8.pt") and "checkpoint_last.pt" in dst:
        with open(src, "rb") as whole, open(dst, "wb") as part:
            part.write(whole.read()[: os.path.getsize(src) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return fairseq_copyfile(src, dst, **kwargs)

shutil.copyfile = copyfile
sys.argv[0] = "fairseq-train"
train.cli_main()
"""

# Every rank writes each micro-batch's logging output, as the criterion returned it, to
# OUT/rank{R}.jsonl: what the training log's sums over micro-batches and ranks must equal.
EVERY_RANK_RECORDS = """
import json, sys
from fairseq_cli import train
import torch
from fairseq.tasks.fairseq_task import FairseqTask

out = sys.argv.pop(1)
fairseq_train_step = FairseqTask.train_step

def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
    result = fairseq_train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad)
    log = {key: float(value) for key, value in result[2].items()}
    with open(f"{out}/rank{torch.distributed.get_rank()}.jsonl", "a") as f:
        f.write(json.dumps({"update": update_num + 1, "dummy": ignore_grad, "log": log}) + "\\n")
    return result

FairseqTask.train_step = train_step
sys.argv[0] = "fairseq-train"
train.cli_main()
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A plain transformer checkpoint and the binarised corpus it was trained on."""
    root = tmp_path_factory.mktemp("distributed")
    data = binarised_corpus(root)
    finish(fairseq(
        "fairseq-train", data, *TINY, "--task", "translation", "--arch", "transformer",
        "--criterion", "label_smoothed_cross_entropy", "--save-dir", f"{root}/base",
    ))
    return {"data": data, "checkpoint": f"{root}/base/checkpoint_last.pt"}


def heads_command(base, mode, save_dir, *extra):
    """fairseq-train's arguments for heads on the base; small batches, so an epoch is 18 updates."""
    return [
        base["data"], *TINY, *BLOCKWISE, "--finetune-from-model", base["checkpoint"], *MODES[mode],
        "--save-dir", str(save_dir), "--max-tokens", "60", *extra,
    ]


def python(script, *args):
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def finish_ranks(ranks):
    """Every rank's log; when one fails, the others, left waiting for it, are killed."""
    try:
        return [finish(rank) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()


def valid_losses(log):
    """{epoch: {"loss_h1": ..., ...}} from fairseq's end-of-epoch validation lines."""
    losses = {}
    for epoch, fields in re.findall(r"epoch (\d+) \| valid on 'valid' subset \|(.*)", log):
        losses[int(epoch)] = {k: float(v) for k, v in re.findall(r"(loss_h\d+) ([\d.]+)", fields)}
    return losses


def assert_same(state, reference, keys=None):
    for key in keys or reference:
        assert torch.equal(state[key], reference[key]), key


def assert_heads_trained(model):
    # fc2 starts at zero (every head a copy of head 1): nonzero means the heads learned.
    assert model["decoder.heads.fc2.weight"].abs().sum() > 0
    assert model["decoder.heads.fc2.bias"].abs().sum() > 0


def assert_base(model, base, mode):
    """Frozen: every base parameter as in the base checkpoint; fine-tuned: trained too."""
    base = torch.load(base["checkpoint"])["model"]
    assert set(model) - set(base) == {f"decoder.heads.{p}" for p in HEADS}
    unchanged = [key for key in base if torch.equal(model[key], base[key])]
    if mode == "frozen":
        assert unchanged == list(base)
    else:
        assert "decoder.layers.0.fc1.weight" not in unchanged


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_train_in_step(base, tmp_path, mode):
    """Explicit ranks on CPU: gloo, legacy_ddp, one process per rank (no spawn)."""
    port = free_port()
    ranks = [
        python(EVERY_RANK_SAVES, *heads_command(
            base, mode, tmp_path, "--max-epoch", "4",
            "--distributed-world-size", "2", "--distributed-rank", str(rank),
            "--distributed-init-method", f"tcp://localhost:{port}", "--distributed-no-spawn",
            "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
        ))
        for rank in (0, 1)
    ]
    log = finish_ranks(ranks)[0]
    assert "training on 2 devices" in log
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    # Each rank trained on its half of every epoch: 9 of the 18 batches.
    assert rank0["num_updates"] == rank1["num_updates"] == 36
    assert_same(rank1["model"], rank0["model"])
    assert_same(torch.load(tmp_path / "checkpoint_last.pt")["model"], rank0["model"])
    assert_heads_trained(rank1["model"])
    assert_base(rank1["model"], base, mode)
    # Validation on the same sentences after every epoch: the heads' loss falls.
    losses = valid_losses(log)
    assert sorted(losses) == [1, 2, 3, 4]
    for head in ("loss_h2", "loss_h3"):
        assert losses[4][head] < losses[1][head], (head, losses)
    if mode == "frozen":  # head 1 is the frozen base's own output
        assert len({losses[epoch]["loss_h1"] for epoch in losses}) == 1, losses


CHECKPOINT_EVERY_4 = ["--save-interval-updates", "4", "--max-update", "12", "--disable-validation"]


def updates(log):
    return [int(n) for n in re.findall(r"num_updates=(\d+),", log)]


def killed(process, after_update, timeout=120):
    """SIGKILL a fairseq-train once it logs `after_update`; its log up to there."""
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f"num_updates={after_update}," in line:
            process.send_signal(signal.SIGKILL)
            break
    watchdog.cancel()
    process.communicate()
    log = "".join(lines)
    assert process.returncode == -signal.SIGKILL and updates(log)[-1] == after_update, log[-3000:]
    return log


def assert_resumed_from(save_dir, log, num_updates):
    """The restart read checkpoint_last.pt, not the base, and took up at the next update."""
    assert f"Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch 1 @ {num_updates} updates)" in log
    assert "loading pretrained model" not in log
    assert updates(log)[0] == num_updates + 1


def assert_checkpoints_load(save_dir):
    """Every checkpoint a killed run left loads (weights-only, under the plugin's allow-list)."""
    for name in os.listdir(save_dir):
        if name.endswith(".pt"):
            torch.load(save_dir / name)


@pytest.mark.parametrize("mode", MODES)
def test_killed_run_resumes_where_it_stopped(base, tmp_path, mode):
    """Killed mid-epoch after the checkpoint at update 4, restarted with the same command,
    the run ends with the model and optimizer an uninterrupted run ends with."""
    command = heads_command(base, mode, tmp_path / "run", *CHECKPOINT_EVERY_4)
    uninterrupted = fairseq(
        "fairseq-train", *heads_command(base, mode, tmp_path / "uninterrupted", *CHECKPOINT_EVERY_4))
    log = killed(fairseq("fairseq-train", *command), after_update=5)
    assert f"Saved checkpoint {tmp_path}/run/checkpoint_1_4.pt" in log
    assert_checkpoints_load(tmp_path / "run")
    state = torch.load(tmp_path / "run" / "checkpoint_last.pt")
    assert state["optimizer_history"][-1]["num_updates"] == 4
    assert state["extra_state"]["train_iterator"]["iterations_in_epoch"] == 4  # of 18

    log = finish(fairseq("fairseq-train", *command))
    assert_resumed_from(tmp_path / "run", log, 4)
    finish(uninterrupted)
    resumed = torch.load(tmp_path / "run" / "checkpoint_last.pt")
    reference = torch.load(tmp_path / "uninterrupted" / "checkpoint_last.pt")
    assert resumed["optimizer_history"][-1]["num_updates"] == 12
    assert_same(resumed["model"], reference["model"])
    optimizer = resumed["last_optimizer_state"]["state"]
    # Adam's moments went on from the checkpoint's: 12 steps, not the 8 since the restart.
    assert {s["step"] for s in optimizer.values()} == {12}
    for i, moments in optimizer.items():
        assert_same(moments, reference["last_optimizer_state"]["state"][i], ["exp_avg", "exp_avg_sq"])
    assert (len(optimizer) == len(HEADS)) == (mode == "frozen")  # only the heads are trained
    assert_heads_trained(resumed["model"])
    assert_base(resumed["model"], base, mode)


def test_killed_while_copying_checkpoint_last(base, tmp_path):
    """fairseq copies each save to checkpoint_last.pt; the plugin makes the copy atomic."""
    command = heads_command(base, "frozen", tmp_path, *CHECKPOINT_EVERY_4)
    process = python(KILLED_WHILE_COPYING, *command)
    log = process.communicate(timeout=120)[0]
    assert process.returncode == -signal.SIGKILL, log[-3000:]
    assert f"Saved checkpoint {tmp_path}/checkpoint_1_4.pt" in log
    assert f"Saved checkpoint {tmp_path}/checkpoint_1_8.pt" not in log
    assert_checkpoints_load(tmp_path)
    assert torch.load(tmp_path / "checkpoint_last.pt")["optimizer_history"][-1]["num_updates"] == 4
    assert_resumed_from(tmp_path, finish(fairseq("fairseq-train", *command)), 4)


def test_checkpoint_cut_anywhere_is_named(base, tmp_path):
    """What a full disk or a kill outside fairseq's writes leaves: the loader names the file.
    (Cut at some lengths, torch's reader raises a bare OSError: [Errno 22].)"""
    with open(base["checkpoint"], "rb") as f:
        whole = f.read()
    path = str(tmp_path / "checkpoint_last.pt")
    for tenth in range(1, 10):
        with open(path, "wb") as f:
            f.write(whole[: len(whole) * tenth // 10])
        message = f"cannot read checkpoint {path}: the file is truncated or corrupt"
        with pytest.raises(CheckpointError, match=f"^{re.escape(message)}"):
            checkpoint_utils.load_checkpoint_to_cpu(path)


def two_ranks(script, *args):
    """Ranks 0 and 1 on CPU: gloo, legacy_ddp, one process per rank (no spawn)."""
    port = free_port()
    return [
        python(script, *args, "--distributed-world-size", "2", "--distributed-rank", str(rank),
               "--distributed-init-method", f"tcp://localhost:{port}", "--distributed-no-spawn",
               "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp")
        for rank in (0, 1)
    ]


def train_inner(log):
    """{update: {metric: value}} from fairseq's per-update training lines (--log-interval 1)."""
    found = {}
    for fields in re.findall(r"\| epoch \d+:\s+\d+ / \d+ (.*)", log):
        values = dict(re.findall(r"(\w+)=([-\d.]+)", fields))
        found[int(values["num_updates"])] = {key: float(value) for key, value in values.items()}
    return found


def test_random_head_logs_the_sum_over_ranks_and_micro_batches(base, tmp_path):
    """--random-head with --update-freq 2 on two ranks: each micro-batch trains its own head,
    and the log shows, per head, what all four computed together."""
    ranks = two_ranks(EVERY_RANK_RECORDS, str(tmp_path), *heads_command(
        base, "finetuned", tmp_path, "--random-head", "--report-accuracy", "--update-freq", "2",
        "--max-update", "4", "--disable-validation",
    ))
    log = finish_ranks(ranks)[0]
    logged = train_inner(log)
    assert sorted(logged) == [1, 2, 3, 4], log[-3000:]
    computed = [json.loads(line) for rank in (0, 1) for line in open(tmp_path / f"rank{rank}.jsonl")]
    assert not any(record["dummy"] for record in computed)
    mixed = 0
    for update, metrics in logged.items():
        logs = [record["log"] for record in computed if record["update"] == update]
        assert len(logs) == 4  # 2 ranks x 2 micro-batches

        def total(key):
            return sum(log.get(key, 0) for log in logs)

        drawn = {h for h in (1, 2, 3) if total(f"ntokens_h{h}") > 0}
        mixed += len(drawn) > 1
        assert {key for key in metrics if key.startswith("loss_h")} == {f"loss_h{h}" for h in drawn}
        for h in drawn:
            loss = total(f"loss_h{h}") / total(f"ntokens_h{h}") / math.log(2)
            assert metrics[f"loss_h{h}"] == pytest.approx(loss, abs=1e-3), (update, h)
            accuracy = 100 * total(f"n_correct_h{h}") / total(f"total_h{h}")
            assert metrics[f"acc_h{h}"] == pytest.approx(accuracy, abs=1e-2), (update, h)
        # fairseq's own accuracy is head 1's on every batch, whichever head was trained.
        assert metrics["accuracy"] == pytest.approx(100 * total("n_correct") / total("total"), abs=1e-3)
    assert mixed > 0  # some update trained more than one head
