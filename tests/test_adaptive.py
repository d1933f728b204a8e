"""--blockwise-adaptive: the width choice from hand-made rates and costs, and greedy output whatever it picks."""
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import build, random_sample
from test_generator import CacheWatch, Oracle, RandomRuns, assert_same, blockwise, ending_model, greedy

from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.adaptive import (
    EXPLORE_AT_MOST, AcceptanceRates, AdaptiveBlockwiseGenerator, InvocationCost, choose_width,
    cost_features, expected_tokens, neighbour, nonnegative_solve,
)


def test_expected_tokens_multiply_the_conditional_rates():
    assert expected_tokens(np.array([0.5, 0.5, 0.0])).tolist() == [1.0, 1.5, 1.75, 1.75]
    assert expected_tokens(np.ones(3)).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert expected_tokens(np.zeros(0)).tolist() == [1.0]


def test_choose_width_maximises_tokens_per_cost():
    expected = np.array([1.0, 1.5, 1.75, 1.75])
    assert choose_width(expected, np.array([1.0, 1.2, 1.3, 1.6])) == 3  # 1, 1.25, 1.35, 1.09
    assert choose_width(expected, np.array([1.0, 1.2, 1.4, 1.6])) == 2  # 1, 1.25, 1.25, 1.09: ties go narrower
    assert choose_width(expected, np.array([1.0, 1.6, 1.8, 2.0])) == 1  # proposals cost more than they bring
    assert choose_width(expected, np.array([1.0, 1.0, 1.0, 1.0])) == 3  # width 4 adds nothing
    assert choose_width(expected, np.array([1.0, 1.2, 0.0, 1.6])) == 3  # never timed: tried first
    # Within NARROWER_SLACK of the best, the narrower block: 1.25 against 1.3.
    assert choose_width(expected, np.array([1.0, 1.2, 1.75 / 1.3, 1.6])) == 2
    assert choose_width(expected, np.array([1.0, 1.2, 1.75 / 1.3, 1.6]), slack=0.0) == 3


def test_invocation_cost_recovers_a_linear_cost():
    def seconds(width, b):  # lean: 2 ms + 0.1 ms a sentence; a block: 3 ms + 0.2 ms a sentence + 0.05 ms a row
        return 2e-3 + 1e-4 * b if width == 1 else 3e-3 + 2e-4 * b + 5e-5 * b * width

    cost = InvocationCost()
    assert cost.predict(np.arange(1, 9), 4).tolist() == [0.0] * 8  # nothing timed yet
    for b in (32, 31, 29, 20, 5):
        for width in (1, 2, 5, 8):
            cost.update(width, b, seconds(width, b))
    for b in (1, 16, 64):  # unseen batch sizes and widths too
        assert np.allclose(cost.predict(np.arange(1, 9), b), [seconds(w, b) for w in range(1, 9)], rtol=1e-4)


def test_invocation_cost_follows_the_load_and_forgets_untimed_widths():
    cost = InvocationCost(forgetting=0.9)
    for _ in range(50):
        cost.update(1, 1, 2e-3)
        cost.update(4, 1, 4e-3)
    for _ in range(50):  # the machine got busier
        cost.update(1, 1, 4e-3)
        cost.update(4, 1, 8e-3)
    # The fit follows at once; each width's correction (its ratio to the fit) trails by ~1%.
    assert np.allclose(cost.predict(np.array([1, 2, 3, 4]), 1)[[0, 3]], [4e-3, 8e-3], rtol=0.02)
    for _ in range(400):  # width 1 only: the block's fit fades to the ridge's 0, which gets it tried again
        cost.update(1, 1, 4e-3)
    assert cost.coefficients[:2].sum() == pytest.approx(4e-3)  # the lean path at batch 1, still known
    costs = cost.predict(np.arange(1, 5), 1)
    assert costs[3] < 1e-6
    assert choose_width(np.array([1.0, 1.01, 1.02, 1.03]), costs) > 1


