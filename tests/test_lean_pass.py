"""The lean pass's economies (static_pass.py, cache.StaticCache, decoder.forward_block and
project): the block's product made in the cache's buffer, the self-attention mask kept per
block mask, the projection one product. Each is checked against
a full-prefix recomputation and against the path it spares, bit for bit where both compute
the same arithmetic, and by the operations a pass runs."""
import math

import pytest
import torch

from conftest import build, random_sample
from test_lean_iteration import Operations
from test_static_cache import Sentences

from fairseq_bpd import cache as cache_room
from fairseq_bpd import kernels
from fairseq_bpd.cache import StaticCache
from fairseq_bpd.product import PACKED_VARIABLE


def decode_blocks(sentences, widths, leave_at=None):
    """Blocks of the given widths under no_grad (decoding's mode), each checked against a
    full-prefix pass and kept to a random length; returns where each block's product went
    (the cache's slab stride, or None: made apart and copied in)."""
    slabs = []
    for round_, width in enumerate(widths):
        with torch.no_grad():
            block, features, tree = sentences.feed(width)
        cache = sentences.decoder.cache(sentences.state)
        slabs.append(cache.slab)
        sentences.check(block, features, tree)
        sentences.keep(block, tree)
        if round_ == leave_at:
            sentences.leave(list(range(1, len(sentences.rows))))
    return slabs


def test_batch_one_makes_every_product_in_the_cache(data_dir):
    """At batch 1 every block's rows are one matrix of the buffer (a column apart): the
    product is made there, whatever the width, and the features are a full-prefix pass."""
    sentences = Sentences(data_dir, bsz=1, seed=21)
    slabs = decode_blocks(sentences, [1, 3, 1, 4, 2, 4, 1])
    cache = sentences.decoder.cache(sentences.state)
    assert slabs == [cache.kv.stride(2)] * len(slabs)


def test_blocks_of_one_at_a_batch_make_their_product_in_the_cache(data_dir):
    """Width-1 blocks at batch 3 (equal lengths: a cache row apart) are made in place;
    wider blocks at unequal lengths are copied in by index; a sentence leaving compacts
    the rows, and the next blocks of one are made in place again."""
    sentences = Sentences(data_dir, bsz=3, seed=22)
    widths = [1, 1, 1, 3, 4, 1]
    slabs = decode_blocks(sentences, widths)
    cache = sentences.decoder.cache(sentences.state)
    assert slabs[:3] == [cache.kv.stride(1)] * 3
    assert not cache.equal and slabs[-1] is None  # unequal lengths: one index_copy
    sentences = Sentences(data_dir, bsz=3, seed=23)
    slabs = decode_blocks(sentences, [1, 1, 1, 1], leave_at=1)
    assert slabs[2:] == [sentences.decoder.cache(sentences.state).kv.stride(1)] * 2  # the rows left, compacted


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_product_made_in_place_rounds_as_the_one_made_apart(data_dir, dtype, monkeypatch):
    """The same blocks with autograd on (the product made apart, then copied, and the
    embedding scaled after the lookup) and under no_grad (made in the buffer, looked up in
    the scaled table): bit for bit the same features. Under autograd products are MKL's
    (oneDNN's packed weights have no gradient) and attention and norms torch's (the compiled
    kernels have none either), so both are compared without them."""
    monkeypatch.setenv(PACKED_VARIABLE, "0")
    monkeypatch.setenv(kernels.VARIABLE, "0")
    apart = Sentences(data_dir, bsz=1, seed=24, dtype=dtype)
    in_place = Sentences(data_dir, bsz=1, seed=24, dtype=dtype)
    for width in (1, 3, 2, 4):
        block, features, _ = apart.feed(width)
        assert features.requires_grad
        with torch.no_grad():
            other_block, other, _ = in_place.feed(width)
        assert torch.equal(block, other_block)
        assert torch.equal(features.detach(), other)
        assert torch.equal(apart.keep(block, None), in_place.keep(other_block, None))


