"""The exact chain's fused verify-accept-commit (acceptance.exact_chain) against verify, TopK(1),
accepted and commit; Batch.store_one's narrow copies against store's scatters; the loop's
host reads and per-row indexing on an exact chain at batch 1."""
import math

import pytest
import torch

from conftest import build

from fairseq_bpd import kernels
from fairseq_bpd.acceptance import TopK, accepted, commit, exact_chain, verify
from fairseq_bpd.generator import Batch, BlockwiseGenerator, fix_nan
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


@pytest.mark.parametrize("compiled", [False, True])
def test_an_exact_chain_at_batch_one_reads_the_host_once_and_indexes_no_rows(data_dir, compiled, monkeypatch):
    """Width 3 at batch 1, the static cache: between two decoder passes the loop (the
    cache's crop and the proposals aside) reads the host once (no NaN check of its own),
    gathers only the proposals' log-probs (with the compiled kernels, not even those: the
    chain's verification is one call), and scatters, concatenates (but the block) and
    indexes nothing per row; the output is greedy's."""
    monkeypatch.setenv(kernels.VARIABLE, "1" if compiled else "0")
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
        assert not [name for name in names if name in ("item", "is_nonzero", "_local_scalar_dense")], names
        assert names.count("resolve_conj") == 1, names  # the one read: kept, added and finished
        assert names.count("gather") == (0 if compiled else 1) and names.count("cat") == 1, " ".join(names)
        assert not [name for name in names if name in ("scatter_", "index_select", "nonzero")], names


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("b", [1, 6])
def test_speculation_doubts_a_nan_and_a_tie_and_nothing_else(b, compiled, monkeypatch):
    """exact_chain(speculate=True) asks the host nothing: its doubt is True where head 1's
    log-probs hold a NaN (any choice) or a tie at the top is chosen by reductions (b x n
    of CHOICE_BY_MAXIMUM rows or more; topk's choice among ties is fairseq's; the compiled
    kernel's always), else False, and its values are then the checked ones."""
    monkeypatch.setenv(kernels.VARIABLE, "1" if compiled else "0")
    n = 3
    lprobs, block, score = random_block(b, n, torch.float32, seed=1)
    lprobs[..., 5] = -30.0  # no ties
    doubt = exact_chain(lprobs, block, score, None, EOS, speculate=True)[5]
    assert not bool(doubt)
    for w, g in zip(exact_chain(lprobs, block, score, None, EOS), exact_chain(lprobs, block, score, None, EOS, True)):
        assert torch.equal(w, g)
    # A NaN and a tie in rows whose choices are read: clean rows, each proposal head 1's choice.
    lprobs = torch.randn(b, n, V, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    block[:, 1:] = lprobs.argmax(-1)[:, :-1]
    poisoned = lprobs.clone()
    poisoned[0, 1, 4] = math.nan
    assert bool(exact_chain(poisoned, block, score, None, EOS, speculate=True)[5])
    tied = lprobs.clone()
    tied[-1, 2, 5] = tied[-1, 2].max()
    assert bool(exact_chain(tied, block, score, None, EOS, speculate=True)[5]) == (b * n >= 4 or compiled)


class Poisoned(BlockwiseGenerator):
    """Head 1's log-probs at each block's second position lose their best token: NaN where the
    loop leaves the NaN check to verification (`nan`), else -inf, what fairseq's fix makes of it."""

    def __init__(self, *args, nan, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan, self.fixes = nan, 0

    def head1_lprobs(self, *args, checked=True, **kwargs):
        lprobs = super().head1_lprobs(*args, checked=checked, **kwargs)
        if lprobs.size(1) > 1:
            row = lprobs[:, 1]
            row.scatter_(1, row.argmax(dim=1, keepdim=True), math.nan if self.nan and not checked else -math.inf)
        return lprobs


@pytest.mark.parametrize("compiled", [False, True])
def test_a_nan_found_by_verification_decodes_as_one_fixed_at_once(data_dir, monkeypatch, compiled):
    """A NaN in head 1's log-probs on an exact chain, left for verification to find: the block is
    verified again, NaNs fixed, and decodes as if head1_lprobs had fixed them. torch's
    operations find every NaN; the compiled kernel those in rows whose choices are read (a
    block whose first proposal failed reads no choice at its second position)."""
    monkeypatch.setenv(kernels.VARIABLE, "1" if compiled else "0")
    from conftest import random_sample
    from fairseq_bpd import generator as module

    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    sample = random_sample(task, bsz=3, seed=6)
    fixes = []
    monkeypatch.setattr(module, "fix_nan", lambda lprobs: fixes.append(1) or fix_nan(lprobs))
    hypos = [Poisoned(model, task.target_dictionary, block_size=4, max_len_b=20, nan=nan).generate([model], sample)
             for nan in (False, True)]
    assert len(fixes) >= (1 if compiled else 3)  # every wide block (every one read there) verified again
    for fixed, found in zip(*hypos):
        assert fixed[0]["tokens"].tolist() == found[0]["tokens"].tolist()
        assert torch.equal(fixed[0]["positional_scores"], found[0]["positional_scores"])
