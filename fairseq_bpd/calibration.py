"""Measuring a width table (widths.py's WidthTable): scripts/calibrate_widths.py and
python -m fairseq_bpd.speedup's widths step decode held-out batches at every width and
time them."""
import time
from collections import defaultdict

import numpy as np
import torch

from .errors import BlockwiseRequestError
from .generator import BlockwiseStats
from .options import BlockwiseOptions
from .widths import MARGIN, TableWidth, WidthTable, fingerprint, machine


class TimedWidths:
    """The width policy of a calibration (calibrate()): every block at the width `fixed`, which
    the calibration sets before each decode, each block timed by width and batch size.

    A run of one width is timed, not widths taking turns block by block: a block's cost
    depends on the blocks before it (the cache's shape, what the CPU's caches hold), so a
    narrow block timed between wide ones is not what a run of narrow blocks costs.
    seconds: {width: {batch size: [seconds of each block]}}, from one width() call to the
    next, a block's whole cycle from proposing to the crop (a batch's first pass, on BOS
    alone, and its last block are not timed); added, blocks: {width: tokens added,
    sentence-blocks}; decodes: {width: {batch size: {batch: [tokens, [seconds of each
    round]]}}}, whole decodes as calibrate() times them (ran()).
    """

    def __init__(self, widest, clock=time.perf_counter):
        self.widest, self.clock, self.fixed = widest, clock, 1
        self.timed = True  # False: a warm-up, nothing kept
        self.seconds = {width: defaultdict(list) for width in range(1, widest + 1)}
        self.added, self.blocks = defaultdict(int), defaultdict(int)
        self.decodes = {width: defaultdict(dict) for width in range(1, widest + 1)}
        self.timing = None  # (batch size, start) of the block under way

    def start(self):
        self.timing = None

    def width(self, batch_size):
        now = self.clock()
        if self.timing is not None and self.timed:
            size, start = self.timing
            self.seconds[self.fixed][size].append(now - start)
        self.timing = (batch_size, now)
        return self.fixed

    def observe(self, width, kept, added, limit):
        if self.timed:
            self.added[width] += int(added.sum())
            self.blocks[width] += added.numel()

    def ran(self, batch_size, batch, tokens, seconds):
        """Batch `batch` of `batch_size` sentences decoded at width `fixed`: `tokens` in `seconds`."""
        if self.timed:
            self.decodes[self.fixed][batch_size].setdefault(batch, [tokens, []])[1].append(seconds)

    def speeds(self):
        """{width: {batch size: tokens per second of whole decodes}}: each batch's median round."""
        return {w: {size: sum(tokens for tokens, _ in runs.values())
                    / sum(float(np.median(rounds)) for _, rounds in runs.values())
                    for size, runs in by_size.items()} for w, by_size in self.decodes.items()}

    def table(self, machine="", model="", least=3):
        """The WidthTable of what was timed: tokens per sentence-block, pooled seconds per width
        and the speeds of whole decodes."""
        expected = [self.added[w] / max(self.blocks[w], 1) if w > 1 else 1.0 for w in range(1, self.widest + 1)]
        # A wider block keeps at least what a narrower one would at the same position: a
        # narrower width measured higher is sampling noise.
        expected = np.maximum.accumulate(expected).tolist()
        costs = {w: pooled(self.seconds[w], least) for w in self.seconds}
        # Widths are compared at the pools every width was timed in: a width timed only at
        # small batches would extrapolate flat and look cheap where the others were measured.
        common = set.intersection(*({pool_of(b) for b in by_size} for by_size in costs.values()))
        if not common:
            raise BlockwiseRequestError(
                f"calibration: too few timed blocks to compare widths 1..{self.widest} at any batch size "
                f"(each width needs {least} in one pool of batch sizes): give more --sentences or --repeats")
        costs = {w: {b: c for b, c in by_size.items() if pool_of(b) in common} for w, by_size in costs.items()}
        return WidthTable(expected, costs, machine, model, self.speeds())


# A calibration pools the timings of nearby batch sizes (a batch of 128 shrinks through every
# size below it, a few blocks at each): sizes 1, 2-3, 4-7, 8-15, ... each make a pool.
def pool_of(batch_size):
    """The smallest batch size of `batch_size`'s pool: the power of 2 at most batch_size."""
    return 1 << (batch_size.bit_length() - 1)


# A pool's cost is this quantile of its timings, not their median: on a shared machine most
# timings may include another process's time slice, which is no cost of the width, and
# the lower quantiles of every width are the least disturbed alike.
QUANTILE = 0.25


