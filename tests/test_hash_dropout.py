"""HashDropout: nn.Dropout's law with a mask hashed from a seed; --heads-bf16's training."""
import pytest
import torch
from torch import nn

from conftest import build
from test_criterion import criterion, translation_batch

from fairseq_bpd import kernels
from fairseq_bpd.dropout import HashDropout, hash_dropout

needs_kernels = pytest.mark.skipif(kernels.module() is None, reason="the compiled kernels could not be built here")


@needs_kernels
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p_and_scaled(p):
    x = torch.randn(1_000_000)
    y = hash_dropout(x, p, seed=12345)
    kept = y.ne(0)
    assert abs(kept.float().mean().item() - (1 - p)) < 0.003  # 1e6 draws: the std is under 5e-4
    assert torch.equal(y[kept], x[kept] * torch.tensor(1 / (1 - p)))
    # Neighbours are not correlated (a weak hash repeats patterns along the index).
    bits = kept.float() - (1 - p)
    for lag in (1, 2, 16, 256):
        assert abs((bits[:-lag] * bits[lag:]).mean().item()) < 0.003


@needs_kernels
def test_the_seed_alone_decides_the_mask():
    x = torch.randn(10_000)
    assert torch.equal(hash_dropout(x, 0.2, 7), hash_dropout(x.clone(), 0.2, 7))
    a, b = hash_dropout(x, 0.2, 7).eq(0), hash_dropout(x, 0.2, 8).eq(0)
    assert not torch.equal(a, b)
    assert abs((a & b).float().mean().item() - 0.04) < 0.01  # independent masks: p^2 dropped by both
    # The seed's high half counts as much as its low half.
    assert not torch.equal(a, hash_dropout(x, 0.2, 7 + (1 << 40)).eq(0))


@needs_kernels
def test_the_gradient_passes_the_same_mask():
    x = torch.randn(3, 50, 16, requires_grad=True)
    y = hash_dropout(x, 0.25, 99)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, hash_dropout(grad, 0.25, 99))
    assert torch.equal(x.grad.eq(0), y.eq(0) | grad.eq(0))
    x.grad = None
    y = hash_dropout(x, 0.25, 99)
    (first,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|double backward"):
        torch.autograd.grad(first.sum(), x)


@needs_kernels
def test_non_contiguous_inputs_are_read_in_their_logical_order():
    x = torch.randn(40, 30)
    assert torch.equal(hash_dropout(x.t(), 0.3, 5), hash_dropout(x.t().contiguous(), 0.3, 5))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_scale_as_their_float_does(dtype):
    x = torch.randn(5000, dtype=torch.float64).to(dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30]).to(dtype)
    y = hash_dropout(x, 0.1, 3)
    assert y.dtype == dtype
    scale = 1 / 0.9 if dtype == torch.float64 else torch.tensor(1 / 0.9, dtype=torch.float32)
    want = (x.to(torch.float64 if dtype == torch.float64 else torch.float32) * scale).to(dtype)
    kept = hash_dropout(torch.ones(5000, dtype=dtype), 0.1, 3).ne(0)
    want = torch.where(kept, want, x * 0)  # a NaN or an infinity dropped is NaN, as in torch's dropout
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y[~want.isnan()], want[~want.isnan()])


@needs_kernels
def test_the_module_follows_torch_manual_seed_and_is_the_identity_in_eval():
    module, x = HashDropout(0.3), torch.randn(64, 64)
    torch.manual_seed(0)
    first = module(x)
    torch.manual_seed(0)
    assert torch.equal(module(x), first)
    assert not torch.equal(module(x), first)  # the next call draws another seed
    assert first.eq(0).any()
    module.eval()
    assert module(x) is x
    assert HashDropout(0.0)(x) is x


def test_where_the_kernels_do_not_serve_it_is_nn_dropout(monkeypatch):
    monkeypatch.setenv(kernels.VARIABLE, "0")
    x = torch.randn(64, 64)
    torch.manual_seed(1)
    ours = HashDropout(0.3)(x)
    torch.manual_seed(1)
    assert torch.equal(ours, nn.Dropout(0.3)(x))
    assert torch.equal(HashDropout(1.0)(x), torch.zeros_like(x))


@pytest.mark.parametrize("head_type", ["draft", "chained", "independent"])
def test_heads_bf16_trains_the_heads_in_bfloat16_and_leaves_validation_as_it_was(data_dir, head_type):
    """--heads-bf16: the training loss is float32's within bfloat16's rounding, every trained
    weight gets a float32 gradient, and validation (no autocast) is bit-identical."""
    extra = ("--block-size", "3", "--head-type", head_type, "--freeze-base", "--dropout", "0")
    task, model, _ = build(data_dir, *extra, dtype=torch.float32)
    _, fast, _ = build(data_dir, *extra, "--heads-bf16", dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for p in model.decoder.heads.parameters():  # weights that are not zero: every product counts
        p.data.normal_(0, 0.3, generator=generator)
    fast.load_state_dict(model.state_dict())
    sample = translation_batch(task, bsz=4, seed=3)
    crit = criterion(task)
    losses = []
    for m in (model, fast):
        m.train()
        loss, _, _ = crit(m, sample)
        loss.backward()
        losses.append(loss.item())
        trained = [p for p in m.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
    assert losses[0] != losses[1]  # bfloat16 products ran
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for m in (model, fast):
        m.eval()
    with torch.no_grad():
        assert torch.equal(crit(model, sample)[0], crit(fast, sample)[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_heads_bf16_leaves_a_model_of_another_dtype_in_its_own(data_dir, dtype):
    extra = ("--block-size", "3", "--head-type", "draft", "--freeze-base", "--dropout", "0")
    task, model, _ = build(data_dir, *extra, dtype=dtype)
    _, fast, _ = build(data_dir, *extra, "--heads-bf16", dtype=dtype)
    fast.load_state_dict(model.state_dict())
    sample = translation_batch(task, bsz=4, seed=3)
    if dtype == torch.float16:  # as fairseq's --fp16 hands the model its batch
        sample["net_input"] = {k: v.half() if v.is_floating_point() else v for k, v in sample["net_input"].items()}
    crit = criterion(task)
    model.train(), fast.train()
    assert torch.equal(crit(model, sample)[0], crit(fast, sample)[0])
