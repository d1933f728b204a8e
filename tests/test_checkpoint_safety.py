"""A checkpoint made to run code when loaded is refused, in torch's zip format and in the
old (torch < 1.6) one alike, by a message naming what it holds."""
import os
import re

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_bpd.errors import CheckpointError


class RunsACommand:
    """Unpickled, it would call os.system (posix.system): what a malicious checkpoint holds."""

    def __reduce__(self):
        return os.system, ("touch pwned",)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "old"])
def test_malicious_checkpoint_names_the_blocked_global(tmp_path, zip_format, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save({"model": {}, "payload": RunsACommand()}, path,
               _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    message = str(refused.value)
    assert message.startswith(f"refusing to load checkpoint {path}: it holds posix.system, "), message
    assert "truncated or corrupt" not in message
    # torch blocks os/posix outright: allow-listing cannot help, and is not advised.
    assert "whatever the allow-list" in message and "add_safe_globals" not in message
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "old"])
def test_unknown_global_in_either_format_is_named(tmp_path, zip_format):
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save({"model": {}, "saved_by": re.compile("x")}, path,
               _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    message = str(refused.value)
    assert "it holds re._compile" in message, message
    assert "torch.serialization.add_safe_globals([re._compile])" in message


@pytest.mark.parametrize("contents, holds", [
    ([1, 2], "a list"),
    (torch.zeros(3), "a Tensor"),
    ({"model": {"w": torch.zeros(2)}}, "a dict of 'model'"),  # weights without the configuration
    ({f"layer{i}.weight": torch.zeros(1) for i in range(7)}, "a dict of 'layer0.weight', "),
])
def test_what_torch_saved_but_is_no_checkpoint_is_named(tmp_path, contents, holds):
    """Was: TypeError (list indices must be integers), RuntimeError (Tensor.__contains__),
    KeyError 'best_loss': fairseq's own errors, naming neither the file nor the cause."""
    path = str(tmp_path / "checkpoint.pt")
    torch.save(contents, path)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_utils.load_checkpoint_to_cpu(path)
    message = str(refused.value)
    assert message.startswith(f"cannot load checkpoint {path}: it is not a fairseq checkpoint "
                              f"(it holds {holds}"), message


def test_old_format_cut_after_one_byte_is_corrupt(tmp_path):
    """Was: a bare IndexError (index out of range) from torch's unpickler."""
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "cfg": None}, str(path), _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:1])
    with pytest.raises(CheckpointError, match=r"the file is truncated or corrupt.*IndexError"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_fairseqs_own_errors_on_a_checkpoint_pass_through(tmp_path):
    """A dict of 'model' and 'cfg' is a checkpoint: what fairseq then fails on is its own error."""
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"model": {"w": torch.ones(2)}, "cfg": None, "best_loss": 1.0}, path)
    with pytest.raises(KeyError, match="optimizer"):  # fairseq's upgrade of a pre-0.6 layout
        checkpoint_utils.load_checkpoint_to_cpu(path)
