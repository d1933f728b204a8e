"""product.Product: decoding's x · W + b, by the compiled kernel at a few float32 rows where it
is built, else by oneDNN's packed weight where it applies (float32 on a CPU) and was timed
faster, MKL's addmm otherwise; they agree to float32 rounding. The libraries' tests turn the
compiled kernels off (library_kernels)."""
import time

import pytest
import torch
from test_lean_iteration import Operations

from fairseq_bpd import kernels
from fairseq_bpd import product as product_module
from fairseq_bpd.product import COMPILED_MOST_ROWS, ONE_ROW_PACKED_SIZE, PACKED_VARIABLE, Product, packing_applies

real_packed_pays = product_module.packed_pays  # the conftest puts a stand-in in its place


@pytest.fixture
def library_kernels(monkeypatch):
    """The compiled kernels off: every row count takes the libraries' kernels."""
    monkeypatch.setenv(kernels.VARIABLE, "0")


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


def test_one_row_by_a_small_weight_and_float64_are_addmm_bit_for_bit(library_kernels):
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


def test_fastest_picks_the_quicker_kernel_whatever_its_place():
    calls = []

    def quick():
        calls.append("quick")

    def slow():
        calls.append("slow")
        time.sleep(0.002)

    assert product_module.fastest([slow, quick]) == 1 and product_module.fastest([quick, slow]) == 0
    per_kernel = 2 * (1 + product_module.RACE_ROUNDS * product_module.RACE_CALLS)  # two races
    assert calls.count("quick") == calls.count("slow") == per_kernel


def test_rows_share_a_timing_each_up_to_eight_then_by_powers_of_two():
    assert [product_module.rows_key(r) for r in (1, 2, 7, 8, 9, 16, 17, 100)] == [1, 2, 7, 8, 16, 16, 32, 128]


@pytest.mark.parametrize("packed_faster", [False, True])
def test_the_timed_kernel_serves_its_shape_rows_and_threads_timed_once(packed_faster, monkeypatch, library_kernels):
    """packed_pays (the conftest's stand-in put aside) times a (shape, rows, threads) on its
    first product and keeps the answer: the product then runs that kernel alone, and another
    row count is timed anew."""
    monkeypatch.setattr(product_module, "packed_pays", real_packed_pays)
    monkeypatch.setattr(product_module, "PACKED_PAYS", {})
    races = []

    def fixed(kernels):
        races.append(len(kernels))
        return int(packed_faster)

    monkeypatch.setattr(product_module, "fastest", fixed)
    weight, bias = weights(64, 96)
    product = Product(weight, bias)
    if not packing_applies(weight):
        assert not product.packs(torch.randn(3, 64)) and races == []  # no oneDNN here: nothing timed
        return
    x = torch.randn(3, 64)
    with Operations() as operations:
        for _ in range(3):
            product(x)
    assert races == [2]  # timed once, between addmm and the packed product
    assert operations.names.count("mkldnn._linear_pointwise.default") == (3 if packed_faster else 0)
    assert operations.names.count("aten.addmm.default") == (0 if packed_faster else 3)
    assert list(product_module.PACKED_PAYS) == [((64, 96), 3, torch.get_num_threads())]
    product(torch.randn(20, 64))
    assert races == [2, 2] and ((64, 96), 32, torch.get_num_threads()) in product_module.PACKED_PAYS


def test_the_real_timing_decides_and_either_kernel_gives_the_product(monkeypatch, library_kernels):
    """Timed for real on this machine: whichever kernel won, the product is x · W + b."""
    monkeypatch.setattr(product_module, "packed_pays", real_packed_pays)
    monkeypatch.setattr(product_module, "PACKED_PAYS", {})
    weight, bias = weights(256, 768)
    product = Product(weight, bias)
    x = torch.randn(4, 256)
    got = product(x)
    assert torch.allclose(got, torch.addmm(bias, x, weight), rtol=1e-5, atol=1e-5)
    assert len(product_module.PACKED_PAYS) == (1 if packing_applies(weight) else 0)


