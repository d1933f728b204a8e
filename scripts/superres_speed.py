#!/usr/bin/env python
"""Batch-1 decoding time of greedy and blockwise super-resolution, one markdown row per setting.

Greedy (fairseq's SequenceGenerator, beam 1) and blockwise decoding run in this one
process on the same images, alternating, after a warm-up; the ratio is of medians
over --repeats runs. Run it on a quiet machine (docs/superres.md).

  OMP_NUM_THREADS=1 .venv/bin/python scripts/superres_speed.py [--images 50] [--repeats 3]
      [--data work/digits-bin] [--path work/sr/finetune-k10/checkpoint_last.pt]
"""
import argparse
import os
import statistics
import sys
from argparse import Namespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch  # noqa: E402
from compare import batches, decode, load  # noqa: E402
from superres_benchmark import DATA, K, checkpoint  # noqa: E402


def speed(args):
    """Batch-1 decoding time of greedy and blockwise (median of --repeats), one markdown row each."""
    model, task, _ = load(args.path, args.data)
    samples = batches(task, "test", 1, args.images)
    print(f"torch threads {torch.get_num_threads()}, {len(samples)} images, batch size 1")
    print("| k | E | greedy s | blockwise s | speedup | mean accepted block |")
    print("|---|---|---|---|---|---|")

    def generator(blockwise, block_size=None, distance=0.0):
        task.cfg.blockwise, task.cfg.block_size, task.cfg.blockwise_distance = blockwise, block_size, distance
        return task.build_generator([model], Namespace(beam=1))

    greedy = generator(False)
    for block_size in (6, K):
        for distance in (0.0, 2.0):
            blockwise = generator(True, block_size, distance)
            decode(greedy, model, samples[:2])  # warm-up
            decode(blockwise, model, samples[:2])
            times = {"greedy": [], "blockwise": []}
            for _ in range(args.repeats):
                times["greedy"].append(decode(greedy, model, samples)[1])
                blockwise.stats.accepted.clear()
                times["blockwise"].append(decode(blockwise, model, samples)[1])
            g, b = statistics.median(times["greedy"]), statistics.median(times["blockwise"])
            print(f"| {block_size} | {distance:g} | {g:.2f} | {b:.2f} | {g / b:.2f}x | "
                  f"{blockwise.stats.mean_accepted_block():.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--path", default=checkpoint("finetune"))
    parser.add_argument("--images", type=int, default=50, help="the first N test images")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.chdir(os.path.dirname(HERE))
    speed(args)


if __name__ == "__main__":
    main()
