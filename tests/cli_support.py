"""A tiny blockwise model trained once through fairseq's CLIs, and helpers to run and read them.

Shared by test_cli.py and test_reliability.py: `trained` caches per directory, so a
pytest session that runs both trains once.
"""
import functools
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace


from conftest import PLUGIN

BIN = os.path.dirname(sys.executable)
# One thread per process: the machine has two cores, and a tiny model gains nothing.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # conftest's FAIRSEQ_BPD_WIDTHS included
BLOCK_SIZE = 3
TINY_ARCH = [
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--share-all-embeddings", "--dropout", "0",
]
TRAIN = [
    *TINY_ARCH, "--optimizer", "adam", "--lr", "0.01", "--max-tokens", "600", "--cpu",
    "--seed", "1", "--num-workers", "0", "--no-epoch-checkpoints", "--log-format", "simple",
    "--no-progress-bar",
]
# Test subsets of these sizes; fairseq-preprocess names the extra ones test1, test2, ...
TEST_SUBSETS = {"test": 20, "test1": 5, "test2": 9, "test3": 17}
SUMMARY = re.compile(
    r"blockwise: (?P<sentences>\d+) sentences, (?P<tokens>\d+) tokens, (?P<invocations>\d+) "
    r"decoder invocations, mean accepted block size (?P<mean>[\d.]+), "
    r"accepted block sizes \{(?P<histogram>[\d: ]*)\}"
)


def run(tool, *args, stdin=None, fails=False):
    """Run a fairseq CLI; returns its stdout and stderr together. Checks the exit status."""
    process = subprocess.run(
        [os.path.join(BIN, tool), *map(str, args)], input=stdin, capture_output=True,
        text=True, env=ENV, timeout=300,
    )
    output = process.stdout + process.stderr
    assert (process.returncode != 0) == fails, f"{tool} exited {process.returncode}:\n{output[-4000:]}"
    return output


class Runs:
    """Commands started two at a time (the machine has two cores); `runs[name]` waits for one.

    commands: {name: a function of no arguments}. A command's failure is raised where its
    result is read, so it fails only the tests that use it.
    """

    def __init__(self, commands, workers=2):
        self.pool = ThreadPoolExecutor(workers)
        self.futures = {name: self.pool.submit(command) for name, command in commands.items()}

    def __getitem__(self, name):
        return self.futures[name].result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)


def write_corpus(directory, seed=0):
    """Sentences of 3-8 words s0..s19 whose translation maps each sN to tN."""
    rng = random.Random(seed)
    splits = {"train": 300, "valid": 20, **TEST_SUBSETS}
    for split, n in splits.items():
        with open(f"{directory}/{split}.de", "w") as de, open(f"{directory}/{split}.en", "w") as en:
            for _ in range(n):
                words = [rng.randrange(20) for _ in range(rng.randint(3, 8))]
                de.write(" ".join(f"s{w}" for w in words) + "\n")
                en.write(" ".join(f"t{w}" for w in words) + "\n")


@functools.cache
def trained(root):
    """Preprocess the corpus and train a k=3 blockwise model on it (about 15 s)."""
    raw, data, save_dir = f"{root}/raw", f"{root}/bin", f"{root}/checkpoints"
    os.makedirs(raw)
    write_corpus(raw)
    run(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
        "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid",
        "--testpref", ",".join(f"{raw}/{split}" for split in TEST_SUBSETS),
        "--destdir", data, "--workers", "1",
    )
    run(
        "fairseq-train", data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--arch", "transformer_blockwise", "--block-size", BLOCK_SIZE,
        "--criterion", "blockwise_cross_entropy", *TRAIN, "--max-update", "500",
        "--disable-validation", "--save-interval", "100000", "--save-dir", save_dir,
    )
    return SimpleNamespace(
        root=root, raw=raw, data=data, save_dir=save_dir,
        checkpoint=f"{save_dir}/checkpoint_last.pt",
    )


def hypotheses(output):
    """fairseq's H-lines: {sentence id: (score, tokens)}."""
    found = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            sentence, score, tokens = (line[2:].split("\t") + [""])[:3]
            found[int(sentence)] = (float(score), tokens)
    return found


def assert_same_hypotheses(expected, actual):
    """Same tokens, and scores equal up to float32 rounding (a block pass sums in another order)."""
    assert sorted(actual) == sorted(expected)
    for i, (score, tokens) in expected.items():
        assert actual[i][1] == tokens, f"sentence {i}"
        assert abs(actual[i][0] - score) <= 1e-5 * max(1.0, abs(score)), f"sentence {i}"


def summary(output):
    """The generator's end-of-run line, parsed; fails if it is missing."""
    found = list(SUMMARY.finditer(output))
    assert len(found) == 1, f"expected one blockwise summary line, found {len(found)}:\n{output[-3000:]}"
    match = found[0]
    histogram = dict(map(int, entry.split(":")) for entry in match["histogram"].split())
    return SimpleNamespace(
        sentences=int(match["sentences"]), tokens=int(match["tokens"]),
        invocations=int(match["invocations"]), mean=float(match["mean"]), histogram=histogram,
    )
