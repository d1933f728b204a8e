#!/usr/bin/env python
"""Stern et al. (2018) Tables 1 and 4 on the default corpus; writes docs/results.md and plots.

Resumable: every trained model lives in work/bench/ (training resumes from its
checkpoint_last.pt) and every measurement is cached as JSON beside it, so a rerun
does only what is missing; `--report` rewrites the page from the cache alone.
One k=10 model per (targets, training mode) is decoded with --block-size 2..10.

  .venv/bin/python scripts/benchmark.py [--base work/base/checkpoint_last.pt]
      [--head-updates 150] [--distill-sentences 10000] [--report]
"""
import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORK = os.path.join("work", "bench")
DATA = "data/bible-bin"
DISTILLED = os.path.join(WORK, "distill")
K = 10
BLOCK_SIZES = (2, 4, 6, 8, 10)
TOPKS = ((8, 2), (8, 3), (10, 2), (10, 3))  # (block size, top-N) for distilled + fine-tuned
# Trained in this order so that an interrupted run has the model the targets are about.
MODES = [("distilled", "finetune"), ("original", "finetune"), ("distilled", "frozen"), ("original", "frozen")]
# The paper's numbers quoted in this project's brief (WMT14 En-De dev, transformer_base);
# the rest of its Tables 1 and 4 is left to the paper rather than retyped unverified.
PAPER_TABLE1 = {("distilled", "finetune"): {8: "4.69 (26.11; greedy 26.00)"}}
PAPER_TOPK = {(10, 2): "5.67"}
PAPER_SPEEDUP = {8: "3.31x"}
SHORTLIST = 2000  # --blockwise-proposal-vocab for the second speed column
B32_SENTENCES = 320  # sentences timed at batch size 32


def sh(argv, env=None):
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, cwd=ROOT, env={**os.environ, **(env or {})})


