"""The draft decoder at width 1: a block of one proposes nothing, so the draft drafts nothing;
its accepted positions wait, block after block, and the next proposal of width >= 2 (or a
tree's nodes()) feeds them all in its first step. Decoding stays greedy's, and every first
step and proposal stays the teacher-forced draft's on the whole prefix, in float64."""
import collections

import pytest
import torch

from conftest import random_sample
from test_draft import WatchedDraft, assert_first_steps_teacher_forced, assert_proposals_teacher_forced, draft
from test_draft_tree import WatchedTree, assert_nodes_teacher_forced
from test_draft_tree_breaker import assert_first_steps_near_teacher_forced
from test_generator import assert_same, greedy
from test_lean_iteration import Operations

from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd.draft_step import DraftState
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.heads import no_proposals
from fairseq_bpd.options import BlockwiseOptions


class Scripted:
    """A width policy (generator.FixedWidth's protocol) whose widths follow `script`, over
    and over, from each batch's start: as adaptive or calibrated widths switch."""

    observes = False

    def __init__(self, script):
        self.script, self.turn = script, 0

    def start(self):
        self.turn = 0

    def width(self, batch_size):
        self.turn += 1
        return self.script[(self.turn - 1) % len(self.script)]

    def observe(self, width, kept, added, limit):
        pass


def eos_draft(data_dir, k, seed, bias=0.5):
    """A random k-head draft on a base biased towards EOS, so that sentences end at different blocks."""
    task, model, _ = draft(data_dir, k, seed=seed)
    eos = task.target_dictionary.eos()
    model.decoder.output_projection.register_forward_hook(
        lambda module, inputs, out: out + bias * (torch.arange(out.size(-1)) == eos))
    return task, model


class Fed:
    """Records, per first step, how many deferred positions (blocks of one) it fed."""

    def __init__(self, heads):
        self.deferred, feed_accepted = [], heads.feed_accepted

        def recorded(state, features, token):
            self.deferred.append(len(state.deferred))
            return feed_accepted(state, features, token)
        heads.feed_accepted = recorded


def scripted_decode(model, task, sample, script, proposer, max_len_b=20, **options):
    """Greedy's hypotheses and `proposer`'s under the scripted widths, with the generator."""
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    generator = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=max_len_b, **options),
                                   proposer=proposer)
    generator.policy = Scripted(script)
    return expected, generator.generate([model], sample), generator


def watched_chain(model, task, sample, script, max_len_b=20, **options):
    """scripted_decode by a WatchedDraft (accepting at several lengths) whose feed is counted
    (Fed); checks the output and every first step and proposal; returns the WatchedDraft,
    the Fed and the generator."""
    references = [e["tokens"] for e in greedy(model, task, sample, max_len_b=max_len_b)]
    proposer = WatchedDraft(model.decoder.heads, references, lambda s, n: (s + n) % 3 != 0,
                            task.target_dictionary.eos())
    fed = Fed(model.decoder.heads)
    try:
        expected, hypos, generator = scripted_decode(model, task, sample, script, proposer, max_len_b, **options)
    finally:
        del model.decoder.heads.feed_accepted  # both recorders: the instance attribute
    assert_same(expected, hypos)
    assert_first_steps_teacher_forced(model, task, sample, references, proposer)
    assert_proposals_teacher_forced(model, task, sample, references, proposer)
    return proposer, fed, generator


@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("options", [{}, {"confidence": 0.3}])
def test_widths_switching_feed_the_waiting_blocks_in_one_first_step(data_dir, bsz, options):
    """Widths 1 -> 3 -> 1 -> 1 -> 8 over and over: one first step per proposal of width >= 2
    (none at width 1), which feeds the two blocks of one before it with the accepted
    positions of the block of 3; every first step and proposal the teacher-forced draft's."""
    task, model = eos_draft(data_dir, 8, seed=2, bias=0.0)
    sample = random_sample(task, bsz=bsz, seed=2)
    proposer, fed, generator = watched_chain(model, task, sample, (1, 3, 1, 1, 8), **options)
    widths = [tokens.size(1) + 1 for _, _, tokens, _, _ in proposer.drafts]
    assert set(proposer.widths) == {1, 3, 8}
    # Under a confidence the draft stops stepping where the block is cut: it may draft fewer.
    assert all(made == asked if not options else 1 < made <= asked or made == asked == 1
               for made, asked in zip(widths, proposer.widths))
    assert len(fed.deferred) == sum(width > 1 for width in widths)  # no first step at width 1
    assert max(fed.deferred) == 2 and 1 in fed.deferred  # the 8 after two blocks of one, the 3 after one
    assert generator.stats.accepted[1] > 0 and max(generator.stats.accepted) > 2


def test_sentences_leave_during_blocks_of_one(data_dir, monkeypatch):
    """A batch of 5 whose sentences end while blocks of one wait, and go down to one row
    with positions waiting: the rows that stay keep their own (DraftState.select, alone)."""
    seen, select = [], DraftState.select

    def recorded(state, rows):
        seen.append((len(state.deferred), len(rows)))
        select(state, rows)
    monkeypatch.setattr(DraftState, "select", recorded)
    task, model = eos_draft(data_dir, 4, seed=5, bias=0.9)
    sample = random_sample(task, bsz=5, seed=1)
    watched_chain(model, task, sample, (4, 1, 1, 1, 2, 1, 1))
    assert any(deferred for deferred, _ in seen), seen  # sentences left with blocks of one waiting
    assert any(deferred and rows == 1 for deferred, rows in seen), seen  # and left one row alone


