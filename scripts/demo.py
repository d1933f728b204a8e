#!/usr/bin/env python
"""The one-command demo (`make demo`): greedy vs blockwise on the Bible test set.

Builds the default corpus (cached after the first run), restores the k=8 checkpoint
that scripts/recipe.sh trained (models/demo/), and prints one table: BLEU of greedy and
blockwise, mean accepted block size, decoder invocations and the wall-clock speedup at
batch sizes 1 and 32; then a few test sentences (source, reference, greedy and
blockwise output) and a plot of accepted block sizes. Decodes on the GPU when torch
sees one (--cpu: the CPU), and says which device it timed.
"""
import argparse
import hashlib
import json
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
MODEL_DIR = os.path.join(ROOT, "models", "demo")


def step(message):
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(*argv):
    subprocess.run([PYTHON, *argv], check=True, cwd=ROOT)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_corpus(data):
    step("default corpus: German-English Bible (cached after the first run)")
    run("scripts/get_bible.py")
    run("scripts/prepare_data.py", "--src", "de", "--tgt", "en", "--train", "data/bible-raw/train",
        "--valid", "data/bible-raw/valid", "--test", "data/bible-raw/test", "--out", data)


def restore_checkpoint(work, manifest, data):
    dictionary = os.path.join(data, "dict.en.txt")
    if sha256(dictionary) != manifest["dict_sha256"]:
        raise SystemExit(
            f"error: {dictionary} differs from the dictionary the shipped checkpoint was trained "
            "with; rebuild data/bible-bin with scripts/prepare_data.py defaults, or retrain with "
            "scripts/recipe.sh")
    checkpoint = os.path.join(work, "checkpoint.pt")
    if not os.path.exists(checkpoint):
        step("restoring the shipped checkpoint")
        run("scripts/pack_checkpoint.py", "unpack", os.path.join(MODEL_DIR, "checkpoint.int4.pt"), checkpoint)
    return checkpoint


def plot(histogram, path, k):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(range(1, k + 1))
    counts = [histogram.get(str(s), histogram.get(s, 0)) for s in sizes]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(sizes, counts, color="#4a7fb5")
    ax.set_xlabel("accepted block size")
    ax.set_ylabel("iterations")
    ax.set_title(f"Blockwise decoding, k={k}, Bible de-en test")
    ax.set_xticks(sizes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timing-sentences", type=int, default=200,
                    help="test sentences timed at batch size 1 (all are scored at batch size 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--examples", type=int, default=4, help="test sentences to print")
    ap.add_argument("--cpu", action="store_true", help="decode on the CPU even when torch sees a GPU")
    args = ap.parse_args()
    start = time.time()
    data, work = "data/bible-bin", os.path.join(ROOT, "work", "demo")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(MODEL_DIR, "manifest.json")) as f:
        manifest = json.load(f)
    build_corpus(data)
    checkpoint = restore_checkpoint(work, manifest, data)

    results = {}
    for name, batch_size, limit, repeats in (("quality", 32, None, 1),
                                             ("speed", 1, args.timing_sentences, args.repeats)):
        step(f"decoding the test set at batch size {batch_size} "
             f"({'all sentences' if limit is None else f'first {limit} sentences'}, "
             f"greedy and blockwise alternating, {repeats} run(s) each)")
        out = os.path.join(work, f"{name}.json")
        argv = ["scripts/compare.py", "--data", data, "--path", checkpoint, "--batch-size", str(batch_size),
                "--repeats", str(repeats), "--examples", str(args.examples), "--json", out]
        if args.cpu:
            argv.append("--cpu")
        if limit is not None:
            argv += ["--max-sentences", str(limit)]
        subprocess.run([PYTHON, *argv], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            results[name] = json.load(f)

    quality, speed = results["quality"], results["speed"]
    k = quality["block_size"]
    png = os.path.join(work, "accepted_blocks.png")
    plot(quality["accepted_histogram"], png, k)
    rows = [
        ("BLEU (test, sacrebleu)", f"{quality['bleu_greedy']:.2f}", f"{quality['bleu_blockwise']:.2f}"),
        ("identical to greedy", "", f"{quality['identical']}/{quality['sentences']}"),
        ("decoder invocations", str(quality["greedy_invocations"]), str(quality["blockwise_invocations"])),
        ("mean accepted block size", "1", f"{quality['mean_accepted_block']:.2f}"),
        (f"seconds, batch 1, {speed['sentences']} sentences (median of {args.repeats})",
         f"{speed['greedy_seconds']:.1f}", f"{speed['blockwise_seconds']:.1f}"),
        ("speedup at batch 1", "1.00x", f"{speed['speedup']:.2f}x"),
        ("seconds, batch 32, all sentences", f"{quality['greedy_seconds']:.1f}", f"{quality['blockwise_seconds']:.1f}"),
        ("speedup at batch 32", "1.00x", f"{quality['speedup']:.2f}x"),
    ]
    print()
    print(f"fairseq greedy (--beam 1) vs blockwise parallel decoding, k={k}, exact acceptance")
    print(f"{'':52s} {'greedy':>10s} {'blockwise':>12s}")
    for label, greedy, blockwise in rows:
        print(f"{label:52s} {greedy:>10s} {blockwise:>12s}")
    print(f"\naccepted block sizes: {quality['accepted_histogram']} (plot: {os.path.relpath(png, ROOT)})")
    print(f"timed on: {speed['device']}; demo took {time.time() - start:.0f} s")
    for i, example in enumerate(quality["examples"], 1):
        same = "identical" if example["greedy"] == example["blockwise"] else "DIFFERENT"
        print(f"\ntest sentence {i} (greedy and blockwise {same})")
        for label in ("source", "reference", "greedy", "blockwise"):
            print(f"  {label:10s} {example[label]}")


if __name__ == "__main__":
    main()