def test_a_block_mask_is_kept_per_mask_and_made_again_when_the_cache_widens(data_dir, monkeypatch):
    """Blocks of one width at growing lengths read one kept mask (a slice of it, no mask of
    their own); a cache widened past its columns makes it again at the new width; another
    mask object of the same shape, even at a freed one's address, is not taken for it."""
    monkeypatch.setattr(cache_room, "COLUMNS", 8)
    sentences = Sentences(data_dir, bsz=1, seed=25)
    decode_blocks(sentences, [1])
    cache = sentences.decoder.cache(sentences.state)
    chain = torch.triu(torch.full((3, 3), -math.inf, dtype=torch.float64), 1)
    seen = []
    for _ in range(4):
        with torch.no_grad():
            _, mask = cache.begin(torch.zeros(1, 3, 16, dtype=torch.float64), chain)
        columns = cache.kv.size(2)
        kept = cache.prefix_mask(chain)
        seen.append((columns, kept.data_ptr()))
        assert mask.data_ptr() == kept.data_ptr() + (columns - cache.longest) * mask.element_size()
        expected = torch.zeros(3, cache.longest + 3, dtype=torch.float64)
        expected[:, cache.longest:] = chain
        assert torch.equal(mask, expected)
        cache.longest += 3  # as three kept entries would
    assert seen[0][1] == seen[1][1]  # the same kept mask for the blocks before the cache widened
    assert seen[-1][0] > seen[0][0] and seen[-1][1] != seen[0][1]
    tree_like = torch.zeros(3, 3, dtype=torch.float64)  # another mask of the same shape
    assert not torch.equal(cache.prefix_mask(tree_like)[:, -3:], cache.prefix_mask(chain)[:, -3:])