@pytest.mark.parametrize("bsz", [1, 4])
def test_a_tree_after_blocks_of_one_feeds_them(data_dir, bsz):
    """--blockwise-tree with --blockwise-confidence (the generator asks propose() of every
    block): blocks of one, then trees, whose first step (nodes()'s or propose()'s) feeds the
    waiting blocks; every node drafted on its own path."""
    task, model = eos_draft(data_dir, 5, seed=4, bias=0.3)
    sample = random_sample(task, bsz=bsz, seed=4)
    references = [e["tokens"] for e in greedy(model, task, sample)]
    proposer = WatchedTree(model.decoder.heads, references, lambda s: s % 3, task.target_dictionary.eos())
    fed = Fed(model.decoder.heads)
    try:
        expected, hypos, generator = scripted_decode(model, task, sample, (1, 1, 5, 1, 3), proposer,
                                                     tree=12, confidence=0.01)
    finally:
        del model.decoder.heads.feed_accepted
    assert_same(expected, hypos)
    assert proposer.trees and max(fed.deferred) == 2
    assert_nodes_teacher_forced(model, task, sample, references, proposer)
    assert_first_steps_near_teacher_forced(model, task, sample, references, proposer)


def test_eos_and_max_length_during_blocks_of_one(data_dir):
    """Sentences end (EOS, or the length limit) inside stretches of blocks of one, some
    batches with blocks still waiting; the next batch starts afresh."""
    task, model = eos_draft(data_dir, 4, seed=6, bias=0.5)
    sample, waiting = random_sample(task, bsz=4, seed=6), []
    for max_len_b in range(4, 10):
        _, _, generator = watched_chain(model, task, sample, (2, 1, 2, 1, 1), max_len_b=max_len_b)
        waiting.append(len(model.decoder.heads.state.deferred))
        assert generator.stats.accepted[1] > 0
    assert 0 in waiting and max(waiting) > 0, waiting  # batches ended with blocks of one waiting


def test_many_blocks_of_one_are_written_past_waiting_most(data_dir, monkeypatch):
    """Past waiting_most blocks of one, their entries are written in the cache (which grows
    from one column) without a step; the proposals after them stay the teacher-forced draft's."""
    monkeypatch.setattr(DraftDecoder, "waiting_most", 3)
    monkeypatch.setattr(DraftDecoder, "cache_columns", 1)
    task, model = eos_draft(data_dir, 4, seed=2, bias=0.2)
    for bsz in (1, 3):
        sample = random_sample(task, bsz=bsz, seed=bsz)
        proposer, fed, _ = watched_chain(model, task, sample, (2, 1, 1, 1, 1, 1, 1, 1, 4), max_len_b=30)
        assert max(fed.deferred) == 1  # 7 blocks of one: 3 and 3 written, 1 fed in the first step
        assert model.decoder.heads.state.kv.size(3) >= 16


def counted(call):
    with Operations() as operations, torch.no_grad():
        call()
    return collections.Counter(operations.names), operations.waits()


@pytest.mark.parametrize("bsz", [1, 3])
def test_a_block_of_one_runs_no_draft_operation(data_dir, bsz):
    """After a proposal and its keep, a width-1 propose() runs no_proposals' operations alone
    and the keep after its block of one none; the next proposal's first step feeds the
    waiting positions of both blocks and the last (at batch 1 without a host wait)."""
    task, model, _ = draft(data_dir, 8, seed=1)
    heads = model.decoder.heads
    sample = random_sample(task, bsz=bsz, seed=1)
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    features, token = 3 * torch.randn(bsz, 16, dtype=torch.float64), torch.full((bsz,), 5)
    block, path = torch.randint(4, 28, (bsz, 8)), torch.arange(8).expand(bsz, 8)
    heads.state = None
    with torch.no_grad():
        heads.propose(features, token, 8, 9, 1, encoder_out, log_probs=False)
        heads.keep(path, torch.full((bsz,), 3), features[:, None].expand(bsz, 8, 16), block)
    expected, _ = counted(lambda: no_proposals(features, 1, False))
    one = (path[:, :1], torch.ones(bsz, dtype=torch.long), features[:, None], block[:, :1])  # a block of one
    for _ in range(2):
        ran, waits = counted(lambda: heads.propose(features, token, 1, 9, 1, encoder_out, log_probs=False))
        assert ran == expected and waits == 0
        ran, waits = counted(lambda: heads.keep(*one))
        assert not ran and waits == 0
    assert heads.state.length.tolist() == [1] * bsz and len(heads.state.deferred) == 2
    _, waits = counted(lambda: heads.propose(features, token, 4, 9, 1, encoder_out, log_probs=False))
    assert heads.state.length.tolist() == [1 + 2 + 2 + 1] * bsz and not heads.state.deferred
    assert heads.state.pending is None and heads.state.longest == 6
    if bsz == 1:
        assert waits == 0
