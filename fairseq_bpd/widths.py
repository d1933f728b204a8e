"""The default width policy of --blockwise: each block's width from a table measured on this machine.

A block of width w (the last committed token and w-1 proposals) adds e[w] tokens per
invocation, which depends on the checkpoint, and costs c[b][w] seconds at batch size b,
which depends on the model's shape, the code and the machine. scripts/calibrate_widths.py
measures both (calibration.py), decoding held-out sentences at every width, and writes a
WidthTable in the user's cache under a fingerprint of the model and the machine.
`--blockwise` alone finds it there (or takes `--blockwise-widths FILE`) and gives every block the width of most
expected tokens per second at the batch size still decoding: the batch shrinks as its
sentences finish, and the best width with it. Without a table for this model and machine
it decodes at width 1 (no proposals: the lean greedy step, which is never slower than
fairseq's own) and says how to measure one: learning costs while decoding
(--blockwise-adaptive, adaptive.py) pays its trials and timing noise, and on a shared or
small machine that measured slower than greedy. Exact either way: only the width changes.
"""
import functools
import hashlib
import json
import logging
import math
import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from .adaptive import choose_width
from .errors import BlockwiseRequestError
from .generator import FixedWidth

logger = logging.getLogger(__name__)

# Where calibrate_widths.py writes and --blockwise looks: $FAIRSEQ_BPD_WIDTHS, else the
# user's cache. Costs belong to the machine, not the checkpoint's folder, which may be
# shared or read-only.
CACHE_VARIABLE = "FAIRSEQ_BPD_WIDTHS"


# What a measured gain must exceed to leave the plain choice (width 1, torch's threads): a
# calibration decodes a few dozen sentences, and a gain of a few percent there was noise
# on a few hundred (a width 3 faster by 2% in the calibration decoded 10% slower).
MARGIN = 1.05


@dataclass
class WidthTable:
    """Measured tokens and seconds per invocation, by width 1..k and batch size.

    expected: k, tokens a block of each width adds per invocation. seconds: {width:
    {batch size: seconds of one invocation}}. machine, model: what they were measured on
    (machine() and fingerprint()). speeds: {width: {batch size: tokens per second}} of whole
    decodes of batches of that size at that width. threads: {batch size: torch threads} of
    the fastest whole decodes under this table's widths ({}: none measured).
    """

    expected: list
    seconds: dict
    machine: str = ""
    model: str = ""
    speeds: dict = field(default_factory=dict)
    threads: dict = field(default_factory=dict)

    def costs(self, batch_size):
        """Seconds of an invocation of each width at `batch_size`: k."""
        return np.array([cost_at(self.seconds[width], batch_size) for width in range(1, len(self.expected) + 1)])

    def width(self, batch_size):
        """The width of most expected tokens per second at `batch_size` among those allowed
        there (allowed()): an int (ties go narrower)."""
        expected = np.where(self.allowed(batch_size), self.expected, 0.0)
        return choose_width(expected, self.costs(batch_size), slack=0.0)

    def allowed(self, batch_size):
        """Which widths may be chosen at `batch_size`: k booleans. Width 1, and a wider width
        whose whole decodes were faster than width 1's by MARGIN at the largest batch size
        measured up to `batch_size` (the smallest, below them): a guard on the block costs,
        which leave out what a block's cycle does not hold."""
        allowed = np.ones(len(self.expected), dtype=bool)
        sizes = set(self.speeds.get(1, {})).intersection(*(by_size for by_size in self.speeds.values()))
        if sizes:
            size = measured_at(sizes, batch_size)
            allowed[1:] = [self.speeds[w][size] > MARGIN * self.speeds[1][size] for w in range(2, len(self.expected) + 1)]
        return allowed

    def threads_at(self, batch_size):
        """The torch threads of the fastest decodes of a batch of `batch_size` (as allowed()
        finds its measured size), or None where none were measured."""
        return self.threads[measured_at(self.threads, batch_size)] if self.threads else None


def measured_at(sizes, batch_size):
    """Of the batch sizes measured, the largest up to `batch_size`, else the smallest."""
    return max([b for b in sizes if b <= batch_size] or [min(sizes)])


