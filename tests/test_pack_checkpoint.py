"""scripts/pack_checkpoint.py: 4-bit weights that unpack within a quantization step (the
proposal heads' in 8 bits with --head-bits 8), shared tensors stored once, and --head-vocab
recorded as the packed model's shortlist."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from pack_checkpoint import GROUP, HEADS, pack, unpack  # noqa: E402


def checkpoint(path, head_vocab=0):
    torch.manual_seed(0)
    embed = torch.randn(40, 2 * GROUP)
    state = {"model": {"decoder.embed_tokens.weight": embed, "decoder.output_projection.weight": embed, "fc": torch.randn(8, GROUP), "bias": torch.randn(8)},
             "cfg": {"model": argparse.Namespace(head_vocab=head_vocab, block_size=8)},
             "optimizer_history": [], "last_optimizer_state": {"exp_avg": torch.randn(3)}}
    torch.save(state, path)
    return state


def test_packing_keeps_the_weights_and_records_the_shortlist(tmp_path):
    original = checkpoint(tmp_path / "full.pt")
    for head_vocab, wanted in ((None, 0), (30, 30)):
        pack(tmp_path / "full.pt", tmp_path / "packed.pt", head_vocab)
        unpack(tmp_path / "packed.pt", str(tmp_path / "restored.pt"))
        restored = torch.load(tmp_path / "restored.pt", weights_only=False)
        assert restored["cfg"]["model"].head_vocab == wanted and restored["cfg"]["model"].block_size == 8
        model = restored["model"]
        embed = model["decoder.embed_tokens.weight"]
        assert model["decoder.output_projection.weight"] is embed  # stored once, one tensor again
        for name in ("decoder.embed_tokens.weight", "fc"):
            step = original["model"][name].abs().view(-1, GROUP).amax(dim=1) / 7  # one 4-bit step per group
            error = (model[name] - original["model"][name]).abs().view(-1, GROUP).amax(dim=1)
            assert bool((error <= step * 0.5 + 1e-3).all()) and bool(error.gt(0).any())
        assert torch.allclose(model["bias"], original["model"]["bias"], atol=1e-2)  # float16
        assert restored["last_optimizer_state"] is None
    assert torch.load(tmp_path / "full.pt", weights_only=False)["cfg"]["model"].head_vocab == 0  # source untouched


def test_head_bits_8_keeps_the_heads_within_an_8_bit_step(tmp_path):
    """--head-bits 8: the heads' matrices within half an 8-bit step of their group's largest
    weight (and its float16 scale's rounding), the base's still 4-bit (off by more than that somewhere)."""
    original = checkpoint(tmp_path / "full.pt")
    head = HEADS + "fc_in.weight"
    original["model"][head] = torch.randn(16, GROUP)
    torch.save(original, tmp_path / "full.pt")

    def errors(name):  # a group's largest error, in 8-bit steps of that group
        step = original["model"][name].abs().view(-1, GROUP).amax(dim=1) / 127
        return (model[name] - original["model"][name]).abs().view(-1, GROUP).amax(dim=1) / step

    for bits in (4, 8):
        pack(tmp_path / "full.pt", tmp_path / "packed.pt", head_bits=bits)
        unpack(tmp_path / "packed.pt", str(tmp_path / "restored.pt"))
        model = torch.load(tmp_path / "restored.pt", weights_only=False)["model"]
        assert bool(errors("fc").le(127 / 7 / 2 + 0.1).all()) and bool(errors("fc").gt(0.6).any())
        if bits == 8:
            assert bool(errors(head).le(0.5 + 0.07).all())
        else:
            assert bool(errors(head).gt(0.6).any())
    with pytest.raises(ValueError, match="head_bits must be 4 or 8"):
        pack(tmp_path / "full.pt", tmp_path / "other.pt", head_bits=6)


def test_a_tensor_the_heads_share_with_the_base_keeps_4_bits(tmp_path):
    """Stored once for all its names, a tensor tied between the heads and the base keeps the
    base's 4 bits under --head-bits 8, whichever name comes first."""
    original = checkpoint(tmp_path / "full.pt")
    tied = original["model"]["fc"]
    for first, second in ((HEADS + "fc", "fc"), ("fc", HEADS + "fc")):
        model = dict(original["model"])
        model.pop("fc")
        model[first] = model[second] = tied
        torch.save({**original, "model": model}, tmp_path / "tied.pt")
        pack(tmp_path / "tied.pt", tmp_path / "packed.pt", head_bits=8)
        stored = torch.load(tmp_path / "packed.pt", weights_only=False)["packed_model"]
        assert "int4" in stored[first] and stored[second] == {"same_as": first}


def test_the_script_refuses_a_misplaced_head_vocab(tmp_path):
    checkpoint(tmp_path / "full.pt")
    script = [sys.executable, os.path.join(ROOT, "scripts", "pack_checkpoint.py")]
    for argv in (["unpack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-vocab", "5"],
                 ["pack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-vocab", "-1"],
                 ["pack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-vocab", "41"],  # past the 40 entries
                 ["pack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-vocab", "3"]):  # a special symbol
        done = subprocess.run([*script, *map(str, argv)], capture_output=True, text=True)
        assert done.returncode != 0 and "--head-vocab" in done.stderr and not (tmp_path / "x.pt").exists()
    for argv in (["unpack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-bits", "8"],
                 ["pack", tmp_path / "full.pt", tmp_path / "x.pt", "--head-bits", "6"]):
        done = subprocess.run([*script, *map(str, argv)], capture_output=True, text=True)
        assert done.returncode != 0 and "--head-bits" in done.stderr and not (tmp_path / "x.pt").exists()
    done = subprocess.run([*script, "pack", str(tmp_path / "missing.pt"), str(tmp_path / "x.pt")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "missing.pt" in done.stderr


def test_loading_a_packed_file_says_to_unpack_it(tmp_path):
    """fairseq's loader would end in a bare KeyError: 'model'."""
    import fairseq_bpd  # noqa: F401 (its loader)
    from fairseq import checkpoint_utils
    from fairseq_bpd.errors import CheckpointError

    checkpoint(tmp_path / "full.pt")
    pack(tmp_path / "full.pt", tmp_path / "packed.pt")
    with pytest.raises(CheckpointError, match=r"packed\.pt is a packed checkpoint .*pack_checkpoint\.py unpack"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "packed.pt"))
