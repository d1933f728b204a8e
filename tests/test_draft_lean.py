"""The draft's lean decoding step (draft_step.py): at batch 1 its entries go to columns the host
knows, written by their own product, and a chain's later steps attend without a mask; the
proposals stay the teacher-forced draft's."""
import collections

import pytest
import torch

from conftest import random_sample
from test_draft import WatchedDraft, assert_first_steps_teacher_forced, assert_proposals_teacher_forced, draft
from test_generator import assert_same, blockwise, greedy
from test_lean_iteration import Operations

from fairseq_bpd import kernels
from fairseq_bpd.draft_step import DraftState
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.options import BlockwiseOptions


def lean_draft(data_dir, *extra, seed):
    """A k=4 draft whose layer norms scale and shift (decoding folds them into the products
    after them; fresh ones are the identity), on a base biased towards EOS, so that sentences
    end at different blocks."""
    task, model, _ = draft(data_dir, 4, *extra, seed=seed)
    heads, generator = model.decoder.heads, torch.Generator().manual_seed(seed)
    for norm in (heads.self_attn_norm, heads.encoder_attn_norm, heads.ffn_norm, heads.final_norm):
        norm.weight.data.normal_(1.0, 0.5, generator=generator)
        norm.bias.data.normal_(0.0, 0.5, generator=generator)
    eos = task.target_dictionary.eos()
    model.decoder.output_projection.register_forward_hook(
        lambda module, inputs, out: out + 0.5 * (torch.arange(out.size(-1)) == eos))
    return task, model


def watched_generate(model, task, sample, max_len_b=30):
    """Greedy's hypotheses, and the blockwise ones by a WatchedDraft that accepts at several
    lengths, with the proposer and the references."""
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    references = [e["tokens"] for e in expected]
    proposer = WatchedDraft(model.decoder.heads, references, lambda s, n: (s + n) % 3 != 0,
                            task.target_dictionary.eos())
    generator = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=max_len_b),
                                   proposer=proposer)
    return expected, generator.generate([model], sample), proposer, references


def test_the_row_left_alone_steps_on_its_own_lengths(data_dir, monkeypatch):
    """A batch of 3 goes down to one row while the others' waiting positions are still in its
    pending block: the state keeps only the row's own (DraftState.alone), and every first step
    and proposal after it, made on the host's lengths, is the teacher-forced draft's."""
    task, model = lean_draft(data_dir, seed=5)
    seen, alone = [], DraftState.alone

    def recorded(state):
        pending = state.pending
        seen.append(None if pending is None else (pending.features.size(1), int(pending.count[0])))
        alone(state)
        if state.pending is not None:  # what batch 1 steps on: the row's own waiting, its own longest
            assert state.pending.features.size(1) == int(state.pending.count[0])
            assert state.pending.longest == state.longest + state.pending.features.size(1) + 1
        assert state.longest == int(state.length[0])
    monkeypatch.setattr(DraftState, "alone", recorded)
    sample = random_sample(task, bsz=3, seed=0)
    expected, hypos, proposer, references = watched_generate(model, task, sample)
    assert_same(expected, hypos)
    assert any(waiting is not None and waiting[0] > waiting[1] for waiting in seen), seen  # trimmed
    assert_first_steps_teacher_forced(model, task, sample, references, proposer)
    assert_proposals_teacher_forced(model, task, sample, references, proposer)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_batch_one_proposals_are_the_teacher_forced_drafts(data_dir, activation):
    """relu folds the feed-forward's second bias into its product (a unit), gelu does not:
    both draft the teacher-forced proposals at batch 1, and decode exactly with a tree."""
    task, model = lean_draft(data_dir, "--activation-fn", activation, seed=2)
    sample = random_sample(task, bsz=1, seed=3)
    expected, hypos, proposer, references = watched_generate(model, task, sample)
    assert_same(expected, hypos)
    assert len(references[0]) > 8 and len(proposer.drafts) > 3
    assert_first_steps_teacher_forced(model, task, sample, references, proposer)
    assert_proposals_teacher_forced(model, task, sample, references, proposer)
    assert_same(greedy(model, task, sample), blockwise(model, task, sample, 4, tree=8)[0])


def counted(call):
    with Operations() as operations, torch.no_grad():
        call()
    return collections.Counter(operations.names), operations.waits()


# A chain's later step at batch 1: the entry (lookup, product), q, k and v by one product into
# the cache, the self-attention over a window that ends at its own column (two views, no
# mask), the source attention, the feed-forward whose second product adds its bias and the
# residual, the projection onto the shortlist and argmax; views of heads and of the cache.
LATER_STEP = {
    "aten.index_select.default": 1, "aten.addmm.default": 8, "aten.addmm.out": 1,
    "aten.native_layer_norm.default": 4, "aten.as_strided.default": 7, "aten.relu_.default": 1,
    "aten._scaled_dot_product_flash_attention_for_cpu.default": 2, "aten.add.Tensor": 3,
    "aten.argmax.default": 1,
}
# With the compiled kernels (fairseq_bpd.kernels): each attention and each residual add with
# its layer norm one call (not dispatched: not counted), making its output (empty) and the
# attention's rows a view; the entry's norm and the bias unit's stay torch's.
LATER_STEP_KERNELS = {
    "aten.index_select.default": 1, "aten.addmm.default": 8, "aten.addmm.out": 1,
    "aten.native_layer_norm.default": 2, "aten.as_strided.default": 5, "aten.relu_.default": 1,
    "aten.empty.memory_format": 4, "aten.view.default": 2, "aten.add.Tensor": 1, "aten.argmax.default": 1,
}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_later_step_at_batch_one_is_a_fixed_set_of_operations(data_dir, compiled, monkeypatch):
    """Dispatched operations at batch 1: each further head adds LATER_STEP's 28 (26 and four
    kernel calls with the compiled kernels); no proposal builds a mask or scatters into the
    cache; keep() waits on the host once a block (not at all where nothing waits), propose()
    never."""
    monkeypatch.setenv(kernels.VARIABLE, "1" if compiled else "0")
    assert (kernels.module() is not None) == compiled  # the kernels build here (CI's machine too)
    expected, total = (LATER_STEP_KERNELS, 26) if compiled else (LATER_STEP, 28)
    task, model, _ = draft(data_dir, 8, seed=1)
    heads = model.decoder.heads
    sample = random_sample(task, bsz=1, seed=1)
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    features, token = 3 * torch.randn(1, 16, dtype=torch.float64), torch.tensor([5])
    block, path = torch.randint(4, 28, (1, 8)), torch.arange(8)[None]
    counts = {}
    for width in range(2, 9):
        heads.state = None
        with torch.no_grad():
            heads.propose(features, token, 8, 9, 1, encoder_out, log_probs=False)  # arranged; a block proposed
        keep, keep_waits = counted(lambda: heads.keep(path, torch.tensor([3]), features[:, None].expand(1, 8, 16), block))
        assert keep_waits == 1 and "aten.gather.default" not in keep
        counts[width], waits = counted(lambda: heads.propose(features, token, width, 9, 1, encoder_out, log_probs=False))
        assert waits == 0
        assert not {"aten.index_put_.default", "aten.masked_fill_.Scalar", "aten.gt.Tensor"} & set(counts[width])
        assert heads.state.length.tolist() == [4] and heads.state.longest == 4
    for width in range(3, 9):
        step = counts[width] - counts[width - 1]
        assert dict(step) == expected and sum(step.values()) == total
    _, keep_waits = counted(lambda: heads.keep(path, torch.tensor([1]), features[:, None].expand(1, 8, 16), block))
    assert keep_waits == 1 and heads.state.pending is None
