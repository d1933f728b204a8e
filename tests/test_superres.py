"""Image super-resolution: the digits data script, superres_blockwise and --blockwise-distance."""
import json
import math
import os
import sys
from argparse import Namespace
from functools import partial

import numpy as np
import pytest
import torch
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator

from cli_support import PLUGIN, TINY_ARCH, Runs, assert_same_hypotheses, hypotheses, run, summary
from conftest import build, random_sample
from test_generator import Oracle, assert_same, blockwise, greedy

from fairseq_bpd.acceptance import Verdict, WithinDistance, accepted, symbol_numbers
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.tree import Tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import prepare_digits  # noqa: E402
import superres_grid  # noqa: E402

LEVELS = 17
HIGH = [3, 4]  # 12 pixels an image: short outputs keep the tiny models fast


def numeric_data(directory, high=HIGH):
    """Dictionaries of the 17 levels for both sides (de, en, as conftest's parse expects) and image.json."""
    os.makedirs(directory, exist_ok=True)
    for lang in ("de", "en"):
        with open(os.path.join(directory, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"{level} {100 - level}\n" for level in range(LEVELS))
    with open(os.path.join(directory, "image.json"), "w") as f:
        json.dump({"low": [1, 2], "high": high, "levels": LEVELS}, f)
    return directory


def level_token(level):
    return 4 + level  # the dictionary lists levels in order after fairseq's four specials


@pytest.fixture
def numeric_dir(tmp_path):
    return numeric_data(str(tmp_path / "numeric"))


# --- the acceptance rule --------------------------------------------------------------


def accept_within_distance(candidates, block, proposal_lprobs, limit, numbers, distance):
    """How many block tokens each sentence keeps under WithinDistance: b (a chain's accepted length)."""
    tree = Tree.chain_of(block.size(1) - 1)
    passes = WithinDistance(numbers, distance).passes(Verdict(candidates, None, None, proposal_lprobs), block, tree)
    return accepted(passes, limit, tree)[1]


def hand_built(proposed, chosen, lprob=0.0):
    """A block [EOS, proposals...] and head 1's choices after each of its tokens (b=1, n=4)."""
    dictionary = Dictionary()
    for level in range(LEVELS):
        dictionary.add_symbol(str(level))
    eos = dictionary.eos()
    block = torch.tensor([[eos, *proposed]])
    candidates = torch.tensor([[[c, 0] for c in chosen]])  # 1 x 4 x 2, the choice first
    proposal_lprobs = torch.full((1, len(proposed)), lprob)
    return block, candidates, proposal_lprobs, symbol_numbers(dictionary)


def kept(distance, proposed, chosen, lprob=0.0, limit=4):
    block, candidates, proposal_lprobs, values = hand_built(proposed, chosen, lprob)
    return int(accept_within_distance(candidates, block, proposal_lprobs, torch.tensor([limit]), values, distance))


def test_distance_one_accepts_a_neighbouring_intensity_and_zero_does_not():
    t = level_token
    # Greedy would write 6, 9, 3 (and something after the block); the heads proposed 5, 9, 3.
    proposed, chosen = [t(5), t(9), t(3)], [t(6), t(9), t(3), t(0)]
    assert kept(0, proposed, chosen) == 1  # only the block's first token: 5 is not 6
    assert kept(1, proposed, chosen) == 4  # |5 - 6| <= 1, then two exact matches
    assert kept(0.5, proposed, chosen) == 1
    # A gap of 2 in the middle: E=1 stops there, E=2 (the paper's) passes it.
    proposed, chosen = [t(6), t(7), t(3)], [t(6), t(9), t(3), t(0)]
    assert (kept(0, proposed, chosen), kept(1, proposed, chosen), kept(2, proposed, chosen)) == (2, 2, 4)
    assert kept(2, proposed, chosen, limit=3) == 3
    # A forbidden proposal (log-prob -inf) never passes, however near.
    assert kept(1, [t(5), t(9), t(3)], [t(5), t(9), t(3), t(0)], lprob=-math.inf) == 1


def test_non_numbers_pass_only_as_greedys_own_choice():
    t, eos = level_token, 2
    assert kept(16, [eos, t(1), t(1)], [t(0), t(1), t(1), t(1)]) == 1  # EOS is no intensity
    assert kept(16, [t(0), t(1), t(1)], [eos, t(1), t(1), t(1)]) == 1
    assert kept(0, [t(4), eos, t(1)], [t(4), eos, t(1), t(1)]) == 4


def test_symbol_numbers_read_numbers_and_skip_specials_and_fillers():
    dictionary = Dictionary()
    for symbol in ("0", "2.5", "-3", "madeupword0000"):
        dictionary.add_symbol(symbol)
    values = symbol_numbers(dictionary)
    assert values[4:7].tolist() == [0.0, 2.5, -3.0]
    assert values[:4].isnan().all() and values[7].isnan()
    dictionary.add_symbol("w0")
    with pytest.raises(ValueError, match="'w0' \\(entry 8\\) is not a number"):
        symbol_numbers(dictionary)


def test_nan_and_infinite_symbols_are_refused_by_name():
    for symbol in ("nan", "inf", "-Infinity", "1e999"):
        dictionary = Dictionary()
        for level in ("1", symbol):
            dictionary.add_symbol(level)
        with pytest.raises(ValueError, match=f"'{symbol}' \\(entry 5\\) is not a number"):
            symbol_numbers(dictionary)


def test_decimal_symbols_within_the_distance_pass_despite_float_rounding():
    dictionary = Dictionary()
    symbols = ("0.9", "1.1", "1.1000001", "-0.3", "-0.1", "1", "1.0")
    for symbol in symbols:
        dictionary.add_symbol(symbol)
    t = {symbol: 4 + i for i, symbol in enumerate(symbols)}
    numbers = symbol_numbers(dictionary)

    def kept_after(distance, pairs):
        """pairs: (greedy's choice, the proposal) per block position, then one choice after."""
        chosen = [t[c] for c, _ in pairs]
        block = torch.tensor([[dictionary.eos(), *[t[p] for _, p in pairs[:-1]]]])
        candidates = torch.tensor([[[c, 0] for c in chosen]])
        lprobs = torch.zeros(1, len(pairs) - 1)
        return int(accept_within_distance(candidates, block, lprobs, torch.tensor([9]), numbers, distance))

    # 1.1 - 0.9 is 0.20000000000000007 in float64; in the symbols' decimals it is 0.2.
    assert kept_after(0.2, [("0.9", "1.1"), ("-0.1", "-0.3"), ("1", "1")]) == 3
    assert kept_after(0.2, [("0.9", "1.1000001"), ("1", "1")]) == 1  # a real 1e-7 past it
    assert kept_after(0.19, [("0.9", "1.1"), ("1", "1")]) == 1
    # Two spellings of one number are one intensity under any distance (E = 0 is the exact rule).
    assert kept_after(0.01, [("1", "1.0"), ("1.0", "1"), ("1", "1")]) == 3


# --- exactness and the generator --------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_distance_zero_gives_greedy_output(numeric_dir, seed):
    task, model, _ = build(numeric_dir, "--block-size", "4", seed=seed, task="superres_blockwise")
    sample = random_sample(task, bsz=5, seed=seed)
    expected = greedy(model, task, sample)
    assert_same(expected, blockwise(model, task, sample, 4, distance=0.0)[0])


def test_the_task_decodes_whole_images_greedy_and_blockwise_alike(numeric_dir):
    task, model, _ = build(numeric_dir, "--block-size", "4", seed=4, task="superres_blockwise")
    sample = random_sample(task, bsz=6, seed=4)
    task.cfg.blockwise = False
    fairseq_greedy = task.build_generator([model], Namespace(beam=1))
    assert isinstance(fairseq_greedy, SequenceGenerator)
    expected = [h[0] for h in fairseq_greedy.generate([model], sample)]
    task.cfg.blockwise = True
    generator = task.build_generator([model], Namespace(beam=1))
    assert_same(expected, generator.generate([model], sample), attention=False)  # the task built it
    pixels = HIGH[0] * HIGH[1]
    assert all(len(e["tokens"]) == pixels + 1 for e in expected)  # every pixel, then EOS


def neighbours(tokens):
    """Each intensity moved one level (down from the top level): never the same, always 1 away."""
    return torch.where(tokens == level_token(LEVELS - 1), tokens - 1, tokens + 1)


class OffByOne(Oracle):
    """Proposes greedy's continuation, every pixel one intensity level off (level 0 for EOS)."""

    def next_proposals(self, *args):
        proposals = super().next_proposals(*args)
        numeric = proposals >= level_token(0)
        return torch.where(numeric, neighbours(proposals), level_token(0))


def test_off_by_one_proposals_pass_at_distance_one_only(numeric_dir):
    task, model, _ = build(numeric_dir, "--block-size", "4", seed=5, task="superres_blockwise")
    sample = random_sample(task, bsz=4, seed=5)
    options = {"min_len": 12, "max_len_b": 12, "unk_penalty": 100.0}  # pixels only, then EOS
    expected = greedy(model, task, sample, **options)
    references = [e["tokens"] for e in expected]
    exact, _ = blockwise(model, task, sample, 4, OffByOne, references=references, agree=True, **options)
    assert_same(expected, exact)  # E=0: every proposal rejected, one pixel per invocation
    assert [h[0]["steps"] for h in exact] == [len(e["tokens"]) for e in expected]
    near, generator = blockwise(model, task, sample, 4, OffByOne, references=references, agree=True,
                                distance=1.0, **options)
    # The first block's first proposal is one level from greedy's second pixel, so E=1 takes
    # it (what follows is judged against greedy's choices after it, no longer the reference).
    for e, h in zip(expected, near):
        assert h[0]["tokens"][1] == neighbours(e["tokens"][1])
        assert h[0]["steps"] < len(e["tokens"])
    assert generator.stats.mean_accepted_block() > 1


def test_right_proposals_under_a_distance_still_give_greedy_output(numeric_dir):
    # Proposals that are greedy's own tokens pass any rule: the distance branch commits
    # and rolls back as the exact one does.
    task, model, _ = build(numeric_dir, "--block-size", "4", seed=6, task="superres_blockwise")
    sample = random_sample(task, bsz=5, seed=6)
    expected = greedy(model, task, sample)
    hypos, _ = blockwise(model, task, sample, 4, Oracle, references=[e["tokens"] for e in expected],
                         agree=True, distance=2.0)
    assert_same(expected, hypos)
    for e, h in zip(expected, hypos):
        assert h[0]["steps"] <= math.ceil(len(e["tokens"]) / 4) + 1


# --- refusals ---------------------------------------------------------------------------


def test_distance_is_refused_on_a_dictionary_of_words(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", "--blockwise-distance", "1")
    with pytest.raises(ValueError, match=r"--blockwise-distance 1.0 needs a target dictionary of numbers.*'w0'"):
        task.build_generator([model], Namespace(beam=1))
    task.cfg.blockwise_distance = 0.0  # exact decoding needs no numbers
    assert isinstance(task.build_generator([model], Namespace(beam=1)), BlockwiseGenerator)


@pytest.mark.parametrize("flags,message", [
    (["--blockwise-distance", "-1"], "--blockwise-distance must be at least 0"),
    (["--blockwise-distance", "nan"], "--blockwise-distance must be at least 0 \\(got nan\\)"),
    (["--blockwise-distance", "1", "--blockwise-topk", "2"], "drop --blockwise-topk"),
    (["--blockwise-distance", "1", "--blockwise-min-block", "2"], "--blockwise-min-block"),
    (["--blockwise-distance", "1", "--blockwise-tree", "4"], "--blockwise-tree"),
])
def test_bad_distance_requests_are_refused(numeric_dir, flags, message):
    task, model, _ = build(numeric_dir, "--block-size", "3", "--blockwise", *flags, task="superres_blockwise")
    with pytest.raises(ValueError, match=message):
        task.build_generator([model], Namespace(beam=1))


def test_the_generator_refuses_a_distance_with_another_rule(numeric_dir):
    task, model, _ = build(numeric_dir, "--block-size", "3", task="superres_blockwise")
    for rule in ({"topk": 2}, {"min_block": 2}, {"tree": 4}):
        with pytest.raises(ValueError, match="--blockwise-distance cannot be combined"):
            BlockwiseGenerator(model, task.target_dictionary, block_size=3, distance=1.0, **rule)
    for distance in (-1.0, math.nan):  # NaN would compare as exact decoding
        with pytest.raises(ValueError, match="--blockwise-distance must be at least 0"):
            BlockwiseGenerator(model, task.target_dictionary, block_size=3, distance=distance)


def test_superres_task_refuses_words_and_a_missing_image_json(data_dir, tmp_path):
    with open(os.path.join(data_dir, "image.json"), "w") as f:
        json.dump({"low": [1, 2], "high": [2, 2], "levels": 17}, f)
    with pytest.raises(ValueError, match=r"dict.en.txt must list intensities, but its symbol 'w0'"):
        build(data_dir, task="superres_blockwise")
    bare = numeric_data(str(tmp_path / "bare"))
    os.remove(os.path.join(bare, "image.json"))
    with pytest.raises(FileNotFoundError, match="image.json not found; make the data with scripts/prepare_digits.py"):
        build(bare, task="superres_blockwise")


# --- the data script ----------------------------------------------------------------------


def test_low_resolution_averages_squares_to_the_nearest_level():
    image = np.array([[[0, 1, 16, 16], [2, 2, 16, 15], [3, 3, 0, 0], [3, 4, 0, 1]]])
    # Means 1.25, 15.75, 3.25, 0.25; a half rounds up (2 of [1, 2, 2, 1] is 1.5 -> 2).
    assert prepare_digits.low_resolution(image, 2).tolist() == [[[1, 16], [3, 0]]]
    assert prepare_digits.low_resolution(np.array([[[1, 2], [2, 1]]]), 2).tolist() == [[[2]]]
    with pytest.raises(SystemExit, match="--factor 3"):
        prepare_digits.low_resolution(image, 3)


def test_data_script_on_a_few_images(tmp_path):
    from sklearn.datasets import load_digits

    out = str(tmp_path / "digits")
    prepare_digits.main(["--out", out, "--limit", "12", "--valid", "2", "--test", "3"])
    images = load_digits().images.astype(int)[:12]
    raw = {split: open(f"{out}/raw/{split}.hr").read().splitlines() for split in ("train", "valid", "test")}
    assert [len(raw[s]) for s in ("train", "valid", "test")] == [7, 2, 3]
    # Every image in exactly one split, pixels in raster order.
    assert sorted(sum(raw.values(), [])) == sorted(" ".join(map(str, im.reshape(-1))) for im in images)
    low = open(f"{out}/raw/test.lr").read().splitlines()
    for lr, hr in zip(low, raw["test"]):
        image = np.array(hr.split(), dtype=float).reshape(8, 8)
        expected = np.floor(image.reshape(4, 2, 4, 2).mean(axis=(1, 3)) + 0.5).astype(int)
        assert lr.split() == [str(v) for v in expected.reshape(-1)]
    info = json.load(open(f"{out}/image.json"))
    assert (info["low"], info["high"], info["levels"]) == ([4, 4], [8, 8], 17)
    # The binarised test set reads back through the task as the same intensities.
    task, _, _ = build(out, "--source-lang", "lr", "--target-lang", "hr", task="superres_blockwise")
    assert [task.target_dictionary[i] for i in range(4, 21)] == [str(v) for v in range(17)]
    task.load_dataset("test")
    dataset = task.dataset("test")
    decoded = [task.target_dictionary.string(dataset[i]["target"][:-1]) for i in range(len(dataset))]
    assert decoded == raw["test"]
    assert task.pixels == 64
    with pytest.raises(SystemExit, match="leave no training images"):
        prepare_digits.main(["--out", out, "--limit", "5", "--valid", "2", "--test", "3"])


# --- the CLI end to end -------------------------------------------------------------------


def test_cli_end_to_end(tmp_path):
    data, save = str(tmp_path / "digits"), str(tmp_path / "checkpoints")
    prepare_digits.main(["--out", data, "--limit", "80", "--valid", "5", "--test", "6"])
    run("fairseq-train", data, "--user-dir", PLUGIN, "--task", "superres_blockwise",
        "--arch", "transformer_blockwise", "--block-size", 4, "--criterion", "blockwise_cross_entropy",
        *TINY_ARCH, "--optimizer", "adam", "--lr", "0.01", "--max-tokens", "2000", "--cpu", "--seed", "1",
        "--num-workers", "0", "--max-update", 30, "--disable-validation", "--save-dir", save,
        "--no-epoch-checkpoints", "--no-progress-bar")
    generate = partial(run, "fairseq-generate", data, "--user-dir", PLUGIN, "--task", "superres_blockwise",
                       "--path", f"{save}/checkpoint_last.pt", "--cpu", "--batch-size", 4)
    runs = Runs({
        "greedy": partial(generate, "--beam", 1),
        "E=0": partial(generate, "--blockwise"),
        "E=1": partial(generate, "--blockwise", "--blockwise-distance", 1),
        "E=2": partial(generate, "--blockwise", "--blockwise-distance", 2),
    })
    outputs = {name: runs[name] for name in ("greedy", "E=0", "E=1", "E=2")}
    runs.close()
    found = {name: hypotheses(output) for name, output in outputs.items()}
    assert_same_hypotheses(found["greedy"], found["E=0"])
    for name, hypos in found.items():
        assert sorted(hypos) == list(range(6))
        assert all(len(tokens.split()) == 64 for _, tokens in hypos.values()), name
    for name in ("E=0", "E=1", "E=2"):
        assert summary(outputs[name]).tokens == 6 * 65
    # The grid reads generate's output as it was printed.
    paths = {}
    for i, (name, output) in enumerate(outputs.items()):
        paths[name] = tmp_path / f"generate{i}.txt"
        paths[name].write_text(output)
    png = tmp_path / "grid.png"
    superres_grid.main(["--data", data, "--out", str(png), "--ids", "0", "1", "2",
                        *[f"--column={name}={paths[name]}" for name in ("greedy", "E=1", "E=2")]])
    assert png.stat().st_size > 1000
    read = superres_grid.read_generate(paths["greedy"])
    assert len(read["S"][0]) == 16 and len(read["T"][0]) == 64
    truth = open(f"{data}/raw/test.hr").read().splitlines()
    assert [" ".join(map(str, read["T"][i])) for i in range(6)] == truth


def test_masked_holes_under_a_distance_decode_as_gathering_every_block(tmp_path, monkeypatch):
    """Images of 36 pixels, --blockwise-distance 3: sentences accept different lengths, and the
    rejected entries left as masked holes decode as gathering them out every block."""
    import fairseq_bpd.cache
    from test_generator import CacheWatch, assert_identical

    directory = numeric_data(str(tmp_path / "numeric"), high=[6, 6])
    task, model, _ = build(directory, "--block-size", "6", seed=7, task="superres_blockwise")
    sample = random_sample(task, bsz=16, seed=7)
    options = {"min_len": 36, "max_len_b": 36, "distance": 3.0}
    watch = CacheWatch(model.decoder)
    held, generator = blockwise(model, task, sample, 6, **options)
    assert watch.holes > 0 and len(generator.stats.accepted) > 2
    assert all(len(h[0]["tokens"]) == 37 for h in held)
    monkeypatch.setattr(fairseq_bpd.cache, "COMPACT_AT", -1.0)  # no hole survives a block
    watch.holes = 0
    gathered, _ = blockwise(model, task, sample, 6, **options)
    assert watch.holes == 0
    assert_identical(held, gathered)
