"""The lean pass's compiled kernels (fairseq_bpd/kernels.py, csrc/lean.cpp) against torch's
own operations, and decoding without them (turned off, or not buildable) giving the same
tokens."""
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import build, random_sample
from test_generator import blockwise, greedy

from fairseq_bpd import kernels
from fairseq_bpd.generator import BlockwiseGenerator, fix_nan

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture
def kern():
    module = kernels.module()
    assert module is not None  # they build on this machine (and CI's): a fallback would hide a failure
    return module


def strided_queries(batch, heads, n, d, dtype):
    """q as the lean pass gives it: heads' columns of a wider B*n x 3C product (a strided view)."""
    product = torch.randn(batch * n, 3 * heads * d, dtype=dtype)
    step = product.stride(0)
    return product.as_strided((batch, heads, n, d), (n * step, d, step, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 4, 1, 30), (1, 4, 4, 17), (3, 2, 2, 9), (32, 4, 8, 60)])  # the last: torch's kernel
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool", "per_row"])
def test_attend_is_torchs_attention(kern, dtype, shape, mask_kind):
    torch.manual_seed(sum(shape))
    batch, heads, n, keys = shape
    d = 8
    q = strided_queries(batch, heads, n, d, dtype)
    k, v = torch.randn(2, batch, heads, keys + 3, d, dtype=dtype)[:, :, :, :keys].unbind(0)  # columns past T unread
    mask = None
    if mask_kind == "additive":
        mask = torch.zeros(n, keys, dtype=dtype)
        mask[:, -2:] = -math.inf
    elif mask_kind == "bool":
        mask = torch.rand(n, keys) > 0.3
        mask[:, 0] = True
    elif mask_kind == "per_row":
        mask = torch.zeros(batch, 1, n, keys, dtype=dtype)
        mask[0, :, :, keys // 2:] = -math.inf
    scale = 0.25 if mask_kind == "bool" else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
    out = kern.attend(q, k, v, mask, scale)
    assert out.shape == (batch, n, heads, d)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert out.reshape(batch * n, heads * d).data_ptr() == out.data_ptr()


def test_a_row_with_every_key_masked_gets_zeros_as_torchs(kern):
    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 3, 4)
    mask = torch.zeros(2, 3)
    mask[0] = -math.inf
    out = kern.attend(q, k, k, mask, 1.0)
    assert torch.equal(out[0, 0], torch.zeros(2, 4))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=1.0).transpose(1, 2))


def test_attend_refuses_what_it_does_not_compute(kern):
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="one dtype"):
        kern.attend(q, q.double(), q.double(), None, 1.0)
    with pytest.raises(RuntimeError, match="contiguous vectors"):
        kern.attend(q.transpose(2, 3), q.transpose(2, 3), q.transpose(2, 3), None, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 5, 96])  # 96 x 256: torch's add and norm
@pytest.mark.parametrize("pre", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_residual_norm_is_the_sum_and_its_layer_norm(kern, dtype, rows, pre, affine):
    torch.manual_seed(rows)
    c = 256
    x, y = torch.randn(rows, c, dtype=dtype), torch.randn(rows, c, dtype=dtype)
    weight, bias = (torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)) if affine else (None, None)
    total = x + y
    expected = F.layer_norm(total, (c,), weight, bias, 1e-5)
    target = y.clone()
    out = kern.residual_norm(x, target, weight, bias, 1e-5, pre)
    tolerance = dict(rtol=TOLERANCE[dtype], atol=10 * TOLERANCE[dtype])
    if pre:
        stream, normed = out
        assert stream.data_ptr() == target.data_ptr()  # the sum made in y's memory
        torch.testing.assert_close(stream, total, **tolerance)
        torch.testing.assert_close(normed, expected, **tolerance)
    else:
        (normed,) = out
        assert normed.data_ptr() == target.data_ptr()
        torch.testing.assert_close(normed, expected, **tolerance)


