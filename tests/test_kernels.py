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
