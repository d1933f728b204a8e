"""Target tokens per second of frozen-head training: fairseq-train's wps in a short run.

A train_heads.sh (this clone's, or a worktree's of another commit, whose own .venv it runs)
trains for --updates updates with no checkpoints and no validation; what is measured is
fairseq's wps, the target words per second of each --log-interval of updates, read from the
log's train_inner lines past the first --skip updates (start-up and the first batches'
allocations); it prints their mean and each. One run per call, so that runs of two commits
can be interleaved.

Usage: python scripts/train_speed.py TRAIN_HEADS_SH DATA BASE [--k 8] [--updates 60]
       [--skip 10] [--threads 2] [--log LOG] -- [flags after train_heads.sh's frozen]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

WPS = re.compile(r"\bwps=([\d.]+)")
UPDATES = re.compile(r"\bnum_updates=(\d+)")


def wps_lines(log_text, skip):
    """(num_updates, wps) of each train_inner line (--log-format simple) past the first
    `skip` updates."""
    rows = [(int(UPDATES.search(line).group(1)), float(WPS.search(line).group(1)))
            for line in log_text.splitlines() if "| train_inner |" in line]
    return [(updates, wps) for updates, wps in rows if updates > skip]


def train(script, data, base, k, updates, threads, flags):
    """The log of one short frozen training (stdout and stderr together)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as save:
        # The user's flags after ours: a --log-interval of theirs wins (argparse keeps the last).
        command = ["bash", script, data, base, save, str(k), "frozen", "--log-interval", "10", *flags,
                   "--max-update", str(updates), "--no-save", "--disable-validation"]
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"error: {script} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return done.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script")
    parser.add_argument("data")
    parser.add_argument("base")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log", help="also write fairseq-train's log here")
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    args, flags = parser.parse_args(sys.argv[1:split]), sys.argv[split + 1:]
    log = train(os.path.abspath(args.script), os.path.abspath(args.data), os.path.abspath(args.base),
                args.k, args.updates, args.threads, flags)
    if args.log:
        with open(args.log, "w") as out:
            out.write(log)
    rows = wps_lines(log, args.skip)
    if not rows:
        sys.exit(f"error: no train_inner line past update {args.skip}:\n{log[-3000:]}")
    values = [wps for _, wps in rows]
    print(f"wps {statistics.mean(values):.0f} (updates {rows[0][0]}..{rows[-1][0]}: "
          f"{' '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
