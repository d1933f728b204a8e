"""The exact chain's fused verify-accept-commit (acceptance.exact_chain) against verify, TopK(1),
accepted and commit; Batch.store_one's narrow copies against store's scatters; the loop's
host reads and per-row indexing on an exact chain at batch 1."""
import math

import pytest
import torch

from conftest import build

from fairseq_bpd.acceptance import TopK, accepted, commit, exact_chain, verify
from fairseq_bpd.generator import Batch
from fairseq_bpd.tree import Tree

EOS, V = 2, 12


def general(lprobs, block, score, limit):
    """Steps 2-4 as verify_block takes them for any rule: kept, outputs, output_scores, added, finished."""
    tree = Tree.chain_of(block.size(1) - 1)
    verdict = verify(lprobs, block, score, 1, tree)
    _, kept = accepted(TopK(1).passes(verdict, block, tree), limit, tree)
    candidates, values, running, _ = verdict
    return (kept, *commit(block, candidates, values, running, kept, EOS))


def random_block(b, n, dtype, seed):
    """lprobs b x n x V over a small vocabulary, whose blocks follow head 1's choice often,
    hold EOS, rows all -inf and exact ties; running scores in float32, as fairseq keeps them."""
    g = torch.Generator().manual_seed(seed)
    lprobs = (torch.randn(b, n, V, generator=g, dtype=dtype) * 3).log_softmax(-1)
    lprobs[torch.rand(b, n, generator=g) < 0.05] = -math.inf
    tie = torch.rand(b, n, generator=g) < 0.1
    lprobs[..., 5] = torch.where(tie, lprobs.amax(-1), lprobs[..., 5])  # a tie at the top: topk's choice
    choice = torch.topk(lprobs, 2, dim=-1)[1][..., 0]  # b x n
    random = torch.randint(3, V, (b, n), generator=g)
    block = torch.where(torch.rand(b, n, generator=g) < 0.7, choice.roll(1, 1), random)
    block[:, 0] = torch.randint(3, V, (b,), generator=g)
    score = (torch.rand(b, generator=g) * -20).to(torch.float32)
    return lprobs, block, score


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b", [1, 6])  # greedy_choice by topk and by reductions
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_the_fused_commit_is_todays_on_random_blocks(dtype, b, n):
    """kept, added and finished equal; outputs and their scores equal on each sentence's kept
    outputs (store reads nothing after them), bit for bit."""
    found = {"eos": 0, "accepted": 0, "limited": 0}
    for seed in range(60):
        lprobs, block, score = random_block(b, n, dtype, seed)
        limit = torch.randint(1, n + 2, (b,), generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
        want = general(lprobs, block, score, limit if limit is not None else torch.full((b,), n + 1))
        got = exact_chain(lprobs, block, score, limit, EOS)
        for name, w, g in zip(("kept", "added", "finished"), (want[0], want[3], want[4]), (got[0], got[3], got[4])):
            assert torch.equal(w, g), (name, seed)
        kept = want[0]
        for w, g in zip(want[1:3], got[1:3]):
            mask = torch.arange(n) < kept[:, None]
            assert torch.equal(w[mask], g[mask]), seed
        found["eos"] += int(want[4].sum())
        found["accepted"] += int((kept > 1).sum())
        found["limited"] += int((kept == limit).sum()) if limit is not None else 0
    assert all(found.values()), found  # the blocks tried each branch


def test_the_fused_commit_reads_a_proposals_running_score_as_fairseq_sums_it():
    """The output scores are the float32 sums score + lprob, one after another: a proposal's
    running score is its choice's value because both are the same sum."""
    lprobs = torch.full((1, 3, V), -30.0)
    lprobs[0, :, 7] = torch.tensor([-0.1, -0.2, -0.3])
    block, score = torch.tensor([[4, 7, 7]]), torch.tensor([-12.345678])
    kept, outputs, output_scores, added, finished = exact_chain(lprobs, block, score, None, EOS)
    assert kept.tolist() == [3] and added.tolist() == [3] and not finished.any()
    assert outputs.tolist() == [[7, 7, 7]]
    want, running = [], score[0]
    for step in range(3):
        running = running + lprobs[0, step, 7]
        want.append(running)
    assert torch.equal(output_scores[0], torch.stack(want))


def batch_of(b, width=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((b, width), 1)
    tokens[:, :4] = torch.randint(3, V, (b, 4), generator=g)
    scores = torch.zeros(b, width)
    scores[:, :3] = torch.rand(b, 3, generator=g)
    return Batch(sentence=torch.arange(b), tokens=tokens, scores=scores, attn=None,
                 length=torch.full((b,), 3), score=scores[:, 2].clone(), cached=torch.full((b,), 3),
                 offsets=torch.arange(1, width + 1))


@pytest.mark.parametrize("attn", [False, True])
@pytest.mark.parametrize("added", [1, 2, 4])
def test_store_one_of_several_outputs_is_store(attn, added):
    """Every sentence at the same length adding the same count: store_one's narrow copies
    write what store's scatters write up to each sentence's length, and padding after."""
    b, n = 3, 4
    g = torch.Generator().manual_seed(added)
    outputs, output_scores = torch.randint(3, V, (b, n), generator=g), torch.rand(b, n, generator=g)
    block_attn = torch.rand(b, n, 5, generator=g) if attn else None
    one, many = batch_of(b), batch_of(b)
    one.store_one(outputs, output_scores, block_attn, 3, added)
    many.store(outputs, output_scores, torch.full((b,), added), block_attn, 1)
    assert torch.equal(one.length, many.length) and torch.equal(one.score, many.score)
    assert torch.equal(one.tokens, many.tokens)
    end = 3 + added
    assert torch.equal(one.scores[:, :end], many.scores[:, :end])
    if attn:
        assert torch.equal(one.attn[..., : end + 1], many.attn[..., : end + 1])


class Operations(torch.utils._python_dispatch.TorchDispatchMode):
    """The tensor operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def test_an_exact_chain_at_batch_one_reads_the_host_once_and_indexes_no_rows(data_dir):
    """Width 3 at batch 1, the static cache: between two decoder passes the loop (beyond
    head 1's NaN check and the cache's own read) reads the host once, gathers only the
    proposals' log-probs, and scatters, concatenates (but the block) and indexes nothing
    per row; the output is greedy's."""
    from conftest import random_sample
    from test_generator import assert_same, blockwise, greedy

    task, model, _ = build(data_dir, "--block-size", "3", seed=5)
    sample = random_sample(task, bsz=1, seed=5)
    expected = greedy(model, task, sample, max_len_b=30)
    decoder, seen, widths = model.decoder, [], []
    forward_block = decoder.forward_block

    def counted(block, *args, **kwargs):  # the operations from one decoder pass to the next
        if seen:
            seen[-1].__exit__(None, None, None)
        out = forward_block(block, *args, **kwargs)
        widths.append(block.size(1))
        seen.append(Operations())
        seen[-1].__enter__()
        return out

    def uncounted(method):  # the cache's crop (cache.py) and the proposals (heads.py) are others'
        def call(*args, **kwargs):
            seen[-1].__exit__(None, None, None)
            try:
                return method(*args, **kwargs)
            finally:
                seen[-1].__enter__()
        return call

    heads = decoder.heads
    decoder.forward_block, decoder.crop_cache = counted, uncounted(decoder.crop_cache)
    heads.propose = uncounted(heads.propose)
    try:
        hypos, generator = blockwise(model, task, sample, 3, max_len_b=30)
    finally:
        if seen:
            seen[-1].__exit__(None, None, None)
        del decoder.forward_block, decoder.crop_cache, heads.propose
    assert_same(expected, hypos)
    chains = [ops.names for ops, n in zip(seen[:-1], widths) if n == 3][1:]  # the last pass retires
    assert len(chains) >= 3
    for names in chains:
        head_reads = names.count("item") + names.count("is_nonzero") + names.count("_local_scalar_dense")
        assert head_reads == 1, names  # head 1's NaN check
        assert names.count("resolve_conj") == 1, names  # the one read of kept, added and finished
        assert names.count("gather") == 1 and names.count("cat") == 1, " ".join(names)
        assert not [name for name in names if name in ("scatter_", "index_select", "nonzero")], names
