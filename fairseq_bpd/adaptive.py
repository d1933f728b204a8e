"""--blockwise-adaptive: each block's width chosen for the most accepted tokens per second.

A block of width w (the last committed token and w-1 proposals) is worth, per sentence,
1 + r1 + r1·r2 + ... + r1···r(w-1) tokens, r_j the rate at which proposal j passes
given that proposals 1..j-1 did (this run's counts). It costs one invocation, whose
time the policy measures on the generator and fits by batch size and width (InvocationCost).
Width 1 runs no proposal heads (the generator's lean path), so when the heads stop
paying the generator decodes at greedy's speed; the output is greedy's either way.
AdaptiveWidth is a width policy of the generator (beside generator.py's FixedWidth and
widths.py's TableWidth); `--blockwise` alone takes it where no width table was measured.
"""
import time
from collections import Counter

import numpy as np
import torch

from .generator import BlockwiseGenerator


def expected_tokens(rates):
    """Tokens a block of each width 1..k adds per sentence: rates k-1 -> k.

    rates[j-1]: how often proposal j passes when proposals 1..j-1 did.
    """
    return np.concatenate([[1.0], np.cumprod(rates)]).cumsum()


# A wider block is chosen only when it promises more than NARROWER_SLACK more tokens per
# second than a narrower one. Its timings miss a cost it leaves to the blocks after it: at
# batch > 1 its rejected entries stay in the cache as masked holes, which every later
# block attends over, so a width timed as barely faster is often slower in all.
NARROWER_SLACK = 0.05


