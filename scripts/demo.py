#!/usr/bin/env python
"""The one-command demo (`make demo`): greedy vs blockwise on the Bible test set.

Builds the default corpus (cached after the first run), restores the shipped k=8
checkpoint (models/demo/), measures this machine's width table for it once
(scripts/calibrate_widths.py), and prints one table: BLEU, mean accepted block size,
decoder invocations and the wall-clock speedup at batch sizes 1 and 32 of greedy,
`--blockwise` alone (its widths from the table), the fixed chain at the full k, the
best tree and `--blockwise-adaptive`, every blockwise row under the shipped proposal lexicon
(--blockwise-proposal-lexicon); then a few test sentences (source, reference, greedy and blockwise output)
and a plot of the chain's accepted block sizes. The numbers are scripts/speed.py's, run
twice (all sentences at batch 32, --timing-sentences at batch 1). Decodes on the GPU when
torch sees one (--cpu: the CPU), and says which device it timed.
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
TREE_RATES = os.path.join(MODEL_DIR, "checkpoint.int4.tree-rates.json")
# The rarer target tokens each source word brings to the draft's proposals (--blockwise-proposal-lexicon).
LEXICON = os.path.join(MODEL_DIR, "checkpoint.int4.lexicon.json")
# The blockwise rows shown beside greedy: scripts/speed.py's decoder specs, by their label:
# what --blockwise gives by itself, the chain at the checkpoint's k, the best tree there, and
# --blockwise-adaptive (widths learnt from the run itself, no table).
LABELS = {"default": "blockwise", "k": "chain at k", "tree:16": "tree of 16", "adaptive": "adaptive"}
ROWS = list(LABELS)


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
    checkpoint, packed = os.path.join(work, "checkpoint.pt"), os.path.join(MODEL_DIR, "checkpoint.int4.pt")
    # Unpacked again when the shipped file is newer (a pull that ships new heads).
    if not os.path.exists(checkpoint) or os.path.getmtime(packed) > os.path.getmtime(checkpoint):
        step("restoring the shipped checkpoint")
        run("scripts/pack_checkpoint.py", "unpack", packed, checkpoint)
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


def speed(data, checkpoint, out, batch_size, limit, repeats, examples=0, cpu=False):
    """scripts/speed.py's rows for greedy and ROWS at one batch size, by decoder."""
    argv = ["scripts/speed.py", "--data", data, "--path", checkpoint, "--rows", "greedy", *ROWS,
            "--tree-rates", TREE_RATES, "--proposal-lexicon", LEXICON, "--batch-sizes", str(batch_size), "--repeats", str(repeats), "--examples", str(examples), "--out", out]
    argv += ["--cpu"] * cpu + (["--max-sentences", str(limit)] if limit is not None else [])
    subprocess.run([PYTHON, *argv], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(out + ".json") as f:
        result = json.load(f)
    return {r["decoder"]: r for r in result["rows"]}, result


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
    step("the width table of this machine for --blockwise (measured once: scripts/calibrate_widths.py)")
    run("scripts/calibrate_widths.py", "--data", data, "--path", checkpoint, "--if-missing", *["--cpu"] * args.cpu)

    step("decoding the test set at batch size 32 (all sentences, greedy and blockwise in turn, 1 run each)")
    quality, report = speed(data, checkpoint, os.path.join(work, "quality"), 32, None, 1, args.examples, args.cpu)
    step(f"decoding the test set at batch size 1 (first {args.timing_sentences} sentences, "
         f"greedy and blockwise in turn, {args.repeats} runs each)")
    timed, _ = speed(data, checkpoint, os.path.join(work, "speed"), 1, args.timing_sentences, args.repeats,
                     cpu=args.cpu)

    show(quality, report, timed, args.repeats, work)
    print(f"demo took {time.time() - start:.0f} s")


def show(quality, report, timed, repeats, work):
    """The demo's table (quality at batch 32, speed at batch 1 and 32), the plot and the examples."""
    names = ["greedy", *ROWS]
    chain = quality["k"]
    k = chain["options"]["block_size"]
    png = os.path.join(work, "accepted_blocks.png")
    plot(chain["accepted_histogram"], png, k)
    lines = [
        ("BLEU (test, sacrebleu)", [f"{quality[n]['bleu']:.2f}" for n in names]),
        ("identical to greedy", [""] + [f"{quality[n]['identical']}/{quality[n]['sentences']}" for n in ROWS]),
        ("decoder invocations", [str(quality[n]["invocations"]) for n in names]),
        ("mean accepted block size", [f"{quality[n]['mean_accepted_block']:.2f}" for n in names]),
        (f"seconds, batch 1, {timed['greedy']['sentences']} sentences (median of {repeats})",
         [f"{timed[n]['seconds']:.1f}" for n in names]),
        ("speedup at batch 1", [f"{timed[n]['speedup']:.2f}x" for n in names]),
        ("seconds, batch 32, all sentences", [f"{quality[n]['seconds']:.1f}" for n in names]),
        ("speedup at batch 32", [f"{quality[n]['speedup']:.2f}x" for n in names]),
    ]
    print()
    print(f"fairseq greedy (--beam 1) vs blockwise parallel decoding (--blockwise, its widths chosen "
          f"by batch size; the chain of width k={k}; a tree of 16; --blockwise-adaptive), exact acceptance, "
          f"--blockwise-proposal-lexicon {os.path.relpath(LEXICON, ROOT)}")
    print(f"{'':52s} " + " ".join(f"{label:>12s}" for label in ["greedy", *map(LABELS.get, ROWS)]))
    for label, cells in lines:
        print(f"{label:52s} " + " ".join(f"{cell:>12s}" for cell in cells))
    chose = lambda row: "{" + " ".join(f"{w}:{n}" for w, n in row["widths_chosen"].items()) + "}"  # noqa: E731
    print(f"\nblock widths --blockwise chose (width:blocks): batch 1 {chose(timed['default'])}, "
          f"batch 32 {chose(quality['default'])}")
    print(f"accepted block sizes of the chain at k: {chain['accepted_histogram']} (plot: {os.path.relpath(png, ROOT)})")
    print(f"timed on: {report['run']['device']}, commit {report['run']['commit']}")
    for i, example in enumerate(report["examples"], 1):
        same = all(example[n] == example["greedy"] for n in ROWS)
        print(f"\ntest sentence {i} (greedy and blockwise {'identical' if same else 'DIFFERENT'})")
        for label, key in (("source", "source"), ("reference", "reference"), ("greedy", "greedy"),
                           ("blockwise", ROWS[0])):
            print(f"  {label:10s} {example[key]}")


if __name__ == "__main__":
    main()