def test_a_width_three_pass_at_batch_one_copies_nothing_and_makes_no_mask(data_dir):
    """Under inference_mode (the generator's), a block of three at batch 1 runs no copy (the
    products are made in the cache) and makes no mask (one slice of the kept one); one such pass runs the layers' own operations and a handful more."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=26, dtype=torch.float32)
    decoder = model.decoder
    encoder_out = model.encoder.forward_torchscript(random_sample(task, bsz=1, seed=26)["net_input"])
    chain = torch.triu(torch.full((3, 3), -math.inf), 1)
    state = {}
    with torch.inference_mode():
        decoder.forward_block(torch.tensor([[2]]), 0, encoder_out, state, None, 0)
        decoder.crop_cache(state, torch.tensor([0]), 1, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
        block = torch.tensor([[5, 6, 7]])
        decoder.forward_block(block, 1, encoder_out, state, chain, 3)  # the first block of 3 keeps its mask
        decoder.crop_cache(state, torch.tensor([1]), 3, torch.arange(3)[None], torch.tensor([2]))
        with Operations() as ops:
            decoder.forward_block(block, 3, encoder_out, state, chain, 5)
    assert type(decoder.cache(state)) is StaticCache
    names = [name.split(".")[1] for name in ops.names]
    layers = len(decoder.layers)
    # oneDNN's packed product has no out=: a layer's queries, keys and values are copied in
    # where it serves (the compiled kernels' product, where they are built, writes them there).
    packed = decoder.lean_weights().layers[0]["qkv"].packed is not None and kernels.module() is None
    assert names.count("copy_") == (layers if packed else 0), ops.names
    for spared in ("index_copy_", "new_zeros", "zeros", "triu", "eq"):
        assert spared not in names, ops.names
    # Per layer: 6 products, 3 norms, 3 residual sums, the activation, 2 attentions, 7 views.
    assert len(ops.names) <= 22 * layers + 4 + 8 + names.count("copy_"), ops.names  # the embedding, positions; the alignment's extras
    assert ops.waits() == 0


def test_an_embedding_changed_through_data_is_read_by_the_next_decoding(data_dir):
    """A change through .data moves no version counter: the next decoding still looks up
    the changed weight (no scaled table is kept across decodings), its features a
    full-prefix pass over the changed model."""
    sentences = Sentences(data_dir, bsz=2, seed=27)
    decode_blocks(sentences, [1, 2])
    version = sentences.decoder.embed_tokens.weight._version
    sentences.decoder.embed_tokens.weight.data.mul_(1.5)
    assert sentences.decoder.embed_tokens.weight._version == version  # nothing could tell
    fresh = Sentences(data_dir, bsz=2, seed=27)
    fresh.model, fresh.decoder = sentences.model, sentences.decoder
    fresh.encoder_out = sentences.model.encoder.forward_torchscript(random_sample(fresh.task, bsz=2, seed=27)["net_input"])
    decode_blocks(fresh, [1, 3, 2])


@pytest.mark.parametrize("vocab", [0, 10])
def test_the_projection_of_a_block_is_one_product_bit_for_bit(data_dir, vocab):
    """project() of contiguous rows equals the 2-D product of the same rows and of a
    transposed view of them (reshaped first), and runs one product: the whole vocabulary's
    by the kept Product (oneDNN's packed weight in float32), a shortlist's by one matmul."""
    _, model, _ = build(data_dir, "--block-size", "4", seed=28, dtype=torch.float32)
    decoder = model.decoder
    x = torch.randn(2, 3, decoder.output_embed_dim)
    with torch.inference_mode():
        whole = decoder.transposed_projection()
        columns = whole[0]
        full = torch.mm(x.view(6, -1), columns).view(2, 3, -1)
        # A shortlist is its own product: MKL's kernels on some CPUs (AVX-512) round the
        # first N columns of the full product differently, so compare like with like.
        expected = torch.mm(x.view(6, -1), columns[:, :vocab]).view(2, 3, -1) if vocab else whole(x.view(6, -1)).view(2, 3, -1)
        decoder.project(x, vocab)
        with Operations() as ops:
            logits = decoder.project(x, vocab)
        transposed = decoder.project(x.transpose(0, 1).contiguous().transpose(0, 1), vocab)
    assert torch.equal(logits, expected) and torch.equal(transposed, expected)
    assert torch.allclose(logits, full[..., :vocab] if vocab else full, atol=1e-5)
    products = [name for name in ops.names if "view" not in name and "reshape" not in name]
    assert len(products) == 1 if not vocab else ops.names == ["aten.matmul.default"] or len(ops.names) == 2, ops.names


def test_rows_apart_gather_their_mask_from_a_kept_table(data_dir):
    """At unequal lengths each row's mask is gathered from a table kept per block mask: a
    second block of the same mask builds no table (no cat), and the features stay a
    full-prefix pass."""
    sentences = Sentences(data_dir, bsz=3, seed=29)
    decode_blocks(sentences, [1, 3, 3])
    cache = sentences.decoder.cache(sentences.state)
    assert not cache.equal
    chain = cache.causal(3, torch.zeros((), dtype=torch.float64))
    with torch.no_grad():
        cache.begin(torch.zeros(3, 3, 16, dtype=torch.float64), chain)
        with Operations() as ops:
            _, mask = cache.begin(torch.zeros(3, 3, 16, dtype=torch.float64), chain)
    assert "aten.cat.default" not in ops.names, ops.names
    for row, length in enumerate(cache.lengths.tolist()):
        expected = torch.full((3, cache.longest + 3), -math.inf, dtype=torch.float64)
        expected[:, :length] = 0
        expected[:, length : length + 3] = chain
        assert torch.equal(mask[row, 0], expected)
    decode_blocks(sentences, [3, 2, 3])


def test_a_crop_told_the_counts_reads_nothing_where_rows_were_as_long(data_dir, monkeypatch):
    """crop_cache given kept as a host list (the generator's one read) leaves the cache as
    the crop that reads kept itself does, and reads nothing from the device while the
    rows were equally long before the block (it reads where they were not)."""
    from conftest import random_sample

    task, model, _ = build(data_dir, "--block-size", "4", seed=28, dtype=torch.float64)
    decoder = model.decoder
    encoder_out = model.encoder.forward_torchscript(random_sample(task, bsz=3, seed=28)["net_input"])
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    first = torch.full((3, 1), task.target_dictionary.eos())
    path = torch.arange(3).expand(3, -1)
    states = []
    for told in (True, False):
        state, cached = {}, torch.zeros(3, dtype=torch.long)
        with torch.inference_mode():
            decoder.forward_block(first, 0, encoder_out, state)
            cached = decoder.crop_cache(state, cached, 1, path[:, :1], torch.ones(3, dtype=torch.long))
            for kept in ([2, 2, 2], [3, 1, 2], [1, 1, 1]):
                positions = cached[:, None] + torch.arange(3) if decoder.cached_length(state) is None else int(cached[0])
                decoder.forward_block(torch.randint(4, 20, (3, 3)), positions, encoder_out, state, None, int(cached.max()) + 2)
                equal_before = decoder.cached_length(state) is not None
                reads.clear()
                cached = decoder.crop_cache(state, cached, 3, path, torch.tensor(kept), kept if told else None)
                assert (not reads) == (told and equal_before)
                cache = decoder.cache(state)
                states.append((cached.tolist(), cache.width(), cache.uniform_length()))
    assert states[:3] == states[3:]
    assert [s[2] for s in states[:3]] == [3, None, None]
