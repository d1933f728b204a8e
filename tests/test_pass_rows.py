"""The lean pass's products at a block's few rows: the feed-forward's relu runs inside oneDNN's
packed product (Product.relu), bit for bit the separate operation."""
import math

import pytest
import torch

from conftest import build, random_sample
from test_lean_iteration import Operations

from fairseq_bpd.product import Product


def weights(rows, columns, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, columns, generator=g, dtype=dtype) / rows ** 0.5,
            torch.randn(columns, generator=g, dtype=dtype))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("size", [(64, 96), (256, 256), (256, 1024), (1024, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_inside_the_product_is_the_separate_relu_bit_for_bit(rows, size, dtype):
    product = Product(*weights(*size, dtype=dtype))
    x = torch.randn(rows, size[0], dtype=dtype)
    got = product.relu(x)
    assert torch.equal(got, torch.relu(product(x)))
    assert bool((got == 0).any()) and bool((got > 0).any())


def test_under_autograd_relu_is_differentiable():
    product = Product(*weights(64, 96))
    x = torch.randn(4, 64, requires_grad=True)
    product.relu(x).sum().backward()
    assert bool(x.grad.abs().sum() > 0)
    assert torch.equal(x.grad, ((torch.addmm(product[1], x, product[0]) > 0).float() @ product[0].t()).detach())


def run(data_dir, dtype):
    """A block of three at batch 1 after a block of one, under inference_mode (the generator's):
    the second pass's features (1 x 3 x C), its tensor operations by name, and the decoder."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=26, dtype=dtype)
    decoder = model.decoder
    encoder_out = model.encoder.forward_torchscript(random_sample(task, bsz=1, seed=26)["net_input"])
    chain = torch.triu(torch.full((3, 3), -math.inf, dtype=dtype), 1)
    state = {}
    with torch.inference_mode():
        decoder.forward_block(torch.tensor([[2]]), 0, encoder_out, state, None, 0)
        decoder.crop_cache(state, torch.tensor([0]), 1, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
        with Operations() as ops:
            features, _ = decoder.forward_block(torch.tensor([[5, 6, 7]]), 1, encoder_out, state, chain, 3)
    return features, [name.split(".")[1] for name in ops.names], decoder


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_block_pass_runs_relu_inside_the_packed_product(data_dir, dtype, monkeypatch):
    """At batch 1 a block of three runs no separate relu where fc1's product is packed
    (float32), and one a layer where it is not (float64); the features are the separate
    relu's bit for bit."""
    features, names, decoder = run(data_dir, dtype)
    layer = decoder.lean_weights().layers[0]
    assert layer["activation"] is torch.relu
    packed = layer["fc1"].packed is not None
    assert packed == (dtype == torch.float32)
    monkeypatch.setattr(Product, "relu", lambda self, x: torch.relu(self(x)))
    separate, separate_names, _ = run(data_dir, dtype)
    assert torch.equal(features, separate)
    layers = len(decoder.layers)
    assert separate_names.count("relu") == layers
    assert names.count("relu") == (0 if packed else layers), names
    assert len(separate_names) - len(names) == (layers if packed else 0)
