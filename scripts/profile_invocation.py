#!/usr/bin/env python
"""Where a decoder invocation's time goes: blockwise at fixed widths beside a greedy step.

Decodes the same sentences with fairseq's greedy SequenceGenerator and with
BlockwiseGenerator at each --widths, timing each part of the loop by wrapping it (the
wrappers cost a few microseconds a call, the same for every width). Prints a markdown
table of milliseconds per loop iteration (a greedy step, or one blockwise invocation)
and the invocation's cost relative to the greedy step. The encoder and the batch's setup
and hypotheses, made once a batch, are shown per loop iteration too, and left out of the
invocation (the total less them). Decodes on the GPU when torch sees one (--cpu: the
CPU); a GPU is synchronised around every timed part.

  .venv/bin/python scripts/profile_invocation.py --data DATA --path CKPT \
      [--batch-size 32] [--widths 1 2 4 8] [--max-sentences 128] [--trees 4 8 --rates RATES]

--trees adds --blockwise-tree blocks of those sizes at the checkpoint's full width, their
tree built from --rates (scripts/tree_rates.py's file; default: the built-in table).
--caches static incremental profiles each blockwise row on both of the decoder's caches
(the static cache and lean pass; fairseq's incremental state and block_layer), row by
row in one process, for an A/B comparison on a busy machine. --cpu-time times with the
process's CPU clock rather than the wall clock (steadier where other work shares the
cores). Two more rows count, over one more decoding of the same sentences, the tensor
operations a loop iteration runs and the host waits among them (a tensor read as a
Python number: a GPU's synchronisations), which no machine's load changes.
"""
import argparse
import collections
import time

import torch
from fairseq.sequence_generator import SequenceGenerator
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_bpd import bench

BLOCKWISE_PARTS = (  # (object name, method, label): the loop's steps, in order
    ("decoder", "forward_block", "decoder pass"),
    ("generator", "head1_lprobs", "head-1 projection, log-softmax"),
    ("generator", "verify_block", "verify, accept, commit"),
    ("batch", "store", "store"),
    ("batch", "store_one", "store"),  # a block of one at a column known on the host
    ("decoder", "crop_cache", "cache crop"),
    ("decoder", "reorder_incremental_state_scripting", "finished leave"),
    ("generator", "next_proposals", "proposals (heads 2..k)"),
    ("module", "encode", "encoder (once a batch)"),
    ("generator", "start", "batch setup, hypotheses"),
    ("generator", "retire", "batch setup, hypotheses"),
)
ONCE_A_BATCH = ("encoder (once a batch)", "batch setup, hypotheses")  # not the invocation's
GREEDY_PARTS = (
    ("ensemble", "forward_decoder", "decoder step, projection, log-softmax"),
    ("ensemble", "reorder_incremental_state", "finished leave (cache)"),
    ("generator", "finalize_hypos", "finalize"),
    ("ensemble", "forward_encoder", "encoder (once a batch)"),
)


# The operations by which torch reads a tensor as a Python number: where the host waits.
WAITS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}


class Operations(TorchDispatchMode):
    """Counts the tensor operations run inside it (after autograd, as dispatched) and the
    host waits among them."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def waits(self):
        return sum(count for name, count in self.counts.items() if name in WAITS)


def count_operations(generator, samples, model, iterations):
    """Tensor operations and host waits per loop iteration over one decoding of `samples`."""
    with Operations() as operations:
        bench.decode(generator, model, samples)
    return sum(operations.counts.values()) / iterations, operations.waits() / iterations


def profile(generator, objects, parts, samples, model, synchronize, clock=time.perf_counter):
    """Milliseconds per loop iteration for each part, 'rest', 'total' and 'invocation', the
    operations and host waits per iteration, and the iteration count."""
    bench.decode(generator, model, samples[:1])  # warm-up
    timer = bench.MethodProfiler(synchronize, clock)
    # A part this commit does not have (renamed) is left out: its time falls in 'rest'. The
    # first part runs once per loop iteration, and counts them.
    missing = [f"{name}.{method}" for name, method, _ in parts[1:] if not hasattr(objects[name], method)]
    if missing:
        print(f"not profiled (no such method here): {', '.join(missing)}", flush=True)
    found = [(objects[name], method, label) for name, method, label in parts if f"{name}.{method}" not in missing]
    with timer.wrapping(found):
        _, total = bench.decode(generator, model, samples, clock)
    iterations = timer.calls[parts[0][2]]
    row = {label: 1000 * timer.seconds[label] / iterations for _, _, label in found}
    row["rest"] = 1000 * total / iterations - sum(row.values())
    row["total"] = 1000 * total / iterations
    row["invocation"] = row["total"] - sum(row.get(label, 0.0) for label in ONCE_A_BATCH)
    row["operations"], row["host waits"] = count_operations(generator, samples, model, iterations)
    return row, iterations


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_data_args(ap)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-sentences", type=int, default=128)
    ap.add_argument("--trees", type=int, nargs="*", default=[], help="--blockwise-tree sizes to add")
    ap.add_argument("--rates", help="scripts/tree_rates.py's file for --trees (default: the built-in table)")
    ap.add_argument("--caches", nargs="+", choices=["static", "incremental"], default=["static"],
                    help="the decoder caches to profile each blockwise row on (default: static, the lean path)")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU clock, not the wall clock")
    bench.add_device_args(ap)
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    model, task, device, _ = bench.setup(args)
    samples = bench.batches(task, args.subset, args.batch_size, args.max_sentences, device)
    from fairseq_bpd import generator as blockwise_module
    from fairseq_bpd.tree import load_rates

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tgt_dict = task.target_dictionary
    greedy = SequenceGenerator([model], tgt_dict, beam_size=1)
    rows = {"greedy": profile(greedy, {"ensemble": greedy.model, "generator": greedy}, GREEDY_PARTS,
                              samples, model, synchronize, clock)}
    rates = load_rates(args.rates) if args.rates else None
    blockwise = {f"width {width}": dict(block_size=width) for width in args.widths}
    blockwise.update({f"tree {size}": dict(block_size=bench.full_width(model), tree=size, tree_rates=rates)
                      for size in args.trees})
    for name, options in blockwise.items():
        for cache in args.caches:
            model.decoder.static_cache = cache == "static"
            generator = bench.blockwise_generator(model, tgt_dict, options)
            objects = {"decoder": model.decoder, "generator": generator, "batch": blockwise_module.Batch,
                       "module": blockwise_module}
            label = name if args.caches == ["static"] else f"{name}, {cache}"
            rows[label] = profile(generator, objects, BLOCKWISE_PARTS, samples, model, synchronize, clock)
    model.decoder.static_cache = True
    step = rows["greedy"][0]["invocation"]
    print(f"{len(samples)} batches of {args.batch_size}, {bench.describe(device)}: ms per loop iteration "
          f"(a greedy step; a blockwise invocation), {'CPU' if args.cpu_time else 'wall'} time\n")
    labels = list(dict.fromkeys(label for _, _, label in GREEDY_PARTS + BLOCKWISE_PARTS)) + ["rest", "total", "invocation"]
    print("| part | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label in labels + ["operations", "host waits"]:
        digits = 1 if label in ("operations", "host waits") else 3
        cells = [f"{row[label]:.{digits}f}" if label in row else "" for row, _ in rows.values()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| iterations | " + " | ".join(str(n) for _, n in rows.values()) + " |")
    print("| relative to a greedy step | " + " | ".join(f"{row['invocation'] / step:.2f}x" for row, _ in rows.values()) + " |")


if __name__ == "__main__":
    main()