def test_acceptance_rates_count_each_proposal_given_its_predecessors():
    rates = AcceptanceRates(4)  # k=5: proposals 1..4, one pass in one try each to start
    assert rates.rates().tolist() == [1.0] * 4
    # Width 4 (3 proposals): kept 1 (proposal 1 failed), 3 (1, 2 passed, 3 failed), 4 (all passed),
    # and 2 with limit 2 (proposal 1 passed; proposal 2 could not have been kept).
    rates.update(4, np.array([1, 3, 4, 2]), np.array([4, 4, 4, 2]))
    # Reading the rates takes the counts in; proposal j's starting pass counts as j-1's rate.
    second = (2 + 4 / 5) / 3
    third = (1 + second) / 3
    assert np.allclose(rates.rates(), [4 / 5, second, third, third])  # proposal 4: never tried
    assert rates.tried.tolist() == [1 + 4, 1 + 2, 1 + 2, 1]
    assert rates.passed.tolist() == [1 + 3, 1 + 2, 1 + 1, 1]


class Widths(AdaptiveBlockwiseGenerator):
    """Records the widths its policy chose, in order; a FakeClock reads the block under way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chosen, width = [], self.policy.width
        if isinstance(self.policy.clock, FakeClock):
            self.policy.clock.policy = self.policy

        def recorded(batch_size):
            self.chosen.append(width(batch_size))
            return self.chosen[-1]

        self.policy.width = recorded


class AdaptiveOracle(Oracle, Widths):
    pass


class FixedCost:
    """Hand-made invocation costs by width: 1 for the lean path, 1.25 + 0.25 a row beyond 2."""

    def update(self, width, batch_size, seconds):
        pass

    def predict(self, widths, batch_size):
        return np.where(widths == 1, 1.0, 1.0 + 0.25 * (widths - 1))


@pytest.mark.parametrize("cost", [FixedCost, InvocationCost])
@pytest.mark.parametrize("bsz", [1, 64])
@pytest.mark.parametrize("agree", [True, False])
def test_adaptive_widths_give_greedy_output_and_settle(data_dir, bsz, agree, cost):
    task, model, _ = build(data_dir, "--block-size", "5", seed=4)
    sample = random_sample(task, bsz=bsz, seed=4)
    expected = greedy(model, task, sample, max_len_b=30)
    references = [e["tokens"] for e in expected]
    hypos, generator = blockwise(model, task, sample, 5, AdaptiveOracle, max_len_b=30,
                                 references=references, agree=agree, cost=cost(), explore_every=0)
    assert_same(expected, hypos)
    widths = generator.stats.widths
    assert sum(widths.values()) == len(generator.chosen)
    if cost is InvocationCost:
        return  # measured costs: any widths, but still greedy's output
    if agree:  # every proposal passes: the full block pays most
        assert set(generator.chosen) == {5}
        assert generator.stats.mean_accepted_block() > 4
    else:  # no proposal passes: it settles on width 1, one token per invocation as greedy
        tail = generator.chosen[len(generator.chosen) // 4:]
        assert set(tail) == {1}
        assert widths[1] > 0.75 * len(generator.chosen)
        assert all(h[0]["steps"] == len(e["tokens"]) for h, e in zip(hypos, expected))


@pytest.mark.parametrize("bsz", [1, 64])
def test_adaptive_with_the_model_heads_is_greedy(data_dir, bsz):
    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    sample = random_sample(task, bsz=bsz, seed=6)
    generator = Widths(model, task.target_dictionary, block_size=4, max_len_b=20)
    for _ in range(2):  # rates and costs carry over to the next batch
        assert_same(greedy(model, task, sample), generator.generate([model], sample))
    assert "block widths chosen {" in generator.stats.summary()
    assert set(generator.chosen) <= {1, 2, 3, 4}


def test_nonnegative_solve_fixes_negative_coefficients_at_zero():
    assert nonnegative_solve(np.eye(5), np.array([1.0, -1, 2, 0, -3])).tolist() == [1, 0, 2, 0, 0]
    assert nonnegative_solve(np.eye(5), -np.ones(5)).tolist() == [0] * 5
    # Coupled: y = 1 at x = (1, 1) and y = 3 at x = (1, 2) fit as -1 + 2x; clamped, all on x.
    x = np.array([[1.0, 1, 0, 0, 0], [1, 2, 0, 0, 0]])
    gram = x.T @ x + 1e-9 * np.eye(5)
    solved = nonnegative_solve(gram, x.T @ np.array([1.0, 3.0]))
    assert solved[0] == 0 and solved[1] == pytest.approx(7 / 5)


def test_invocation_cost_never_extrapolates_below_zero_or_upwards():
    cost = InvocationCost()
    # Noisy timings at batch sizes alike: a plain least-squares fit gives the per-sentence
    # term a large slope and the intercept a large negative value.
    for b, seconds in ((32, 0.20), (31, 0.40), (32, 0.21), (30, 0.19)):
        cost.update(3, b, seconds)
    small = cost.predict(np.array([2, 3, 8]), 1)
    assert (cost.coefficients >= 0).all()
    assert (small >= 0).all() and small[1] <= 0.4


def test_no_width_is_predicted_dearer_than_a_wider_one():
    cost = InvocationCost()
    for _ in range(3):
        cost.update(1, 32, 0.1)  # the lean path timed at batch 32 only: its fit is all intercept
        cost.update(6, 1, 0.05)
        cost.update(6, 32, 0.3)
    costs = cost.predict(np.arange(1, 9), 1)
    assert (np.diff(costs) >= 0).all() and costs[0] <= 0.05 + 1e-9


def test_the_task_builds_the_adaptive_generator_and_refuses_it_without_blockwise(data_dir):
    task, model, args = build(data_dir, "--block-size", "4", "--blockwise", "--blockwise-adaptive")
    assert isinstance(task.build_generator([model], args), AdaptiveBlockwiseGenerator)
    task, model, args = build(data_dir, "--block-size", "4", "--blockwise-adaptive")
    with pytest.raises(ValueError, match="--blockwise-adaptive .* needs --blockwise"):
        task.build_generator([model], args)


def test_adaptive_with_a_confidence_cut_is_greedy_and_times_the_cut_width(data_dir):
    task, model, _ = build(data_dir, "--block-size", "5", seed=3)
    sample = random_sample(task, bsz=7, seed=3)
    timed = []

    class Recorded(InvocationCost):
        def update(self, width, batch_size, seconds):
            timed.append(width)
            super().update(width, batch_size, seconds)

    generator = Widths(model, task.target_dictionary, block_size=5, confidence=0.3, max_len_b=20, cost=Recorded())
    assert_same(greedy(model, task, sample), generator.generate([model], sample))
    assert any(t < c for t, c in zip(timed, generator.chosen))  # some chosen blocks were cut


def test_one_preempted_invocation_barely_moves_the_cost():
    cost = InvocationCost()
    for _ in range(50):
        cost.update(4, 1, 4e-3)
    cost.update(4, 1, 0.4)  # descheduled for a time slice
    assert cost.predict(np.arange(1, 5), 1)[3] < 4.2e-3
    for _ in range(100):  # a lasting slow-down comes through
        cost.update(4, 1, 7e-3)
    assert cost.predict(np.arange(1, 5), 1)[3] == pytest.approx(7e-3, rel=0.05)


class FakeClock:
    """Advances, at each reading, by a hand-made cost of the block the generator has under way."""

    def __init__(self):
        self.now, self.policy = 0.0, None

    def __call__(self):
        if self.policy.timing is not None:
            width, b, _ = self.policy.timing
            # Rows cheap enough that each one more accepted token clearly pays (by over
            # NARROWER_SLACK: at batch 16, width 5 gives 18% more tokens a second than 4).
            self.now += 2e-3 + 1e-4 * b if width == 1 else 3e-3 + 1e-4 * b + 2e-5 * b * width
        return self.now


@pytest.mark.parametrize("agree", [True, False])
def test_measured_costs_settle_as_hand_made_ones(data_dir, agree):
    task, model, _ = build(data_dir, "--block-size", "5", seed=4)
    sample = random_sample(task, bsz=16, seed=4)
    # Long enough for the first choices (from the fit of a block or two) to give way to measured costs.
    expected = greedy(model, task, sample, max_len_b=100)
    clock = FakeClock()
    hypos, generator = blockwise(model, task, sample, 5, AdaptiveOracle, max_len_b=100,
                                 references=[e["tokens"] for e in expected], agree=agree, clock=clock)
    assert_same(expected, hypos)
    tail = generator.chosen[len(generator.chosen) // 2:]
    settled = 5 if agree else 1
    explored = [generator.chosen[block - 1] for block in generator.policy.explorations]
    assert Counter(tail).most_common(1)[0][0] == settled
    assert set(tail) - set(explored) == {settled}  # other widths only where it explores
    assert set(explored) <= ({4, 1} if agree else {2})  # below (or above) it, and the lean path


def test_neighbours_alternate_and_stay_in_range():
    assert [neighbour(4, 5, turn) for turn in range(6)] == [3, 5, 1, 3, 5, 1]  # below, above, the lean path
    assert [neighbour(2, 5, turn) for turn in range(3)] == [1, 3, 3]  # 1 is already below
    assert [neighbour(1, 5, turn) for turn in range(3)] == [2, 2, 2]
    assert [neighbour(5, 5, turn) for turn in range(3)] == [4, 4, 1]
    assert neighbour(1, 1, 0) == 1  # block size 1: nothing else to try


def test_exploration_times_neighbours_of_a_fixed_choice(data_dir):
    task, model, _ = build(data_dir, "--block-size", "5", seed=4)
    sample = random_sample(task, bsz=16, seed=4)
    expected = greedy(model, task, sample, max_len_b=30)
    timed = Counter()

    class Three(FixedCost):  # width 3 is cheapest per token whatever the rates
        def predict(self, widths, batch_size):
            return np.where(widths == 3, 1.0, 100.0)

        def update(self, width, batch_size, seconds):
            timed[width] += 1

    hypos, generator = blockwise(model, task, sample, 5, AdaptiveOracle, max_len_b=30,
                                 references=[e["tokens"] for e in expected], agree=True, cost=Three(),
                                 explore_every=2)
    assert_same(expected, hypos)
    blocks, explorations = len(generator.chosen), generator.policy.explorations
    # The 2nd block explores, then, the choice unchanged, the 4th, 8th, 16th, ... (up to
    # every EXPLORE_AT_MOST): above (4), the lean path (1), below (2), in turn.
    gaps = [2] + [min(2 ** turn, EXPLORE_AT_MOST) for turn in range(1, len(explorations))]
    assert explorations == list(np.cumsum(gaps))
    assert [generator.chosen[block - 1] for block in explorations] == [
        [4, 1, 2][turn % 3] for turn in range(len(explorations))]
    assert set(generator.chosen[block - 1] for block in range(1, blocks + 1) if block not in explorations) == {3}
    assert len(explorations) >= 3
    assert sum(timed.values()) == blocks - 1  # each block timed when the next is chosen


@pytest.mark.parametrize("flags,message", [
    (["--blockwise-tree", "4"], "drop --blockwise-tree"),
    (["--sampling"], "--blockwise-adaptive must be False with --sampling"),
])
def test_adaptive_refuses_what_is_no_greedy_chain(data_dir, flags, message):
    task, model, args = build(data_dir, "--block-size", "4", "--blockwise", "--blockwise-adaptive",
                              *[f for f in flags if f != "--sampling"])
    args.sampling = "--sampling" in flags
    with pytest.raises(BlockwiseRequestError, match=message):
        task.build_generator([model], args)


class AdaptiveRandomRuns(RandomRuns, Widths):
    pass


@pytest.mark.parametrize("bsz", [7, 16])
def test_adaptive_widths_over_random_acceptance_lengths_give_greedy_output(data_dir, bsz):
    """Widths chosen block by block (width 1, the lean path, among them) over a cache whose
    sentences kept different lengths: masked holes, compactions, greedy's output."""
    task, model = ending_model(data_dir, 5)
    sample = random_sample(task, bsz=bsz, seed=1, max_len=20)
    expected = greedy(model, task, sample, max_len_b=40)
    watch = CacheWatch(model.decoder)
    hypos, generator = blockwise(model, task, sample, 5, AdaptiveRandomRuns, max_len_b=40, seed=bsz,
                                 references=[e["tokens"] for e in expected], cost=FixedCost())
    assert_same(expected, hypos)
    assert len(set(generator.chosen)) > 1 and watch.holes > 0


