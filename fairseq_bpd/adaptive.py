"""--blockwise-adaptive: each block's width chosen for the most accepted tokens per second.

A block of width w (the last committed token and w-1 proposals) is worth, per sentence,
1 + r1 + r1·r2 + ... + r1···r(w-1) tokens, r_j the rate at which proposal j passes
given that proposals 1..j-1 did (this run's counts). It costs one invocation, whose
time the generator measures on itself and fits by batch size and width (InvocationCost).
Width 1 runs no proposal heads (the generator's lean path), so when the heads stop
paying the generator decodes at greedy's speed; the output is greedy's either way.
"""
import time

import numpy as np

from .generator import BlockwiseGenerator


def expected_tokens(rates):
    """Tokens a block of each width 1..k adds per sentence: rates k-1 -> k.

    rates[j-1]: how often proposal j passes when proposals 1..j-1 did.
    """
    return np.concatenate([[1.0], np.cumprod(rates)]).cumsum()


def choose_width(expected, costs):
    """The width 1..k with the most expected tokens per unit of cost: an int.

    expected, costs: k (costs of 0 are not yet measured: they win, which tries them).
    Ties go to the narrower block.
    """
    rate = expected / np.maximum(costs, 1e-12)  # nothing real takes under a picosecond
    return int(np.argmax(rate)) + 1  # argmax returns the first maximum


def cost_features(widths, batch_size):
    """What an invocation's time is fitted on, per width: widths m -> m x 5.

    Width 1 is the lean path (no heads, no verification): its own intercept and cost
    per sentence. A wider block pays an intercept, the heads per sentence and the
    decoder and verification per block row (batch_size x width).
    """
    lean = (widths == 1).astype(np.float64)
    block = 1 - lean
    return np.stack([lean, lean * batch_size, block, block * batch_size, block * batch_size * widths], axis=1)


def nonnegative_solve(gram, moment):
    """Least squares from its normal equations with every coefficient at least 0: 5 -> 5.

    Coefficients that come out negative are fixed at 0 and the rest solved again. Costs
    only grow with batch size and width: a negative term would come from timing noise at
    batch sizes alike (a batch shrinking from 32 to 29), and extrapolate to absurd costs.
    """
    coefficients = np.linalg.solve(gram, moment)
    free = coefficients > 0
    while not (coefficients >= 0).all():
        coefficients = np.zeros(len(moment))
        coefficients[free] = np.linalg.solve(gram[np.ix_(free, free)], moment[free])
        free &= coefficients > 0
    return coefficients


class InvocationCost:
    """A running non-negative least-squares fit of invocation seconds on cost_features.

    Old timings fade by `forgetting` per timing: the fit follows the machine's load,
    and a width not timed for a long while fades to a cost of 0 (the ridge's pull),
    which makes choose_width try it again.
    """

    def __init__(self, forgetting=0.98, ridge=1e-9):
        self.forgetting, self.ridge = forgetting, ridge
        self.gram = np.zeros((5, 5))
        self.moment = np.zeros(5)
        self.coefficients = np.zeros(5)

    def update(self, width, batch_size, seconds):
        """One invocation of `width` over `batch_size` sentences took `seconds`.

        A timing over twice the prediction counts as twice it: on a shared CPU one
        preempted invocation would otherwise teach the fit a cost many times the real
        one. A lasting slow-down under 2x comes through whole, a larger one by steps.
        """
        x = cost_features(np.array([width]), batch_size)[0]
        predicted = x @ self.coefficients
        if predicted > 0:
            seconds = min(seconds, 2 * predicted)
        self.gram = self.forgetting * self.gram + np.outer(x, x)
        self.moment = self.forgetting * self.moment + seconds * x
        self.coefficients = nonnegative_solve(self.gram + self.ridge * np.eye(5), self.moment)

    def predict(self, widths, batch_size):
        """Seconds of an invocation of each width 1..k at this batch size: k -> k.

        A narrower block does a part of a wider one's work, so no width is predicted to
        cost more than a wider one: a fit from other batch sizes cannot keep the lean
        path from being tried where wide blocks were timed cheaper.
        """
        costs = cost_features(widths, batch_size) @ self.coefficients
        return np.minimum.accumulate(costs[::-1])[::-1]


class AcceptanceRates:
    """Per proposal j of a block: how often it was verified (its predecessors passed) and passed.

    Starts at one pass in one try each (rate 1), so the first blocks are full width
    and measure every head.
    """

    def __init__(self, proposals):
        self.passed = np.ones(proposals)
        self.tried = np.ones(proposals)

    def update(self, width, kept, limit):
        """A block of `width` kept `kept` (b, numpy) tokens, at most `limit` (b) allowed."""
        j = np.arange(1, width)  # proposal numbers
        tried = (kept[:, None] >= j) & (j < limit[:, None])  # b x w-1: reached, and could pass
        self.tried[: width - 1] += tried.sum(0)
        self.passed[: width - 1] += (kept[:, None] > j).sum(0)

    def rates(self):
        return self.passed / self.tried


class AdaptiveBlockwiseGenerator(BlockwiseGenerator):
    """BlockwiseGenerator whose every block width is chosen by choose_width (--blockwise-adaptive).

    `cost`: anything with InvocationCost's update/predict (tests pass fixed costs);
    `clock`: seconds, time.perf_counter by default. The rates and costs persist
    across the batches of a run.
    """

    def __init__(self, *args, cost=None, clock=time.perf_counter, **kwargs):
        super().__init__(*args, **kwargs)
        self.rates = AcceptanceRates(self.block_size - 1)
        self.cost = InvocationCost() if cost is None else cost
        self.clock = clock
        self.widths = np.arange(1, self.block_size + 1)
        self.timing = None  # (width, batch size, start) of the block under way

    def _generate(self, sample, bos_token=None):
        self.timing = None  # the last batch's final block was never timed to its end
        return super()._generate(sample, bos_token)

    def accepted_block(self, width, kept, limit):
        if width > 1:
            self.rates.update(width, kept.cpu().numpy(), limit.cpu().numpy())

    def propose(self, features, sentence, tokens, length):
        proposals = super().propose(features, sentence, tokens, length)
        if self.timing is not None:  # --blockwise-confidence may have cut the block: time what runs
            self.timing = (proposals.size(1) + 1, *self.timing[1:])
        return proposals

    def block_width(self, batch_size):
        """Time the block that ends here, then choose the next block's width."""
        now = self.clock()
        if self.timing is not None:
            width, size, start = self.timing
            self.cost.update(width, size, now - start)
        expected = expected_tokens(self.rates.rates())
        width = choose_width(expected, self.cost.predict(self.widths, batch_size))
        self.stats.widths[width] += 1
        self.timing = (width, batch_size, now)
        return width
