"""The fused label-smoothed loss (smoothed_loss.py, csrc/smoothed_loss.cpp) against fairseq's
label_smoothed_nll_loss of a log-softmax: loss, gradient and best token."""
import pytest
import torch
from fairseq import utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_bpd import kernels
from fairseq_bpd.smoothed_loss import smoothed_nll

PAD = 1


def reference(logits, target, eps):
    """fairseq's loss per row and best token, with the logits' gradient of sum(loss * weights)."""
    logits = logits.detach().clone().requires_grad_()
    lprobs = utils.log_softmax(logits, dim=-1)
    loss, _ = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=PAD, reduce=False)
    return loss.view(-1), lprobs.max(dim=-1).indices, logits


def fused(logits, target, eps):
    logits = logits.detach().clone().requires_grad_()
    loss, best = smoothed_nll(logits, target, eps, PAD)
    return loss, best, logits


def rows(n, v, dtype, seed=0, scale=4.0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=generator) * scale).to(dtype)
    target = torch.randint(0, v, (n,), generator=generator)
    return logits, target


@pytest.fixture(scope="module", autouse=True)
def built():
    if kernels.module() is None:
        pytest.fail("the compiled kernels did not build: this file tests them")


@pytest.mark.parametrize("v", [2, 7, 64, 2000, 2003])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_float32_loss_gradient_and_best_token_are_fairseqs(v, eps):
    logits, target = rows(37, v, torch.float32, seed=v)
    target[3] = PAD  # an ignored row: no loss, no gradient
    weights = torch.rand(37, generator=torch.Generator().manual_seed(1))
    want, want_best, want_x = reference(logits, target, eps)
    got, got_best, got_x = fused(logits, target, eps)
    assert got.dtype == torch.float32 and got.shape == (37,)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert got[3] == 0
    assert torch.equal(got_best, want_best)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-5, atol=1e-7)
    assert not got_x.grad[3].any()


def test_bfloat16_logits_give_float32_losses_and_a_bfloat16_gradient():
    """bfloat16 logits (--head-loss-bf16's product) as fairseq reads them: in float32."""
    logits, target = rows(50, 2000, torch.bfloat16, seed=5)
    weights = torch.rand(50, generator=torch.Generator().manual_seed(2))
    want, want_best, want_x = reference(logits, target, 0.1)
    got, got_best, got_x = fused(logits, target, 0.1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got_best, want_best)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    assert got_x.grad.dtype == torch.bfloat16
    # Both round the same float32 gradient to bfloat16: equal but where the sums' order moves
    # a value across a rounding boundary (one bfloat16 step).
    torch.testing.assert_close(got_x.grad.float(), want_x.grad.float(), rtol=8e-3, atol=1e-9)


def test_ties_take_the_first_maximum_and_extremes_stay_finite():
    logits = torch.zeros(4, 10)
    logits[0, [2, 7]] = 3.0  # a tie: the first
    logits[1] = -1e4  # every exp underflows but the maximum's
    logits[1, 5] = 0.0
    logits[2, 9] = 200.0  # one dominant logit
    target = torch.tensor([7, 5, 0, 4])
    want, want_best, _ = reference(logits, target, 0.1)
    got, got_best, _ = fused(logits, target, 0.1)
    assert got_best.tolist() == want_best.tolist() == [2, 5, 9, 0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("v", [16, 37])
def test_non_finite_logits_give_what_fairseq_gives(v):
    """A NaN or +inf makes the row's log-probs NaN (loss and gradient NaN, best token 0, as
    max over NaNs); a -inf is a token of probability 0: an infinite smoothing term, a finite
    gradient."""
    logits, target = rows(4, v, torch.float32)
    target[:] = torch.tensor([1, 2, 3, 4])
    logits[1, 10] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 5] = float("-inf")
    got, got_best, got_x = fused(logits, target, 0.1)
    want, want_best, want_x = reference(logits, target, 0.1)
    assert torch.isnan(got[1:3]).all() and torch.isnan(want[1:3]).all()
    assert got[3] == want[3] == float("inf") and torch.isfinite(got[0])
    assert torch.equal(got_best, want_best)
    weights = torch.tensor([1.0, 0.5, 0.5, 2.0])
    (got_grad,) = torch.autograd.grad(got, got_x, weights)
    (want_grad,) = torch.autograd.grad(want, want_x, weights)
    assert torch.isfinite(got_grad[[0, 3]]).all() and got_grad[3].abs().sum() > 0
    torch.testing.assert_close(got_grad[[0, 3]], want_grad[[0, 3]], rtol=1e-5, atol=1e-7)


def test_what_the_kernel_does_not_take_runs_torchs_operations():
    """float64, a GPU's tensors or one logit a row go to fairseq's own operations: the same loss."""
    logits, target = rows(9, 30, torch.float64)
    got, best, x = fused(logits, target, 0.1)
    want, want_best, _ = reference(logits, target, 0.1)
    assert torch.equal(got, want) and torch.equal(best, want_best)  # fairseq's log-softmax: float32
    got.sum().backward()
    assert x.grad.dtype == torch.float64


def test_targets_out_of_range_are_refused():
    logits, target = rows(4, 10, torch.float32)
    target[2] = 10
    with pytest.raises(RuntimeError, match=r"target 10 out of \[0, 10\)"):
        fused(logits, target, 0.1)


def test_a_second_backward_is_refused():
    logits, target = rows(4, 10, torch.float32)
    x = logits.clone().requires_grad_()
    loss, _ = smoothed_nll(x, target, 0.1, PAD)
    (grad,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()