def test_counted_rates_follow_the_per_proposal_rule_on_random_blocks():
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(2, 9))
        rates, tried, passed = AcceptanceRates(k - 1), np.ones(k - 1), np.ones(k - 1)
        for _ in range(int(rng.integers(1, 6))):
            width, b = int(rng.integers(2, k + 1)), int(rng.integers(1, 9))
            kept = rng.integers(1, width + 1, size=b)
            limit = np.maximum(kept, rng.integers(1, 12, size=b))
            j = np.arange(1, width)  # proposal j: tried when reached and keepable, passed when kept past it
            tried[: width - 1] += ((kept[:, None] >= j) & (j < limit[:, None])).sum(0)
            passed[: width - 1] += (kept[:, None] > j).sum(0)
            rates.update(width, kept, limit)
        start, expected = 1.0, []
        for p, t in zip(passed, tried):  # the starting pass: the rate of the proposal before
            start = (p - 1 + start) / t
            expected.append(start)
        assert np.allclose(rates.rates(), expected)


def test_timings_taken_in_at_once_weigh_as_one_by_one():
    rng = np.random.default_rng(1)
    for _ in range(50):
        cost, gram, moment = InvocationCost(), np.zeros((5, 5)), np.zeros(5)
        for _ in range(int(rng.integers(1, 16))):  # under 16: one refit, when read (no cap from a fit yet)
            width, b = int(rng.integers(1, 9)), int(rng.integers(1, 33))
            seconds = 1e-3 * (1 + 0.1 * b * width) * rng.uniform(0.9, 1.1)
            x = cost_features(np.array([width]), b)[0]
            gram, moment = 0.98 * gram + np.outer(x, x), 0.98 * moment + seconds * x
            cost.update(width, b, seconds)
        assert np.allclose(cost.coefficients, nonnegative_solve(gram + 1e-9 * np.eye(5), moment))
        assert np.allclose(cost.gram, gram) and np.allclose(cost.moment, moment)