def cached(name, compute):
    path = os.path.join(WORK, name + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = compute()
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return result


def train(base, head_updates, distill_sentences):
    if not os.path.exists(os.path.join(DISTILLED, "dict.en.txt")):
        sh(["scripts/distill.sh", DATA, base, DISTILLED, "--user-dir", "fairseq_bpd"],
           env={"SENTENCES": str(distill_sentences)})
    data = {"original": DATA, "distilled": DISTILLED}
    for targets, mode in MODES:
        save = os.path.join(WORK, f"{targets}-{mode}-k{K}")
        os.makedirs(save, exist_ok=True)
        sh(["scripts/train_heads.sh", data[targets], base, save, str(K), mode, "--head-ffn-dim", "128",
            "--max-update", str(head_updates), "--log-file", os.path.join(save, "train.log")])


def checkpoint(targets, mode):
    return os.path.join(WORK, f"{targets}-{mode}-k{K}", "checkpoint_last.pt")


def tokens_by_id(hypos):
    return {str(i): h["tokens"].tolist() for i, h in hypos.items()}


def quality(model, task, samples, references, generator):
    """BLEU and output tokens of one decoder over the test set (batch size 32)."""
    from fairseq_bpd import bench

    hypos, seconds = bench.decode(generator, model, samples)
    detok = bench.detokenizer(task)
    lines = {i: detok(h["tokens"]) for i, h in hypos.items()}
    result = {"bleu": bench.bleu(lines, references), "seconds": seconds, "tokens": tokens_by_id(hypos)}
    stats = getattr(generator, "stats", None)
    if stats is not None:
        result.update(mean_accepted_block=stats.mean_accepted_block(), invocations=stats.invocations,
                      accepted_histogram=dict(sorted(stats.accepted.items())))
    return result


def profile(model, task, samples, block_size):
    """Where a batch-1 invocation's time goes: decoder pass, head-1 scoring, proposals, the rest."""
    from fairseq.sequence_generator import SequenceGenerator
    from fairseq_bpd import bench

    greedy = SequenceGenerator([model], task.target_dictionary, beam_size=1)
    blockwise = bench.blockwise_generator(model, task.target_dictionary, {"block_size": block_size})
    timer = bench.MethodProfiler()
    parts = [(greedy.model, "forward_decoder", "greedy decoder step"),
             (model.decoder, "forward_block", "decoder pass over the block"),
             (blockwise, "head1_lprobs", "head-1 projection and log-softmax over the block"),
             (blockwise, "propose", "heads 2..k: feed-forward layer and projection (proposals)"),
             (model.decoder, "crop_cache", "cache crop")]
    with timer.wrapping([part for part in parts if hasattr(part[0], part[1])]):
        greedy_hypos, greedy_seconds = bench.decode(greedy, model, samples)
        blockwise_hypos, blockwise_seconds = bench.decode(blockwise, model, samples)
    greedy_steps = sum(len(h["tokens"]) for h in greedy_hypos.values())
    invocations = blockwise.stats.invocations
    return {
        "sentences": len(samples), "block_size": block_size,
        "greedy_ms_per_step": 1e3 * greedy_seconds / greedy_steps,
        "blockwise_ms_per_invocation": 1e3 * blockwise_seconds / invocations,
        "parts_ms": {label: 1e3 * seconds / (greedy_steps if label == "greedy decoder step" else invocations)
                     for label, seconds in timer.seconds.items()},
    }


def speed(checkpoint, name, rows, batch_size, sentences, repeats):
    """scripts/speed.py's rows (greedy and `rows`) by decoder spec, measured once into WORK/NAME.json."""
    out = os.path.join(WORK, name)
    if not os.path.exists(out + ".json"):
        sh([sys.executable, "scripts/speed.py", "--data", DATA, "--path", checkpoint, "--rows", "greedy", *rows,
            "--batch-sizes", str(batch_size), "--max-sentences", str(sentences), "--repeats", str(repeats),
            "--out", out])
    with open(out + ".json") as f:
        return {r["decoder"]: r for r in json.load(f)["rows"]}


def measure(timing_sentences, repeats, test_sentences=None):
    import torch
    from fairseq.sequence_generator import SequenceGenerator
    from fairseq_bpd import bench

    references = bench.raw_lines(DATA, "test", "en")
    results = {}
    for targets, mode in MODES:
        name = f"{targets}-{mode}"
        if not os.path.exists(checkpoint(targets, mode)):
            print(f"skipping {name}: not trained", flush=True)
            continue
        model, task, load_seconds = bench.load(checkpoint(targets, mode), DATA)
        samples = bench.batches(task, "test", 32, test_sentences)
        dictionary = task.target_dictionary
        results[f"{name}-greedy"] = cached(f"{name}-greedy", lambda: quality(
            model, task, samples, references, SequenceGenerator([model], dictionary, beam_size=1)))
        settings = [(k, 1) for k in BLOCK_SIZES] + (list(TOPKS) if name == "distilled-finetune" else [])
        for k, topk in settings:
            results[f"{name}-k{k}-top{topk}"] = cached(f"{name}-k{k}-top{topk}", lambda: quality(
                model, task, samples, references,
                bench.blockwise_generator(model, dictionary, {"block_size": k, "topk": topk})))
        if name != "distilled-finetune":
            continue
        results["beam4"] = cached("beam4", lambda: quality(
            model, task, samples, references, SequenceGenerator([model], dictionary, beam_size=4)))
        results["load_seconds"] = load_seconds
        widths = [f"width:{k}" for k in BLOCK_SIZES]
        b1 = speed(checkpoint(targets, mode), "speed-b1", widths + [f"{w},proposal_vocab={SHORTLIST}" for w in widths],
                   1, timing_sentences, repeats)
        for k, width in zip(BLOCK_SIZES, widths):
            results[f"speed-b1-k{k}"] = b1[width]
            results[f"speed-b1-k{k}-shortlist"] = b1[f"{width},proposal_vocab={SHORTLIST}"]
        results["speed-b32-k8"] = speed(checkpoint(targets, mode), "speed-b32", ["width:8"], 32, B32_SENTENCES,
                                        repeats)["width:8"]
        timing = bench.batches(task, "test", 1, timing_sentences)
        results["profile-k8"] = cached("profile-k8", lambda: profile(model, task, timing[:50], 8))
        results["machine"] = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                              "processor": platform.processor() or platform.machine(),
                              "torch": torch.__version__}
    return results


def trained_updates(targets, mode):
    from fairseq.checkpoint_utils import load_checkpoint_to_cpu  # allow-listed by the plugin (measure loads it)

    path = checkpoint(targets, mode)
    if not os.path.exists(path):
        return None
    return load_checkpoint_to_cpu(path)["optimizer_history"][-1]["num_updates"]


