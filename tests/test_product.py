"""product.Product: decoding's x · W + b, by oneDNN's packed weight where it applies (float32
on a CPU), MKL's addmm otherwise; the two agree to float32 rounding."""
import pytest
import torch

from fairseq_bpd.product import ONE_ROW_PACKED_SIZE, PACKED_VARIABLE, Product, packing_applies


def weights(rows, columns, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, columns, generator=g, dtype=dtype) / rows ** 0.5,
            torch.randn(columns, generator=g, dtype=dtype))


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("size", [(64, 96), (256, 4096 + 7)])
def test_a_packed_product_is_the_addmm_to_float32_rounding(rows, size):
    weight, bias = weights(*size)
    product = Product(weight, bias)
    assert (product.packed is not None) == packing_applies(weight)
    x = torch.randn(rows, size[0])
    expected = torch.addmm(bias, x, weight)
    got = product(x)
    assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))
    out = torch.full((rows, size[1]), float("nan"))
    assert product(x, out=out) is out and torch.equal(out, got)
    strided = torch.randn(rows, 2 * size[0])[:, size[0]:]  # rows at a stride, as the cache's views
    assert torch.allclose(product(strided), torch.addmm(bias, strided, weight), rtol=1e-5, atol=1e-5)


def test_one_row_by_a_small_weight_and_float64_are_addmm_bit_for_bit():
    weight, bias = weights(64, 96)
    assert weight.numel() < ONE_ROW_PACKED_SIZE
    x = torch.randn(1, 64)
    assert torch.equal(Product(weight, bias)(x), torch.addmm(bias, x, weight))
    weight, bias = weights(64, 96, dtype=torch.float64)
    product = Product(weight, bias)
    x = torch.randn(5, 64, dtype=torch.float64)
    assert product.packed is None and torch.equal(product(x), torch.addmm(bias, x, weight))


def test_the_variable_turns_packing_off_and_autograd_takes_addmm(monkeypatch):
    weight, bias = weights(64, 96)
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    assert Product(weight, bias).packed is None
    monkeypatch.delenv(PACKED_VARIABLE)
    product = Product(weight, bias)
    x = torch.randn(4, 64, requires_grad=True)
    y = product(x)
    assert torch.equal(y, torch.addmm(bias, x, weight))
    y.sum().backward()
    assert torch.allclose(x.grad, weight.sum(1).expand(4, -1), atol=1e-5)
    assert product[0] is weight and product[1] is bias  # read as the (weight, bias) pair it replaced


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_product_survives_deepcopy_and_pickle_with_its_own_packed_copy(dtype):
    """A model deep-copied (fairseq's EMA, a test's copy) carries its cached Products."""
    import copy
    import io

    weight, bias = weights(64, 96, dtype=dtype)
    product = Product(weight, bias)
    x = torch.randn(3, 64, dtype=dtype)
    buffer = io.BytesIO()
    torch.save(product, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(product), torch.load(buffer, weights_only=False)):
        assert type(clone) is Product and clone[0] is not weight
        assert torch.equal(clone[0], weight) and torch.equal(clone[1], bias)
        assert (clone.packed is None) == (product.packed is None)
        assert torch.equal(clone(x), product(x))