def cost_at(points, batch_size):
    """One width's seconds at `batch_size`, from {batch size: seconds} measured at some.

    Linear between the nearest measured sizes; below the smallest its cost; above the
    largest the line through the last two, never falling (an invocation over more rows
    costs no less).
    """
    sizes = sorted(points)
    seconds = [points[b] for b in sizes]
    if batch_size <= sizes[-1] or len(sizes) == 1:
        return float(np.interp(batch_size, sizes, seconds))
    slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
    return seconds[-1] + slope * (batch_size - sizes[-1])


def save_table(table, path):
    """Write `table` as JSON to `path` (load_table reads it), making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    written = {"expected": table.expected, "seconds": by_width_out(table.seconds), "machine": table.machine,
               "model": table.model, "speeds": by_width_out(table.speeds),
               "threads": {str(b): count for b, count in sorted(table.threads.items())}}
    with open(path, "w") as f:
        json.dump(written, f, indent=1)


def by_width_out(values):
    """{width: {batch size: value}} with JSON's string keys, in order."""
    return {str(w): {str(b): v for b, v in sorted(by_size.items())} for w, by_size in sorted(values.items())}


def by_width_in(values):
    """by_width_out's inverse: {width: {batch size: float}}."""
    return {int(w): {int(b): float(v) for b, v in by_size.items()} for w, by_size in values.items()}