def choose_width(expected, costs, slack=NARROWER_SLACK):
    """The narrowest width 1..k within `slack` of the most expected tokens per unit of cost: an int.

    expected, costs: k (costs of 0 are not yet measured: they win, which tries them).
    """
    rate = expected / np.maximum(costs, 1e-12)  # nothing real takes under a picosecond
    return int(np.argmax(rate >= rate.max() * (1 - slack))) + 1  # argmax: the first that is


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
    """A running non-negative least-squares fit of invocation seconds on cost_features,
    times a per-width correction.

    Old timings fade by `forgetting` per timing: the fit follows the machine's load,
    and a width not timed for a long while fades to a cost of 0 (the ridge's pull),
    which makes choose_width try it again. The fit is linear in the block's rows, the
    cost is not quite (a block's fixed work and its rows' share the same matrix products,
    whose speed varies with their shape): each timed width keeps a running ratio of its
    timings to the fit, within CORRECTION (an untimed width keeps 1, the line).
    """

    CORRECTION = (0.8, 1.25)  # a timing moves its width's ratio by at most this factor...
    CORRECTION_FADE = 0.95  # ...and by 5% of it: one preempted invocation hardly shows
    # Where a width was timed at this very batch size within the last MEASURED_FOR timings,
    # the median of its last MEASURED_LAST timings there stands instead of the fit: one line
    # through all batch sizes misjudges the middle ones, enough to choose a width that is
    # slower than its neighbour there.
    MEASURED_LAST, MEASURED_FOR = 5, 256

    def __init__(self, forgetting=0.98, ridge=1e-9):
        self.forgetting, self.ridge = forgetting, ridge
        self.gram = np.zeros((5, 5))
        self.moment = np.zeros(5)
        self._coefficients = np.zeros(5)
        self.ratio = {}  # width -> timings / fit
        self.pending = []  # (width, batch size, seconds) timed since the last fit
        self.features = {}  # (widths, batch size) -> cost_features rows
        self.timings = 0  # taken in so far
        self.measured = {}  # (batch size, width) -> (its last MEASURED_LAST timings, when the last came)

    def update(self, width, batch_size, seconds):
        """One invocation of `width` over `batch_size` sentences took `seconds`.

        A timing over twice the prediction counts as twice it: on a shared CPU one
        preempted invocation would otherwise teach the fit a cost many times the real
        one. A lasting slow-down under 2x comes through whole, a larger one by steps.
        Kept until the fit is next read (refit), or 16 have come: in the decoding loop
        each small numpy call is slow beside the tensor work it sits between (the model
        evicts its caches), so the fit is solved in batches.
        """
        self.pending.append((width, batch_size, seconds))
        self.timings += 1
        # The median of the last few needs no cap: one preempted timing is not the median.
        last = self.measured.get((batch_size, width), ((), 0))[0][1 - self.MEASURED_LAST:]
        self.measured[batch_size, width] = ((*last, seconds), self.timings)
        if len(self.pending) >= 16:
            self.refit()

    def rows(self, widths, batch_size):
        """cost_features, made once per (widths, batch size): m -> m x 5."""
        key = (tuple(widths), batch_size)
        if key not in self.features:
            self.features[key] = cost_features(np.asarray(widths), batch_size)
        return self.features[key]

    @property
    def coefficients(self):
        """The fit's 5 coefficients, solved again if timings came in since."""
        if self.pending:
            self.refit()
        return self._coefficients

    def refit(self):
        """Take in the pending timings, oldest first, solve the fit, then move each timed
        width's ratio towards its timings over the new fit."""
        x = np.concatenate([self.rows((width,), batch_size) for width, batch_size, _ in self.pending])  # m x 5
        seconds = np.array([timing for _, _, timing in self.pending])
        predicted = x @ self._coefficients
        seconds = np.where(predicted > 0, np.minimum(seconds, 2 * predicted), seconds)
        weights = self.forgetting ** np.arange(len(seconds) - 1, -1, -1.0)  # the newest weighs 1
        fade = self.forgetting ** len(seconds)
        self.gram = fade * self.gram + (x * weights[:, None]).T @ x
        self.moment = fade * self.moment + (weights * seconds) @ x
        self._coefficients = nonnegative_solve(self.gram + self.ridge * np.eye(5), self.moment)
        fitted = x @ self._coefficients
        fade = self.CORRECTION_FADE
        for (width, _, _), timing, fit in zip(self.pending, seconds.tolist(), fitted.tolist()):
            if fit > 0:
                ratio = min(max(timing / fit, self.CORRECTION[0]), self.CORRECTION[1])
                self.ratio[width] = fade * self.ratio.get(width, 1.0) + (1 - fade) * ratio
        self.pending = []

    def predict(self, widths, batch_size):
        """Seconds of an invocation of each width 1..k at this batch size: k -> k.

        A width recently timed at this batch size costs the median of its timings there;
        the others cost the fit. A narrower block does a part of a wider one's work, so
        no fitted width costs more than a wider one: a fit from other batch sizes cannot
        keep the lean path from being tried where wide blocks were timed cheaper.
        """
        coefficients = self.coefficients
        correction = np.array([self.ratio.get(int(w), 1.0) for w in widths])
        costs = self.rows(widths, batch_size) @ coefficients * correction
        measured = np.zeros(len(costs), dtype=bool)
        for i, width in enumerate(widths.tolist()):
            last, when = self.measured.get((batch_size, width), ((), 0))
            if last and self.timings - when < self.MEASURED_FOR:
                costs[i], measured[i] = sorted(last)[len(last) // 2], True  # a median, without numpy's overhead
        return np.where(measured, costs, np.minimum.accumulate(costs[::-1])[::-1])


class AcceptanceRates:
    """Per proposal j of a block: how often it was verified (its predecessors passed) and passed.

    Starts at one pass in one try each (rate 1), so the first blocks are full width
    and measure every head.
    """

    def __init__(self, proposals):
        self.passed = np.ones(proposals)
        self.tried = np.ones(proposals)
        # How many sentences reached (tried) and passed the first n proposals, by n: plain
        # Counters, folded into the arrays when the rates are read (see InvocationCost.update).
        self.reach, self.past = Counter(), Counter()

    def update(self, width, kept, limit):
        """A block of `width` kept `kept` (b) tokens, at most `limit` (b) allowed.

        Proposal j was tried when kept >= j and j < limit, and passed when kept > j.
        """
        for k, most in zip(kept.tolist(), limit.tolist()):
            self.reach[min(k, most - 1, width - 1)] += 1
            self.past[min(k - 1, width - 1)] += 1

    def rates(self):
        """Each proposal's pass rate: k-1. The starting pass of proposal j > 1 counts as the
        rate of proposal j-1, not as 1: deep proposals are rarely reached, and an optimistic
        start there made wide blocks look worth more than they are (rates fall with depth)."""
        for counts, total in ((self.reach, self.tried), (self.past, self.passed)):
            for n, sentences in counts.items():
                total[:n] += sentences
            counts.clear()
        rates, start = (self.passed - 1) / self.tried, 1.0
        for j, rate in enumerate(rates.tolist()):
            rates[j] = start = rate + start / self.tried[j]
        return rates


# The width is chosen again every DECIDE_EVERY blocks, or when the batch size changes;
# in between the last choice holds. Choosing (the fit, the rates, the prediction) is some
# 25 small numpy calls, a noticeable share of a small block if made every block. Every
# block is timed.
DECIDE_EVERY = 8

# Every EXPLORE_EVERY-th block takes another width: the one below the chosen width, the
# one above, then width 1, in turn. Timings of a single width cannot tell the fit's
# per-row cost from its intercept; without them the fit drifts to flat costs and the
# widest block. Width 1 (no heads) is the fallback whose cost must stay known: from
# width 3 its neighbours never reach it.
EXPLORE_EVERY = 8

# While explorations find the choice as it was at the last one, each next one comes twice
# as late, up to every EXPLORE_AT_MOST blocks; a changed choice brings them back to every
# EXPLORE_EVERY. An exploration decodes a block at a width judged worse, so a settled
# choice explores rarely.
EXPLORE_AT_MOST = 64


def neighbour(width, widest, turn):
    """The width to explore on `turn` from `width` in 1..widest: narrower, wider, then 1
    (turns 0, 1, 2 of every 3; the other side at either end, the wider one for a 1)."""
    if turn % 3 == 2 and width > 2:
        return 1
    step = -1 if turn % 3 == 0 else 1
    if not 1 <= width + step <= widest:
        step = -step
    return min(max(width + step, 1), widest)


class AdaptiveWidth:
    """The width policy of --blockwise-adaptive: every block's width chosen by choose_width.

    block_size: the widest block; stats: the generator's BlockwiseStats (widths chosen are
    counted there). `cost`: anything with InvocationCost's update/predict (tests pass fixed
    costs); `clock`: seconds, time.perf_counter by default; `explore_every`: every how many
    blocks a neighbouring width is timed (0: never), at first and whenever the choice
    changes (EXPLORE_AT_MOST). The rates and costs persist across the batches of a run.
    """

    def __init__(self, block_size, stats, cost=None, clock=time.perf_counter, explore_every=EXPLORE_EVERY):
        self.block_size, self.stats = block_size, stats
        self.rates = AcceptanceRates(block_size - 1)
        self.cost = InvocationCost() if cost is None else cost
        self.clock = clock
        self.explore_every = explore_every
        self.blocks = 0
        self.explorations = []  # the blocks (1, 2, ...) that explored
        self.explore_gap = explore_every  # blocks from one exploration to the next
        self.explored_from = None  # the width chosen when the last exploration came
        self.choice = None  # (batch size, width) last chosen
        self.widths = np.arange(1, block_size + 1)
        self.timing = None  # (width, batch size, start) of the block under way

    def start(self):
        self.timing = None  # the last batch's final block was never timed to its end

    def observe(self, width, kept, added, limit):
        """A block of `width` ran (--blockwise-confidence may have cut it: time what ran) and
        kept `kept` (b) of at most `limit` tokens, `added` of them before any EOS."""
        if self.timing is not None:
            self.timing = (width, *self.timing[1:])
        if width > 1:
            # A sentence that ended in the block tried its proposals up to its EOS and no
            # further: counted as a block that could hold its EOS and one output after it.
            ended = added + 1
            self.rates.update(width, torch.minimum(kept, ended), torch.minimum(limit, ended))

    def width(self, batch_size):
        """Time the block that ends here, then choose the next block's width."""
        now = self.clock()
        if self.timing is not None:
            width, size, start = self.timing
            self.cost.update(width, size, now - start)
        self.blocks += 1
        if self.choice is None or self.choice[0] != batch_size or self.blocks % DECIDE_EVERY == 0:
            expected, costs = expected_tokens(self.rates.rates()), self.cost.predict(self.widths, batch_size)
            width = choose_width(expected, costs)
            # A width never timed (cost 0) is tried once, then the choice is made again.
            self.choice = (batch_size, width) if costs[width - 1] > 0 else None
        else:
            width = self.choice[1]
        last = self.explorations[-1] if self.explorations else 0
        if self.explore_every and self.blocks >= last + self.explore_gap:
            settled = width == self.explored_from
            self.explore_gap = min(2 * self.explore_gap, EXPLORE_AT_MOST) if settled else self.explore_every
            self.explored_from = width
            self.explorations.append(self.blocks)
            width = neighbour(width, self.block_size, len(self.explorations))
        self.stats.widths[width] += 1
        # The block's time starts after the choice: choosing (every few blocks, and at the
        # blocks that explore) is no cost of the width chosen.
        self.timing = (width, batch_size, self.clock())
        return width


class AdaptiveBlockwiseGenerator(BlockwiseGenerator):
    """BlockwiseGenerator under --blockwise-adaptive: its width policy is an AdaptiveWidth,
    given `cost`, `clock` and `explore_every` (see AdaptiveWidth)."""

    implies = {"adaptive": True}

    def __init__(self, *args, cost=None, clock=time.perf_counter, explore_every=EXPLORE_EVERY, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = AdaptiveWidth(self.block_size, self.stats, cost, clock, explore_every)