def test_off_and_unbuildable_decode_the_same_tokens(data_dir, monkeypatch, caplog):
    """$FAIRSEQ_BPD_KERNELS=0, and a build that fails, run torch's operations; the log says
    why the build failed, and the tokens are greedy's either way."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=7)
    sample = random_sample(task, bsz=3, seed=7)
    expected = [h["tokens"].tolist() for h in greedy(model, task, sample)]

    def tokens():
        hypos, _ = blockwise(model, task, sample, 4)
        return [h[0]["tokens"].tolist() for h in hypos]

    assert tokens() == expected
    monkeypatch.setenv(kernels.VARIABLE, "0")
    assert kernels.serve(torch.zeros(1)) is None
    assert tokens() == expected
    monkeypatch.delenv(kernels.VARIABLE)

    def no_compiler(verbose=False):
        raise RuntimeError("Error building extension\nlean.cpp:1:1: error: no compiler here\nmore")

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="fairseq_bpd.kernels"):
        assert kernels.module() is None and kernels.module() is None
    said = [r.getMessage() for r in caplog.records if r.name == "fairseq_bpd.kernels"]
    assert len(said) == 1 and "error: no compiler here" in said[0]  # said once, with the compiler's error
    assert tokens() == expected


def test_not_served_under_autograd_or_other_dtypes():
    assert kernels.serve(torch.zeros(2, requires_grad=True)) is None
    assert kernels.serve(torch.zeros(2, dtype=torch.float16)) is None
    with torch.no_grad():
        assert kernels.serve(torch.zeros(2, requires_grad=True)) is not None


def read_parts(kept, candidates, values, added, finished):
    """What the generator reads of exact_chain's outputs: the rows up to the last kept one."""
    rows = [slice(0, int(k)) for k in kept]
    return (kept.tolist(), added.tolist(), finished.tolist(),
            [c[r].tolist() for c, r in zip(candidates, rows)], [v[r].tolist() for v, r in zip(values, rows)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b, n", [(1, 2), (1, 3), (1, 8), (5, 4), (32, 3)])
@pytest.mark.parametrize("with_limit", [False, True])
def test_exact_chain_reads_as_torchs(kern, dtype, b, n, with_limit, monkeypatch):
    """exact_chain through the compiled kernel and through torch's operations, on blocks that
    follow head 1 often, hold EOS, rows all -inf and exact ties (topk's choice): the same kept,
    added and finished, and the same choices and scores on every row read; speculating, the
    kernel doubts wherever torch's reductions would have chosen among ties it reads."""
    from test_lean_verify import random_block

    from fairseq_bpd.acceptance import exact_chain

    for seed in range(20):
        lprobs, block, score = random_block(b, n, dtype, seed)
        limit = torch.randint(1, n + 1, (b,), generator=torch.Generator().manual_seed(seed)) if with_limit else None
        monkeypatch.setenv(kernels.VARIABLE, "0")
        expected = exact_chain(lprobs, block, score, limit, 2)
        monkeypatch.setenv(kernels.VARIABLE, "1")
        assert read_parts(*exact_chain(lprobs, block, score, limit, 2)) == read_parts(*expected)
        *speculated, doubt = exact_chain(lprobs, block, score, limit, 2, speculate=True)
        assert bool(doubt) or read_parts(*speculated) == read_parts(*expected)


class PoisonedStep(BlockwiseGenerator):
    """Head 1's best token after each block of one becomes NaN where the loop leaves the NaN
    check to the compiled kernel (`nan`, unchecked log-probs), else -inf (fairseq's fix)."""

    def __init__(self, *args, nan, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan, self.unchecked = nan, 0

    def head1_lprobs(self, *args, checked=True, **kwargs):
        lprobs = super().head1_lprobs(*args, checked=checked, **kwargs)
        self.unchecked += not checked
        row = lprobs[:, 0]
        best = row.argmax(dim=1, keepdim=True)
        poison = torch.full_like(best, math.nan if self.nan and not checked else -math.inf, dtype=row.dtype)
        choices = row.isfinite().sum(dim=1, keepdim=True) > 1  # not where EOS is forced: one choice left
        row.scatter_(1, best, torch.where(choices, poison, row.gather(1, best)))
        return lprobs


def test_a_block_of_one_leaves_the_nan_check_to_the_kernel(data_dir, monkeypatch):
    """Width 1 with the kernels: head 1's log-probs go unchecked to the kernel, whose doubt
    at a NaN has them fixed and the step made again: the same tokens and scores as a NaN
    fixed at once. Without the kernels they are checked first, as always."""
    from fairseq_bpd import generator as module

    task, model, _ = build(data_dir, "--block-size", "4", seed=8)
    sample = random_sample(task, bsz=3, seed=8)
    fixes = []
    monkeypatch.setattr(module, "fix_nan", lambda lprobs: fixes.append(1) or fix_nan(lprobs))
    runs = []
    for nan in (False, True):
        generator = PoisonedStep(model, task.target_dictionary, block_size=1, max_len_b=12, nan=nan)
        runs.append(generator.generate([model], sample))
        assert generator.unchecked > 0
    assert fixes  # the kernel found the NaNs: fixed, and stepped again
    for fixed, found in zip(*runs):
        assert fixed[0]["tokens"].tolist() == found[0]["tokens"].tolist()
        assert torch.equal(fixed[0]["positional_scores"], found[0]["positional_scores"])
    monkeypatch.setenv(kernels.VARIABLE, "0")
    generator = PoisonedStep(model, task.target_dictionary, block_size=1, max_len_b=12, nan=True)
    generator.generate([model], sample)
    assert generator.unchecked == 0


def test_a_build_failure_is_named_by_its_cause():
    ninja = ("Error building extension 'fairseq_bpd_lean_x'\n[1/2] c++ -MMD -c lean.cpp\n"
             "/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.")
    assert kernels.reason(RuntimeError(ninja)) == "/bin/sh: 1: c++: not found"
    compiler = ("Error building extension 'x'\nIn file included from /usr/include/c++/12/error_constants.h:3\n"
                "lean.cpp:3:1: error: expected ';'\nmore")
    assert kernels.reason(RuntimeError(compiler)) == "lean.cpp:3:1: error: expected ';'"
    assert kernels.reason(OSError("")) == "OSError"


def test_a_killed_builds_lock_is_removed_and_the_build_named(tmp_path, monkeypatch, caplog):
    """torch waits forever on a build lock that a killed build left: one older than
    STALE_LOCK_SECONDS is removed; a fresh one (a build under way) is left to torch."""
    import os
    import time

    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: loads.append(kwargs) or "built")
    lock = tmp_path / "lock"
    lock.write_text("")
    assert kernels.build() == "built" and lock.exists()  # fresh: someone is building
    old = time.time() - kernels.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="fairseq_bpd.kernels"):
        assert kernels.build() == "built"
    assert not lock.exists() and "stale build lock" in caplog.text and "building the decoding kernels" in caplog.text
    assert loads[-1]["name"] == kernels.build_name() and loads[-1]["build_directory"] == str(tmp_path)


def test_the_build_name_follows_the_sources_and_headers(tmp_path, monkeypatch):
    source, header = tmp_path / "lean.cpp", tmp_path / "lean.h"
    source.write_text("// one")
    header.write_text("// one")
    monkeypatch.setattr(kernels, "SOURCES", [str(source)])
    monkeypatch.setattr(kernels, "HEADERS", [str(header)])
    first = kernels.build_name()
    source.write_text("// two")
    second = kernels.build_name()
    header.write_text("// two")
    assert len({first, second, kernels.build_name()}) == 3 and first.startswith("fairseq_bpd_lean_")


def test_residual_norm_refuses_what_it_would_misread(kern):
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="C values"):
        kern.residual_norm(x, y, torch.randn(7), None, 1e-5, False)
    with pytest.raises(RuntimeError, match="C values"):
        kern.residual_norm(x, y, torch.randn(16)[::2], None, 1e-5, False)
    with pytest.raises(RuntimeError, match="overlap"):
        kern.residual_norm(x, torch.randn(1, 8).expand(3, 8), None, None, 1e-5, False)