def load_table(path):
    """The WidthTable a calibrate_widths.py run wrote to `path`; refused by name when it holds none."""
    try:
        with open(path) as f:
            raw = json.load(f)
        expected = [float(e) for e in raw["expected"]]
        seconds, speeds = by_width_in(raw["seconds"]), by_width_in(raw.get("speeds", {}))
        threads = {int(b): count for b, count in raw.get("threads", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise BlockwiseRequestError(f"--blockwise-widths: cannot read a width table from {path} ({error!r})") from None
    if not isinstance(raw["expected"], list) or not expected or sorted(seconds) != list(range(1, len(expected) + 1)) \
            or not all(seconds.values()) or (speeds and sorted(speeds) != sorted(seconds)):
        raise BlockwiseRequestError(f"--blockwise-widths: {path} holds no list of tokens per block with seconds "
                                    f"for each of its widths (and speeds, if any)")
    values = [*expected, *(v for table in (seconds, speeds) for by_size in table.values() for v in by_size.values())]
    if not all(math.isfinite(v) and v > 0 for v in values) or min(expected) < 1:
        raise BlockwiseRequestError(f"--blockwise-widths: {path} holds a value that is no finite positive "
                                    f"cost or a block of under one token")
    if not all(isinstance(count, int) and not isinstance(count, bool) and count > 0 for count in threads.values()):
        raise BlockwiseRequestError(f"--blockwise-widths: {path} holds torch threads that are no positive count")
    return WidthTable(expected, seconds, raw.get("machine", ""), raw.get("model", ""), speeds, threads)


def machine(device):
    """The machine an invocation's cost belongs to, in words: the GPU, or the CPU's model,
    cores and torch threads; torch's version."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        name = ""
        if os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        where = f"{name or 'CPU'}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{where}, torch {torch.__version__}"


def fingerprint(model):
    """A short hash of the model's parameters (names, shapes, dtype and sums): a table's
    rates belong to one checkpoint. Kept per model until a parameter changes (its tensor,
    storage, dtype, device or version: half(), to(), load_state_dict and optimizer steps all
    change one; writing through `.data` in place changes none): the hub builds a generator
    for every translate() call, and hashing every weight each time would cost more than
    decoding a short sentence."""
    parameters = list(model.parameters())
    # Inference tensors keep no version: such a model is hashed every time.
    key = None if any(p.is_inference() for p in parameters) else \
        tuple((id(p), p.data_ptr(), p.dtype, p.device, p._version) for p in parameters)
    known = FINGERPRINTS.get(model)
    if key is not None and known is not None and known[0] == key:
        return known[1]
    digest = hashlib.sha1()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            digest.update(f"{name}{tuple(parameter.shape)}{parameter.dtype}{float(parameter.double().sum()):.6e}".encode())
    FINGERPRINTS[model] = (key, digest.hexdigest()[:16])
    return FINGERPRINTS[model][1]


FINGERPRINTS = weakref.WeakKeyDictionary()  # model -> (its parameters' identities and versions, fingerprint)


@functools.cache
def code_version():
    """A hash of this plugin's source files: an invocation's cost changes with the code, so a
    table measured before a change is not used after it."""
    digest = hashlib.sha1()
    folder = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def table_path(model, device=None):
    """Where the table of this model on this machine and this plugin's code is kept: a path."""
    device = next(model.parameters()).device if device is None else device
    key = hashlib.sha1(f"{fingerprint(model)} {machine(device)} {code_version()}".encode()).hexdigest()[:16]
    folder = os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fairseq_bpd", "widths")
    return os.path.join(folder, f"{key}.json")


class TableWidth:
    """The width policy of a WidthTable (the protocol of generator.py's FixedWidth): each
    block's width is table.width at the live batch size, chosen once per size; widths chosen
    are counted in `stats` (BlockwiseStats)."""

    observes = False  # the table is measured beforehand: no block's outcome changes a width

    def __init__(self, table, stats):
        self.table, self.stats = table, stats
        self.chosen = {}  # batch size -> width

    def start(self):
        pass

    def width(self, batch_size):
        width = self.chosen.get(batch_size)
        if width is None:
            width = self.chosen[batch_size] = self.table.width(batch_size)
        self.stats.widths[width] += 1
        return width

    def observe(self, width, kept, added, limit):
        pass


def default_policy(generator, options):
    """The width policy of `--blockwise` alone for `generator` (its model, block_size and
    stats): options.widths' table, else this model's table on this machine, else width 1."""
    path, given = options.widths, bool(options.widths)
    if not given:
        path = table_path(generator.model)
        if not os.path.exists(path):
            say_once(f"no width table for this model on this machine ({path}): decoding at width 1, "
                     f"greedy's step without proposals; scripts/calibrate_widths.py measures a table "
                     f"(several minutes), --block-size N fixes a width")
            return FixedWidth(1)
    try:
        table = load_table(path)
        if len(table.expected) != generator.block_size:
            raise BlockwiseRequestError(f"--blockwise-widths: {path} holds widths 1..{len(table.expected)}, "
                                        f"the checkpoint's k is {generator.block_size}")
    except BlockwiseRequestError as error:
        if given:
            raise
        # A table in the cache, not named by the user: say so without the flag's name.
        warn_once(f"this model's cached width table: {str(error).split(': ', 1)[1]}; decoding at width 1 "
                  f"(scripts/calibrate_widths.py measures the table again)")
        return FixedWidth(1)
    here = machine(next(generator.model.parameters()).device)
    if given and table.machine != here:
        logger.warning(f"--blockwise-widths: {path} was measured on {table.machine!r}, this is {here!r}")
    if given and table.model and table.model != fingerprint(generator.model):
        logger.warning(f"--blockwise-widths: {path} was measured for another model: its tokens per block "
                       f"are that model's heads'")
    return TableWidth(table, generator.stats)


def batch_threads(asked, policy, batch_size, caller):
    """The torch threads to decode a batch of `batch_size` with, or None to leave the caller's.

    asked: --blockwise-threads (0: not given); policy: the generator's width policy; caller:
    torch's threads now. A count asked for wins; else a width table's measured count at
    that batch size, never more than the caller's (a user's lower setting wins too).
    """
    if asked:
        return asked
    measured = policy.table.threads_at(batch_size) if isinstance(policy, TableWidth) else None
    return None if measured is None else min(measured, caller)


def with_batch_threads(generator, asked):
    """`generator`'s generate, each batch decoded under batch_threads' torch threads and the
    caller's restored after: a function to set as its generate."""
    generate = generator.generate

    @functools.wraps(generate)
    def threaded(models, sample, *args, **kwargs):
        caller = torch.get_num_threads()
        count = batch_threads(asked, generator.policy, sample["net_input"]["src_tokens"].size(0), caller)
        if count is None or count == caller:
            return generate(models, sample, *args, **kwargs)
        torch.set_num_threads(count)
        try:
            return generate(models, sample, *args, **kwargs)
        finally:
            torch.set_num_threads(caller)

    return threaded


@functools.cache
def warn_once(message):
    """Warn of `message` the first time only: the hub builds a generator every translate()."""
    logger.warning(message)


@functools.cache
def say_once(message):
    """Log `message` the first time only: a benchmark builds a generator every round."""
    logger.info(message)