def test_a_sentence_ending_in_a_block_counts_its_proposals_up_to_its_eos(data_dir):
    """A hand-made block of width 5 (4 proposals) for three sentences: one whose EOS is a passing
    proposal (the two proposals after it are no tries), one whose EOS is head 1's choice after
    a rejected proposal (a try that failed), one that goes on (two passed, one failed)."""
    task, model, _ = build(data_dir, "--block-size", "5", seed=1)
    generator = AdaptiveBlockwiseGenerator(model, task.target_dictionary, block_size=5, explore_every=0)
    d = task.target_dictionary
    eos, a, b, c, e, x = d.eos(), 5, 6, 7, 8, 9
    blocks = [[a, b, eos, c, e], [a, b, c, e, x], [a, b, c, e, x]]
    choices = [[b, eos, c, e, x], [b, eos, c, e, x], [b, c, x, x, x]]  # head 1's choice after each token
    lprobs = torch.full((3, 5, len(d)), -10.0, dtype=torch.float64)
    lprobs.scatter_(2, torch.tensor(choices)[..., None], 0.0)
    block, limit = torch.tensor(blocks), torch.tensor([10, 10, 10])
    node, kept, outputs, _, added, finished = generator.verify_block(
        lprobs, block, torch.zeros(3, dtype=torch.float64), limit, generator.layout)
    assert kept.tolist() == [5, 2, 3] and added.tolist() == [2, 2, 3] and finished.tolist() == [True, True, False]
    generator.policy.observe(5, kept, added, limit)
    rates = generator.policy.rates
    rates.rates()  # takes the counts in
    # Proposal j, tried / passed: sentence 1 tried and passed 1 and its EOS (2); sentence 2
    # passed 1 and tried 2 (rejected: head 1 chose EOS); sentence 3 passed 1 and 2, tried 3.
    assert (rates.tried - 1).tolist() == [3, 3, 1, 0]
    assert (rates.passed - 1).tolist() == [3, 2, 0, 0]