def test_a_float32_tie_in_fairseqs_log_probs_is_broken_as_greedy_breaks_it(data_dir):
    """float64 models: fairseq rounds attention's softmax in float32, and greedy's choice rides
    on float32 log-probs, so the block pass must round as fairseq's step does to the last
    bits. One output row is made to give, at a greedy step t, exactly the logit of greedy's
    token there (and very low ones before t; a large component orthogonal to the features
    of steps 0..t): a tie in fairseq's float32 log-probs, broken by greedy's topk. Blockwise
    decoding, kernels on, breaks every one as greedy does."""
    constructed = 0
    for seed in range(3):
        task, model, _ = build(data_dir, "--block-size", "4", seed=seed)
        sample = random_sample(task, bsz=1, seed=seed)
        eos = task.target_dictionary.eos()
        with torch.no_grad():
            reference = greedy(model, task, sample)[0]["tokens"].tolist()
            encoded = model.encoder.forward_torchscript(sample["net_input"])
            state, features = {}, []
            inputs = torch.tensor([[eos] + reference[:-1]])
            for j in range(inputs.size(1)):  # fairseq's own step features
                f, _ = model.decoder.extract_features(inputs[:, : j + 1], encoded, incremental_state=state)
                features.append(f[0, -1])
            steps = torch.stack(features)
            weight = model.decoder.output_projection.weight
            for t in range(1, min(len(reference) - 1, 8)):
                if reference[t] == eos:
                    continue
                kept = weight.clone()
                used = set(reference[: t + 1]) | {eos, task.target_dictionary.pad(), task.target_dictionary.unk()}
                other = next(v for v in range(4, weight.size(0)) if v not in used)
                seen = steps[: t + 1]
                target = torch.full((t + 1,), -20.0, dtype=seen.dtype)
                target[t] = weight[reference[t]] @ steps[t]
                row = torch.linalg.lstsq(seen, target[:, None]).solution[:, 0]
                basis, _ = torch.linalg.qr(seen.t(), mode="complete")
                away = basis[:, t + 1:] @ torch.randn(basis.size(1) - t - 1, dtype=seen.dtype,
                                                      generator=torch.Generator().manual_seed(t))
                weight[other] = row + 100 * away / away.norm()
                if torch.allclose(weight[other] @ seen.t(), target, atol=1e-9):
                    constructed += 1
                    expected = greedy(model, task, sample)
                    hypos, _ = blockwise(model, task, sample, 4)
                    assert [h[0]["tokens"].tolist() for h in hypos] == [e["tokens"].tolist() for e in expected]
                weight.copy_(kept)
    assert constructed >= 5


