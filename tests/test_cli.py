"""fairseq's own CLIs and hub interface with --user-dir fairseq_bpd: blockwise decoding is greedy decoding."""
import json
import os
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from cli_support import (
    BLOCK_SIZE, ENV, PLUGIN, SUMMARY, TRAIN, Runs, assert_same_hypotheses, hypotheses, run,
    summary, trained,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 20  # sentences in the test subset
INTERACTIVE_N = 8


def commands(tiny, tmp_path):
    """Every CLI run of this module by name; they run in the background while tests read them."""
    generate = partial(run, "fairseq-generate", tiny.data, "--user-dir", PLUGIN, "--path", tiny.checkpoint, "--cpu")
    ours = partial(generate, "--task", "translation_blockwise")
    # Stock translation drops a last batch that is not a multiple of
    # --required-batch-size-multiple (default 8); translation_blockwise sets it to 1.
    stock = partial(generate, "--task", "translation", "--required-batch-size-multiple", 1, "--batch-size", 32)
    with open(f"{tiny.raw}/test.de") as f:
        source = "".join(f.readlines()[:INTERACTIVE_N])
    interactive = partial(
        run, "fairseq-interactive", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--path", tiny.checkpoint, "--cpu", "--source-lang", "de", "--target-lang", "en",
        "--buffer-size", 4, "--batch-size", 3, stdin=source,
    )
    # A few updates from the tiny model, validating with --eval-bleu after each (both runs train
    # alike); --save-dir, though nothing is saved: --finetune-from-model refuses one holding a checkpoint.
    train = partial(
        run, "fairseq-train", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--arch", "transformer_blockwise", "--block-size", BLOCK_SIZE, "--criterion", "blockwise_cross_entropy",
        *TRAIN, "--max-update", 2, "--validate-interval-updates", 1, "--finetune-from-model", tiny.checkpoint,
        "--no-save", "--eval-bleu",
    )
    rates = f"{tmp_path}/tree-rates.json"
    measure = partial(subprocess.run, [sys.executable, f"{ROOT}/scripts/tree_rates.py", "--data", tiny.data,
                                       "--path", tiny.checkpoint, "--batch-size", "8", "--out", rates],
                      check=True, capture_output=True, text=True, env=ENV)
    return {
        # the chain at the checkpoint's k; --blockwise alone, with no width table here, is width 1
        "blockwise 1": partial(ours, "--blockwise", "--block-size", BLOCK_SIZE, "--print-step", "--batch-size", 1),
        "greedy 1": partial(ours, "--beam", 1, "--batch-size", 1),
        "blockwise 32": partial(ours, "--blockwise", "--block-size", BLOCK_SIZE, "--print-step", "--batch-size", 32),
        "default 32": partial(ours, "--blockwise", "--print-step", "--batch-size", 32),
        "greedy 32": partial(ours, "--beam", 1, "--batch-size", 32),
        "stock greedy": partial(stock, "--beam", 1),
        "stock beam": partial(stock, "--beam", 4),
        "interactive blockwise": partial(interactive, "--blockwise"),
        "interactive greedy": partial(interactive, "--beam", 1),
        "train blockwise": partial(train, "--blockwise", "--save-dir", tmp_path / "a"),
        "train greedy": partial(train, "--eval-bleu-args", '{"beam": 1}', "--save-dir", tmp_path / "b"),
        "block size 2": partial(ours, "--blockwise", "--block-size", 2, "--print-step", "--batch-size", 32),
        "topk 2": partial(ours, "--blockwise", "--blockwise-topk", 2, "--print-step", "--batch-size", 32),
        "min block 2": partial(ours, "--blockwise", "--blockwise-min-block", 2, "--print-step", "--batch-size", 32),
        "proposal vocab": partial(ours, "--blockwise", "--blockwise-proposal-vocab", 8, "--batch-size", 32),
        "confidence": partial(ours, "--blockwise", "--blockwise-confidence", 0.5, "--print-step", "--batch-size", 32),
        "tree 8": partial(ours, "--blockwise", "--blockwise-tree", 8, "--print-step", "--batch-size", 32),
        "tree 4 batch 1": partial(ours, "--blockwise", "--blockwise-tree", 4, "--batch-size", 1),
        "interactive tree": partial(interactive, "--blockwise", "--blockwise-tree", 8),
        "tree rates": lambda: (measure().stdout, rates,
                               ours("--blockwise", "--blockwise-tree", 16, "--blockwise-tree-rates", rates,
                                    "--blockwise-topk", 1, "--batch-size", 32)),
        "adaptive": partial(ours, "--blockwise", "--blockwise-adaptive", "--print-step", "--batch-size", 32),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    runs = Runs(commands(tiny, tmp_path_factory.mktemp("cli")))
    yield runs
    runs.close()


def generated(runs, name):
    output = runs[name]
    assert len(hypotheses(output)) == N
    return output


def bleu(output):
    return re.search(r"BLEU4 = (.*)", output)[1]


def steps(output):
    """--print-step's I-lines: {sentence id: decoder invocations}."""
    return {int(i): int(n) for i, n in re.findall(r"^I-(\d+)\t(\d+)$", output, re.MULTILINE)}


@pytest.mark.parametrize("batch_size", [1, 32])
def test_generate_blockwise_equals_greedy(runs, batch_size):
    blockwise, greedy = generated(runs, f"blockwise {batch_size}"), generated(runs, f"greedy {batch_size}")
    assert_same_hypotheses(hypotheses(greedy), hypotheses(blockwise))
    assert bleu(blockwise) == bleu(greedy)
    assert "Generate test with beam=1:" in blockwise
    stats = summary(blockwise)
    assert stats.sentences == N and stats.invocations == sum(steps(blockwise).values())
    assert not SUMMARY.search(greedy)


def test_blockwise_alone_without_a_width_table_decodes_greedy_at_width_one(runs):
    default = generated(runs, "default 32")
    assert_same_hypotheses(hypotheses(generated(runs, "greedy 32")), hypotheses(default))
    assert "no width table for this model on this machine" in default and "decoding at width 1" in default
    stats = summary(default)
    # Every invocation adds one token, the first (on BOS) too: all of them in the histogram.
    assert stats.invocations == stats.tokens and stats.histogram == {1: stats.tokens}


def test_print_step_counts_decoder_invocations(runs):
    output = generated(runs, "blockwise 32")
    invocations, hypos, stats = steps(output), hypotheses(output), summary(output)
    lengths = {i: len(tokens.split()) + 1 for i, (_, tokens) in hypos.items()}  # with EOS
    assert sorted(invocations) == sorted(hypos)
    for i, n in invocations.items():
        # The first invocation, on BOS alone, gives one token; each later one 1..k.
        assert 1 + -(-(lengths[i] - 1) // BLOCK_SIZE) <= n <= lengths[i]
    assert stats.tokens == sum(lengths.values())
    assert sum(stats.histogram.values()) == stats.invocations - N
    assert sum(size * count for size, count in stats.histogram.items()) == stats.tokens - N
    assert stats.invocations < stats.tokens, "the trained heads should get some proposals accepted"


def test_stock_translation_task_decodes_with_head_one(runs):
    greedy = generated(runs, "stock greedy")
    assert_same_hypotheses(hypotheses(greedy), hypotheses(generated(runs, "blockwise 32")))
    beam = generated(runs, "stock beam")
    assert "Generate test with beam=4:" in beam and not SUMMARY.search(beam)


def test_interactive_blockwise_equals_greedy(runs):
    blockwise, greedy = runs["interactive blockwise"], runs["interactive greedy"]
    assert len(hypotheses(greedy)) == INTERACTIVE_N
    assert_same_hypotheses(hypotheses(greedy), hypotheses(blockwise))
    assert summary(blockwise).sentences == INTERACTIVE_N


def test_hub_interface(tiny):
    from fairseq_bpd.errors import BlockwiseRequestError
    from fairseq_bpd.model import BlockwiseTransformerModel

    def load(**overrides):
        return BlockwiseTransformerModel.from_pretrained(
            tiny.save_dir, checkpoint_file="checkpoint_last.pt", data_name_or_path=tiny.data,
            user_dir=PLUGIN, **overrides,
        )

    with open(f"{tiny.raw}/test.de") as f:
        sentences = f.read().splitlines()[:6]
    greedy = load().translate(sentences, beam=1)
    hub = load(task="translation_blockwise", blockwise=True)
    assert hub.task.cfg.blockwise
    assert hub.translate(sentences) == hub.translate(sentences, beam=1) == greedy  # no beam given: greedy
    for hypos in (hub.generate([hub.encode(s) for s in sentences], beam=1),
                  hub.generate([hub.encode(s) for s in sentences])):
        assert [hub.decode(h[0]["tokens"]) for h in hypos] == greedy
        assert all(1 <= h[0]["steps"] <= len(h[0]["tokens"]) for h in hypos)
        assert all(h[0]["attention"].numel() == 0 for h in hypos)  # not asked: not made
    # Asked for, the hypotheses carry fairseq's attention (source x target).
    tokens = [hub.encode(s) for s in sentences]
    stock = load().generate(tokens, beam=1)
    for h, e in zip(hub.generate(tokens, attention=True), stock):
        assert h[0]["tokens"].tolist() == e[0]["tokens"].tolist()
        torch.testing.assert_close(h[0]["attention"], e[0]["attention"], rtol=0, atol=1e-5)
    for beam in (4, 5):  # 5, fairseq's default, is a request when given
        with pytest.raises(BlockwiseRequestError, match=f"--beam {beam} was given"):
            hub.translate(sentences, beam=beam)
    # Without --blockwise, no beam given is fairseq's 5.
    assert load().translate(sentences) == load().translate(sentences, beam=5)
    tree = load(task="translation_blockwise", blockwise=True, blockwise_tree=8)
    assert tree.translate(sentences) == greedy
    assert tree.task.blockwise_stats.sentences == len(sentences)
    # Task options per call would be set on the generation options and never read.
    for option in ({"blockwise_tree": 8}, {"blockwise_distance": 2.0}, {"blockwise": False}):
        name = next(iter(option))
        with pytest.raises(BlockwiseRequestError, match=f"^{name} is an option of the task, not of generation.*from_pretrained"):
            hub.translate(sentences, **option)
    assert hub.translate(sentences, max_len_b=3) != greedy  # generation options still work


def test_eval_bleu_during_training(runs):
    """Validation BLEU under --blockwise is greedy's, after every update (the weights changed)."""
    blockwise, greedy = runs["train blockwise"], runs["train greedy"]
    scores = [re.findall(r"\| valid on 'valid' subset \|.*\| bleu ([\d.]+) \|", out) for out in (blockwise, greedy)]
    assert len(scores[1]) == 2, greedy[-3000:]
    assert scores[0] == scores[1] and float(scores[1][0]) > 0, blockwise[-3000:]
    assert summary(blockwise).sentences == 2 * 20  # the valid subset, decoded after each update
    assert not SUMMARY.search(greedy)


def test_smaller_block_size_is_still_greedy(runs):
    smaller = generated(runs, "block size 2")
    assert_same_hypotheses(hypotheses(generated(runs, "greedy 32")), hypotheses(smaller))
    assert set(summary(smaller).histogram) <= {1, 2}


@pytest.mark.parametrize("run", ["proposal vocab", "confidence"])
def test_proposal_shortlist_and_confidence_cut_are_still_greedy(runs, run):
    assert_same_hypotheses(hypotheses(generated(runs, "greedy 32")), hypotheses(generated(runs, run)))


def test_adaptive_widths_are_still_greedy_and_logged(runs):
    adaptive = generated(runs, "adaptive")
    assert_same_hypotheses(hypotheses(generated(runs, "greedy 32")), hypotheses(adaptive))
    widths = re.search(r"accepted block sizes \{[\d: ]*\}, block widths chosen \{([\d: ]+)\}", adaptive)
    assert widths, adaptive[-2000:]
    chosen = dict(map(int, entry.split(":")) for entry in widths[1].split())
    assert set(chosen) <= set(range(1, BLOCK_SIZE + 1)) and sum(chosen.values()) > 0
    assert summary(adaptive).sentences == N


@pytest.mark.parametrize("relaxation", ["topk 2", "min block 2"])
def test_relaxed_acceptance_takes_no_more_invocations(runs, relaxation):
    exact, relaxed = generated(runs, "blockwise 32"), generated(runs, relaxation)
    assert sum(steps(relaxed).values()) <= sum(steps(exact).values())
    assert summary(relaxed).mean >= summary(exact).mean


@pytest.mark.parametrize("name", ["tree 8", "tree 4 batch 1"])
def test_generate_with_a_tree_equals_greedy(runs, name):
    tree, greedy = generated(runs, name), generated(runs, "greedy 32")
    assert_same_hypotheses(hypotheses(greedy), hypotheses(tree))
    assert bleu(tree) == bleu(greedy)
    assert summary(tree).sentences == N


def test_tree_accepts_at_least_the_chain(runs):
    tree, chain = generated(runs, "tree 8"), generated(runs, "blockwise 32")
    assert summary(tree).mean >= summary(chain).mean
    assert sum(steps(tree).values()) <= sum(steps(chain).values())


def test_interactive_with_a_tree_equals_greedy(runs):
    tree, greedy = runs["interactive tree"], runs["interactive greedy"]
    assert_same_hypotheses(hypotheses(greedy), hypotheses(tree))
    assert summary(tree).sentences == INTERACTIVE_N


def test_measured_rates_shape_a_tree_that_is_still_greedy(runs):
    printed, path, output = runs["tree rates"]
    with open(path) as f:
        measured = json.load(f)
    rates = measured["rates"]
    assert len(rates) == BLOCK_SIZE - 1 and all(len(row) == 10 for row in rates)
    assert all(0 <= p <= 1 for row in rates for p in row) and sum(rates[0]) > 0.5
    assert measured["sentences"] == 20 and f"--blockwise-tree-rates {path}" in printed
    assert_same_hypotheses(hypotheses(generated(runs, "greedy 32")), hypotheses(output))