def test_many_rows_a_new_thread_count_and_the_variable_set_to_one(monkeypatch):
    """Rows from TIMED_MOST_ROWS on run packed untimed; another thread count is timed anew;
    $FAIRSEQ_BPD_PACKED=1 when the weights are arranged runs the packed copy untimed."""
    monkeypatch.setattr(product_module, "packed_pays", real_packed_pays)
    monkeypatch.setattr(product_module, "PACKED_PAYS", {})
    races = []
    monkeypatch.setattr(product_module, "fastest", lambda kernels: races.append(len(kernels)) or 0)
    weight, bias = weights(64, 96)
    if not packing_applies(weight):
        return
    product = Product(weight, bias)
    assert product.packs(torch.randn(product_module.TIMED_MOST_ROWS, 64)) and races == []
    assert not product.packs(torch.randn(2, 64)) and races == [2]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert not product.packs(torch.randn(2, 64)) and races == [2, 2]
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(PACKED_VARIABLE, "1")
    assert Product(weight, bias).packs(torch.randn(2, 64)) and races == [2, 2]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, COMPILED_MOST_ROWS])
@pytest.mark.parametrize("size", [(64, 96), (256, 1000)])
def test_a_few_float32_rows_take_the_compiled_product(rows, size):
    """Up to COMPILED_MOST_ROWS rows: the compiled kernel's product on the packed copy (the
    float64 product to float32 rounding; into out, rows at a stride, relu inside it), bit for
    bit the kernel called directly."""
    kern = kernels.module()
    assert kern is not None  # built on this machine (and CI's): a fallback would hide a failure
    weight, bias = weights(*size)
    product = Product(weight, bias)
    x = torch.randn(rows, 2 * size[0])[:, size[0]:]  # rows at a stride
    expected = (x.double() @ weight.double() + bias.double())
    got = product(x)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, kern.float_product(x, product.blocks(), size[1], bias))
    assert product.compiled is not None and product.compiled.shape == (-(-size[1] // 64), size[0], 64)
    out = torch.full((rows, size[1]), float("nan"))
    assert product(x, out=out) is out and torch.equal(out, got)
    assert torch.equal(product.relu(x), torch.relu(got))


def test_more_rows_grad_and_float64_take_the_libraries(monkeypatch):
    """Past COMPILED_MOST_ROWS rows, under autograd and in float64 no packed copy for the
    compiled kernel is made: the libraries' product (addmm, made the only one here)."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    weight, bias = weights(64, 96)
    product = Product(weight, bias)
    x = torch.randn(COMPILED_MOST_ROWS + 1, 64)
    assert torch.equal(product(x), torch.addmm(bias, x, weight)) and product.compiled is None
    grad = torch.randn(2, 64, requires_grad=True)
    assert torch.equal(product(grad), torch.addmm(bias, grad, weight)) and product.compiled is None
    weight, bias = weights(64, 96, dtype=torch.float64)
    product = Product(weight, bias)
    assert torch.equal(product(x.double()[:2]), torch.addmm(bias, x.double()[:2], weight)) and product.compiled is None


def test_the_compiled_product_refuses_what_it_would_misread():
    kern = kernels.module()
    weight, bias = weights(64, 96)
    product = Product(weight, bias)
    x, packed = torch.randn(2, 64), product.blocks()
    with pytest.raises(RuntimeError, match="float32"):
        kern.float_product(x, packed.double(), 96, bias)
    with pytest.raises(RuntimeError, match="packed"):
        kern.float_product(x, packed, 96 + 64, bias)  # a block short
    with pytest.raises(RuntimeError, match="bias"):
        kern.float_product(x, packed, 96, bias[:90])
    with pytest.raises(RuntimeError, match="x M x C"):
        kern.float_product(torch.randn(2, 64).t(), packed, 96, bias)
    with pytest.raises(RuntimeError, match="overlap"):
        out = torch.empty(2, 96)
        kern.float_product(out[:, :64], packed, 96, bias, None, False, out)
    with pytest.raises(RuntimeError, match="input channel"):
        kern.float_product(torch.randn(3, 0), torch.zeros(1, 0, 64), 10)


def test_a_bias_the_kernel_cannot_read_takes_the_libraries(monkeypatch):
    """A broadcast or strided bias (addmm takes both) runs addmm's product, as before."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    weight, _ = weights(64, 96)
    x = torch.randn(3, 64)
    for bias in (torch.randn(1), torch.randn(192)[::2]):
        product = Product(weight, bias)
        assert torch.allclose(product(x), torch.addmm(bias, x, weight), atol=1e-5) and product.compiled is None
