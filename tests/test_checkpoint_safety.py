"""A checkpoint made to run code when loaded is refused, in torch's zip format and in the
old (torch < 1.6) one alike, by a message naming what it holds."""
import os
import re

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_bpd.checkpoint_safety import CheckpointError


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