def test_a_speculative_step_off_the_kernel_still_doubts_a_nan(kern):
    """Log-probs the kernel does not take (a strided view) run torch's choice, whose topk
    ranks a NaN first: speculating, its doubt says so, for the caller to fix and step again."""
    from fairseq_bpd.acceptance import greedy_step

    lprobs = torch.randn(1, 1, 20).log_softmax(-1)[..., ::2]
    lprobs[0, 0, 3] = math.nan
    assert lprobs.stride(-1) == 2
    assert bool(greedy_step(lprobs, torch.zeros(1), 2, speculate=True)[-1])
    assert bool(greedy_step(lprobs.contiguous(), torch.zeros(1), 2, speculate=True)[-1])


def test_exact_chain_refuses_what_it_would_misread(kern):
    lprobs, score = torch.randn(2, 3, 10).log_softmax(-1), torch.zeros(2)
    block = torch.tensor([[1, 2, 3], [1, 10, 3]])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kern.exact_chain(lprobs, block, score, None, 2)
    block[1, 1] = -1
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kern.exact_chain(lprobs, block, score, None, 2)
    block[1, 1] = 2
    with pytest.raises(RuntimeError, match="b limits"):
        kern.exact_chain(lprobs, block, score, torch.tensor([2]), 2)
    with pytest.raises(RuntimeError, match="b running scores"):
        kern.exact_chain(lprobs, block, score[:, None], None, 2)
    with pytest.raises(RuntimeError, match="n >= 1"):
        kern.exact_chain(lprobs[:, :0], block[:, :0], score, None, 2)