def differing(results, name):
    """Sentence ids whose blockwise output differs from greedy's."""
    greedy = results[f"{name.rsplit('-k', 1)[0]}-greedy"]["tokens"]
    return sorted((i for i, t in results[name]["tokens"].items() if greedy[i] != t), key=int)


def plots(results, directory="docs"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(ax, name, field, **style):
        """`field` of results[name(k)] against k, for the k that were measured."""
        ks = [k for k in BLOCK_SIZES if name(k) in results]
        ax.plot(ks, [results[name(k)][field] for k in ks], **style)

    def save(fig, ax, ylabel, filename):
        ax.set_xlabel("k (block size)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(BLOCK_SIZES)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, filename), dpi=120)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for targets, mode in MODES:
        curve(ax, lambda k: f"{targets}-{mode}-k{k}-top1", "mean_accepted_block",
              marker="o", label=f"{targets}, {mode}")
    save(fig, ax, "mean accepted block size", "mean_block_vs_k.png")

    fig, ax = plt.subplots(figsize=(5, 3.4))
    curve(ax, lambda k: f"speed-b1-k{k}", "speedup", marker="o", label="ours, batch 1, CPU")
    curve(ax, lambda k: f"speed-b1-k{k}-shortlist", "speedup", marker="s",
          label=f"ours, proposals from {SHORTLIST} types")
    ax.plot([8], [3.31], marker="*", markersize=12, linestyle="none", label="paper, k=8 (GPU)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    save(fig, ax, "speedup over fairseq --beam 1", "speedup_vs_k.png")


def target_rows(results, updates):
    """The paper's figures for distilled + fine-tuned k=8 as targets, against what was measured."""
    quality, speed = results.get("distilled-finetune-k8-top1"), results.get("speed-b1-k8")
    greedy, prof = results.get("distilled-finetune-greedy"), results.get("profile-k8")
    if not (quality and speed and greedy and prof):
        return []
    exact = [f"{targets}, {mode} k={k}" for targets, mode in MODES for k in BLOCK_SIZES
             if f"{targets}-{mode}-k{k}-top1" in results and differing(results, f"{targets}-{mode}-k{k}-top1")]
    ratio = prof["blockwise_ms_per_invocation"] / prof["greedy_ms_per_step"]
    block = quality["mean_accepted_block"]
    return [
        "", "## Targets (distilled + fine-tuned, k=8)", "",
        "| target | wanted | measured | missed by |", "|---|---|---|---|",
        f"| mean accepted block | ≥ 4.7 | {block:.2f} | {max(0.0, 4.7 - block):.2f} |",
        f"| BLEU against greedy | within 1 | {quality['bleu']:.2f} vs {greedy['bleu']:.2f} | "
        f"{max(0.0, abs(quality['bleu'] - greedy['bleu']) - 1):.2f} |",
        f"| batch-1 speedup | ≥ 3x | {speed['speedup']:.2f}x | {max(0.0, 3 - speed['speedup']):.2f}x |",
        f"| exact mode identical to greedy | 100% | "
        f"{'100%' if not exact else 'not everywhere: ' + ', '.join(exact)} | "
        f"{'-' if not exact else 'see the exactness table'} |",
        "",
        "What limits it:",
        "",
        f"- **Undertrained heads.** Each model trained its heads for "
        f"{updates.get(('distilled', 'finetune'))} updates. A k=10 update costs about 7.6 s on "
        "this CPU: ten label-smoothed softmaxes over 7,936 types for about 3,500 target tokens. "
        "The paper trains for hundreds of thousands of steps on GPUs. The training logs' "
        "teacher-forced `acc_h2..acc_h10` stay far below head 1's, so a block rarely survives "
        "past its second token.",
        f"- **A block pass is not free on a CPU.** One invocation costs {ratio:.2f}x a greedy "
        f"step ({prof['blockwise_ms_per_invocation']:.2f} ms vs {prof['greedy_ms_per_step']:.2f} ms, "
        "table above). The decoder layers, the head-1 projection and the log-softmax all run "
        "over k positions, and the proposals add k-1 more projection rows. On the paper's GPU "
        "these extra rows cost almost nothing; here the speedup is about the mean block divided "
        f"by {ratio:.2f}. Reaching 3x would take a mean block near {3 * ratio:.1f}.",
        "- **Batch 32.** There a greedy step is already compute-bound, so the rejected "
        "positions of every block are paid in full.",
    ]


def report(results, args, path="docs/results.md"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plots(results)
    out = ["# Results: Stern et al. 2018 on the Bible de-en corpus", "",
           "Generated by `scripts/benchmark.py` (the command is at the end). German to English, "
           "test set = Judges + Romans (1,051 sentences), BLEU by sacrebleu on detokenised output "
           "against the raw references. One k=10 model per row, decoded with `--block-size k` "
           "(the paper trains one model per k). The paper's numbers are from WMT14 En-De with "
           "transformer_base on a GPU; ours come from a 3-layer, 256-wide model trained for "
           "minutes on a 2-core CPU, so compare trends, not levels.", ""]
    updates = {m: trained_updates(*m) for m in MODES}
    out += ["Head training: " + ", ".join(f"{t} + {m}: {u} updates" for (t, m), u in updates.items()) + ".", ""]
    out += ["## Table 1: mean accepted block size (BLEU), exact acceptance", "",
            "| targets, training | greedy BLEU | " + " | ".join(f"k={k}" for k in BLOCK_SIZES) + " |",
            "|---|---|" + "---|" * len(BLOCK_SIZES)]
    for targets, mode in MODES:
        greedy = results.get(f"{targets}-{mode}-greedy")
        if not greedy:
            continue
        cells = []
        for k in BLOCK_SIZES:
            r = results.get(f"{targets}-{mode}-k{k}-top1")
            cell = f"{r['mean_accepted_block']:.2f} ({r['bleu']:.2f})" if r else "n/a"
            paper = PAPER_TABLE1.get((targets, mode), {}).get(k)
            cells.append(cell + (f"; paper {paper}" if paper else ""))
        out.append(f"| {targets}, {mode} | {greedy['bleu']:.2f} | " + " | ".join(cells) + " |")
    if "beam4" in results:
        out += ["", f"Quality reference: fairseq `--beam 4` on the distilled + fine-tuned model: "
                f"BLEU {results['beam4']['bleu']:.2f}."]
    out += ["", "### Approximate acceptance (distilled + fine-tuned)", "",
            "| k | top-N | mean accepted block | BLEU | identical to greedy | paper |", "|---|---|---|---|---|---|"]
    for k, topk in TOPKS:
        r = results.get(f"distilled-finetune-k{k}-top{topk}")
        if r:
            same = len(r["tokens"]) - len(differing(results, f"distilled-finetune-k{k}-top{topk}"))
            out.append(f"| {k} | {topk} | {r['mean_accepted_block']:.2f} | {r['bleu']:.2f} | "
                       f"{same}/{len(r['tokens'])} | {PAPER_TOPK.get((k, topk), '-')} |")
    out += ["", "## Exactness in float32", "",
            "Share of test sentences whose blockwise-exact output (batch size 32) is token for token "
            "fairseq's `--beam 1` output on the same model.", "",
            "| model | " + " | ".join(f"k={k}" for k in BLOCK_SIZES) + " |", "|---|" + "---|" * len(BLOCK_SIZES)]
    differ = []
    for targets, mode in MODES:
        cells, diffs = [], []
        for k in BLOCK_SIZES:
            name = f"{targets}-{mode}-k{k}-top1"
            if name in results:
                d = differing(results, name)
                cells.append(f"{len(results[name]['tokens']) - len(d)}/{len(results[name]['tokens'])}")
                diffs += [f"k={k}: {i}" for i in d]
        if cells:
            out.append(f"| {targets}, {mode} | " + " | ".join(cells) + " |")
        if diffs:
            differ.append(f"{targets}, {mode}: sentence " + ", ".join(diffs))
    if differ:
        out += ["", "Sentences that differ (test-set id by k): " + "; ".join(differ) + ". A difference "
                "comes from a float32 tie: two tokens whose head-1 log-probs are equal in float32 "
                "resolve differently in a k-row matrix product than in fairseq's one-row step. "
                "Check such a sentence in float64 (the tests compare in float64)."]
    out += ["", "## Table 4: wall-clock speedup over fairseq `--beam 1` (distilled + fine-tuned)", ""]
    machine = results.get("machine", {})
    out += [f"Machine: {machine.get('cpus')} CPU cores, {machine.get('torch_threads')} torch threads, "
            f"torch {machine.get('torch')}, no GPU. Both decoders in one process on the same batches, "
            f"alternating, after a warm-up; decoding only, medians of {args.repeats} runs. "
            f"Loading the model took {results.get('load_seconds', float('nan')):.1f} s (not timed).", "",
            f"The shortlist rows propose among the {SHORTLIST} most frequent types "
            f"(`--blockwise-proposal-vocab {SHORTLIST}`); verification is over the whole vocabulary.", "",
            "| k | batch | proposals | sentences | greedy s | blockwise s | speedup | paper | mean block | identical |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(k, 1, kind, results.get(f"speed-b1-k{k}{suffix}")) for k in BLOCK_SIZES
            for kind, suffix in (("all types", ""), ("shortlist", "-shortlist"))]
    rows.append((8, 32, "all types", results.get("speed-b32-k8")))
    for k, batch, kind, r in rows:
        if r:
            out.append(f"| {k} | {batch} | {kind} | {r['sentences']} | {r['baseline_seconds']:.1f} | "
                       f"{r['seconds']:.1f} | {r['speedup']:.2f}x | "
                       f"{PAPER_SPEEDUP.get(k, '-') if batch == 1 else '-'} | "
                       f"{r['mean_accepted_block']:.2f} | {r['identical']}/{r['sentences']} |")
    prof = results.get("profile-k8")
    if prof:
        out += ["", "### Where the time goes (k=8, batch 1, first 50 sentences)", "",
                f"A greedy step costs {prof['greedy_ms_per_step']:.2f} ms; a blockwise invocation "
                f"{prof['blockwise_ms_per_invocation']:.2f} ms "
                f"({prof['blockwise_ms_per_invocation'] / prof['greedy_ms_per_step']:.2f}x), so the "
                "speedup is the mean accepted block divided by that ratio.", "",
                "| part | ms |", "|---|---|"]
        for label, ms in prof["parts_ms"].items():
            out.append(f"| {label} | {ms:.2f} |")
        rest = prof["blockwise_ms_per_invocation"] - sum(
            ms for label, ms in prof["parts_ms"].items() if label != "greedy decoder step")
        out.append(f"| blockwise: verify, accept, commit (Python and small ops) | {rest:.2f} |")
    out += target_rows(results, updates)
    out += ["", "![mean accepted block size against k](mean_block_vs_k.png)",
            "![speedup against k](speedup_vs_k.png)", "",
            "## Commands", "", "```",
            "scripts/train_base.sh data/bible-bin work/base --max-update 1400",
            f".venv/bin/python scripts/benchmark.py --base {args.base} --head-updates {args.head_updates} "
            f"--distill-sentences {args.distill_sentences} "
            f"--timing-sentences {args.timing_sentences} --repeats {args.repeats}",
            "```", "", "which runs `scripts/distill.sh` (beam 4, lenpen 0.6) and `scripts/train_heads.sh` "
            f"(k={K}, `--head-ffn-dim 128`) for each row, then `scripts/speed.py` for the timings "
            "(greedy and every width in one run, in turn, round by round)."]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


def main():
    global WORK, DISTILLED
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="work/base/checkpoint_last.pt")
    ap.add_argument("--head-updates", type=int, default=150)
    ap.add_argument("--distill-sentences", type=int, default=10000)
    ap.add_argument("--timing-sentences", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--test-sentences", type=int, default=None, help="score only the first N (a smoke run)")
    ap.add_argument("--work", default=WORK, help="where models and measurements are kept")
    ap.add_argument("--only-train", action="store_true")
    ap.add_argument("--report", action="store_true", help="no training: measure what is not cached yet and rewrite docs/results.md")
    args = ap.parse_args()
    os.chdir(ROOT)
    WORK, DISTILLED = args.work, os.path.join(args.work, "distill")
    os.makedirs(WORK, exist_ok=True)
    if not os.path.exists(args.base):
        raise SystemExit(f"error: base checkpoint not found: {args.base} (scripts/train_base.sh trains it)")
    if not args.report:
        train(args.base, args.head_updates, args.distill_sentences)
    if not args.only_train:
        report(measure(args.timing_sentences, args.repeats, args.test_sentences), args)


if __name__ == "__main__":
    main()