def pooled(seconds, least=3):
    """{batch size: [seconds]} -> {batch size: seconds}: per pool (pool_of) of at least `least`
    timings, the median batch size in it and the QUANTILE of its timings; never less at a
    larger pool (monotone: an invocation over more rows costs no less)."""
    pools = defaultdict(list)
    for size, timings in seconds.items():
        pools[pool_of(size)] += [(size, timing) for timing in timings]
    kept = sorted((int(np.median([size for size, _ in pool])), float(np.quantile([t for _, t in pool], QUANTILE)))
                  for pool in pools.values() if len(pool) >= least)
    return dict(zip([size for size, _ in kept], nondecreasing([cost for _, cost in kept])))


def nondecreasing(values):
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a list."""
    blocks = []  # [mean, count] of runs merged so far
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean, count), (last, n) = blocks[-2], blocks.pop()
            blocks[-1] = [(mean * count + last * n) / (count + n), count + n]
    return [mean for mean, count in blocks for _ in range(count)]


# What a calibration decodes by default: SENTENCES spread over the split (or one batch, if
# larger) at each batch size, every width REPEATS times: a few minutes for k=8 on a small CPU.
SENTENCES, REPEATS = 48, 2


def calibrate(model, task, subset, batch_sizes, device, sentences=SENTENCES, repeats=REPEATS):
    """The WidthTable of `model` on this machine, measured on `subset` (scripts/calibrate_widths.py;
    python -m fairseq_bpd.speedup's widths step).

    Every width decodes every batch on its own; the widths take turns batch by batch, and
    the rounds repeat, so that load on a shared machine falls on all of them alike. Then,
    on a CPU of more than one torch thread, the table's own widths decode every batch at
    one thread and at torch's, in turn: one thread is the table's at a batch size where it
    was faster by MARGIN.
    """
    from . import bench  # the benchmark harness (sacrebleu and all), only when calibrating

    k = bench.full_width(model)
    generator = BlockwiseOptions(block_size=k).generator(model, task.target_dictionary)
    generator.policy = policy = TimedWidths(k)
    batches = {b: bench.batches(task, subset, b, max(sentences, b), device, spread=True) for b in batch_sizes}
    for batch_size, samples in batches.items():
        for turn in range(repeats + 1):  # turn 0 warms every width up: the first decode of a shape allocates
            policy.timed = turn > 0
            for index, sample in enumerate(samples[:1] if turn == 0 else samples):
                for policy.fixed in widths_in_turn(k, index + turn):
                    hypos, seconds = bench.decode(generator, model, [sample])
                    policy.ran(batch_size, index, sum(len(h["tokens"]) for h in hypos.values()), seconds)
        print(f"batch {batch_size}: {len(samples)} batches x {k} widths x {repeats} rounds timed", flush=True)
    table = policy.table(machine(device), fingerprint(model))
    if device.type == "cpu" and torch.get_num_threads() > 1:
        generator.policy = TableWidth(table, BlockwiseStats())
        table.threads = fastest_threads(generator, model, batches, repeats)
    return table


def fastest_threads(generator, model, batches, repeats):
    """{batch size: 1 where one thread decoded `batches` of that size under `generator` faster
    than torch's threads by MARGIN, else torch's}, the two taking turns batch by batch (each
    batch's median round); torch's threads restored after."""
    from . import bench

    most, fastest = torch.get_num_threads(), {}
    try:
        for batch_size, samples in batches.items():
            seconds = {count: defaultdict(list) for count in (1, most)}
            for turn in range(repeats + 1):  # turn 0 warms each count up
                for index, sample in enumerate(samples[:1] if turn == 0 else samples):
                    for count in (1, most) if (index + turn) % 2 else (most, 1):
                        torch.set_num_threads(count)
                        _, elapsed = bench.decode(generator, model, [sample])
                        if turn:
                            seconds[count][index].append(elapsed)
            total = {count: sum(float(np.median(rounds)) for rounds in by_batch.values())
                     for count, by_batch in seconds.items()}
            fastest[batch_size] = 1 if total[1] * MARGIN < total[most] else most  # a near-tie keeps torch's
            print(f"batch {batch_size}: " + ", ".join(f"{count} threads {total[count]:.2f} s" for count in total),
                  flush=True)
    finally:
        torch.set_num_threads(most)
    return fastest


def widths_in_turn(widest, turn):
    """Widths 1..widest, starting from another each turn: no width always decodes first."""
    return [1 + (turn + i) % widest for i in range(widest)]
