"""--blockwise alone: each block's width from a measured table (widths.py), greedy's output whatever it picks."""
import hashlib
import json
import os
import re
import subprocess
import sys
from argparse import Namespace

import numpy as np
import pytest
import torch

from cli_support import ENV, PLUGIN, assert_same_hypotheses, hypotheses, summary, trained
from conftest import build, random_sample
from test_generator import assert_same, greedy

from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.generator import BlockwiseStats, FixedWidth
from fairseq_bpd import widths
from fairseq_bpd.options import BlockwiseOptions
from fairseq_bpd.calibration import TimedWidths, nondecreasing, pool_of, pooled
from fairseq_bpd.widths import (
    TableWidth, WidthTable, batch_threads, cost_at, load_table, save_table, table_path,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hand_made(k=4):
    """Rates of a k=4 model and a CPU's costs: a wide block pays at batch 1, width 1 at 32.

    Tokens per block 1, 1.6, 2.0, 2.2. Width 1 costs 1 + b/8 ms; a block 1.5 + (b/8)·w ms.
    Tokens per ms at batch 1: 0.89, 0.91, 1.07, 1.10 -> 4; batch 2: 0.8, 0.8, 0.89, 0.88 -> 3;
    batch 8: 0.5, 0.46, 0.44, 0.40 -> 1.
    """
    seconds = {w: {b: 1e-3 * ((1 + b / 8) if w == 1 else (1.5 + b / 8 * w)) for b in (1, 8, 32)}
               for w in range(1, k + 1)}
    return WidthTable([1.0, 1.6, 2.0, 2.2][:k], seconds, "a machine", "a model")


def test_cost_at_interpolates_and_never_falls_beyond_the_last_size():
    points = {1: 1.0, 8: 2.4, 32: 5.0}
    assert cost_at(points, 1) == 1.0
    assert cost_at(points, 4) == pytest.approx(1.0 + 3 * 1.4 / 7)
    assert cost_at(points, 20) == pytest.approx(2.4 + 12 * 2.6 / 24)
    assert cost_at(points, 64) == pytest.approx(5.0 + 32 * 2.6 / 24)  # the last two sizes' line
    assert cost_at({1: 2.0, 4: 1.0}, 10) == 1.0  # a falling line (noise) stays flat
    assert cost_at({8: 3.0}, 1) == cost_at({8: 3.0}, 64) == 3.0


def test_table_width_follows_the_batch_size():
    table = hand_made()
    assert [table.width(b) for b in (1, 2, 8, 32, 128)] == [4, 3, 1, 1, 1]
    # Batch 4: width 1 costs 1.5 ms (0.67 tokens/ms), width 4 3.5 ms (0.63): width 1, by a little.
    assert table.width(4) == 1
    table.expected = [1.0, 1.6, 2.0, 2.5]  # better heads: at batch 4 width 4 gives 0.71 tokens/ms
    assert table.width(4) == 4
    table.expected = [1.0, 1.0, 1.0, 1.0]  # heads that never pass: width 1 everywhere
    assert {table.width(b) for b in (1, 8, 32)} == {1}
    # Equal tokens per second: the narrower width.
    flat = WidthTable([1.0, 2.0], {1: {1: 1.0}, 2: {1: 2.0}})
    assert flat.width(1) == 1


def test_table_policy_chooses_once_per_batch_size_and_counts_its_widths():
    stats = BlockwiseStats()
    policy = TableWidth(hand_made(), stats)
    policy.start()
    assert [policy.width(b) for b in (32, 32, 9, 2, 1, 1)] == [1, 1, 1, 3, 4, 4]
    assert dict(stats.widths) == {1: 3, 3: 1, 4: 2}
    assert set(policy.chosen) == {32, 9, 2, 1}


def test_pools_gather_nearby_batch_sizes_and_cost_no_less_with_more_rows():
    assert [pool_of(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 127, 128)] == [1, 2, 2, 4, 4, 8, 8, 16, 64, 128]
    seconds = {32: [5.0, 5.0, 9.0, 9.0, 9.0], 30: [4.0, 4.0], 25: [4.0], 7: [1.0], 1: [0.5, 0.5, 0.5, 10.0]}
    # Pool 16-31 and pool 32 are apart; 7 alone is too few; a preempted 10.0 is not the quantile
    # (the lower quarter of 5, 5, 9, 9, 9 is 5).
    assert pooled(seconds) == {32: 5.0, 30: 4.0, 1: 0.5}
    assert pooled(seconds, least=1) == {32: 5.0, 30: 4.0, 7: 1.0, 1: 0.5}
    # A larger pool measured cheaper (noise): the two share their mean.
    assert pooled({4: [2.0] * 3, 8: [1.0] * 3, 16: [3.0] * 3}) == {4: 1.5, 8: 1.5, 16: 3.0}
    assert nondecreasing([1.0, 3.0, 2.0, 1.0, 5.0]) == [1.0, 2.0, 2.0, 2.0, 5.0]


def test_timed_widths_time_runs_of_one_width_and_measure_tokens_per_block():
    now = [0.0]
    policy = TimedWidths(3, clock=lambda: now[0])

    def decode(width, blocks):
        """One batch decoded at `width`: blocks of (batch size, tokens each sentence adds)."""
        policy.fixed = width
        policy.start()
        for batch_size, kept in blocks:
            assert policy.width(batch_size) == width
            now[0] += width  # a block of width w takes w seconds
            added = torch.tensor(kept)
            policy.observe(width, added, added, added + 3)

    policy.timed = False  # a warm-up: nothing kept
    decode(3, [(4, [3, 3, 3, 3]), (4, [3, 3, 3, 3])])
    policy.timed = True
    decode(2, [(4, [2, 1, 2, 1]), (3, [2, 2, 2])])
    decode(3, [(4, [3, 1, 3, 1]), (4, [3, 1, 3, 1])])
    decode(1, [(4, [1, 1, 1, 1]), (4, [1, 1, 1, 1])])
    # Each batch's last block is not timed: its end is the next batch's start, another width's.
    assert {w: dict(s) for w, s in policy.seconds.items()} == {1: {4: [1.0]}, 2: {4: [2.0]}, 3: {4: [3.0]}}
    table = policy.table(least=1)
    assert table.expected == pytest.approx([1.0, 12 / 7, 2.0])  # tokens added per sentence-block
    assert table.seconds == {1: {4: 1.0}, 2: {4: 2.0}, 3: {4: 3.0}}  # the pools every width was timed in
    policy.added[3] = 4  # a wider width measured below a narrower one: noise, raised to it
    assert policy.table(least=1).expected == pytest.approx([1.0, 12 / 7, 12 / 7])
    with pytest.raises(BlockwiseRequestError, match="too few timed blocks to compare widths 1..3"):
        policy.table(least=2)  # no pool holds two timings of every width


def test_whole_decodes_give_speeds_and_a_width_no_faster_than_width_one_is_not_chosen():
    policy = TimedWidths(2)
    for width, rounds in ((1, [1.0, 1.2, 9.0]), (2, [2.0, 1.9, 2.1])):  # 9.0: preempted, not the median
        policy.fixed = width
        for seconds in rounds:
            policy.ran(1, 0, 10, seconds)
            policy.ran(8, 0, 80, seconds)
        policy.ran(8, 1, 40, 1.0)  # a second batch of 8 decoded once: its tokens and seconds add
    assert policy.speeds() == {1: {1: pytest.approx(10 / 1.2), 8: pytest.approx(120 / 2.2)},
                               2: {1: pytest.approx(10 / 2.0), 8: pytest.approx(120 / 3.0)}}
    # Block costs that favour width 2 everywhere: whole decodes overrule them where they were measured.
    table = WidthTable([1.0, 1.9], {1: {1: 1.0, 8: 2.0}, 2: {1: 1.0, 8: 2.0}}, speeds={1: {1: 10.0, 8: 60.0},
                                                                                       2: {1: 9.0, 8: 66.0}})
    assert [table.width(b) for b in (1, 4, 8, 64)] == [1, 1, 2, 2]  # below 8 the speeds at 1 hold
    assert table.allowed(1).tolist() == [True, False] and table.allowed(8).tolist() == [True, True]
    table.speeds[2][8] = 62.0  # faster, but by less than widths.MARGIN: noise of a short calibration
    assert table.allowed(8).tolist() == [True, False] and table.width(8) == 1
    table.speeds[2][8] = 66.0
    table.speeds = {}  # a table without speeds: the block costs alone
    assert table.width(1) == 2


def test_a_width_timed_at_other_batch_sizes_only_is_not_compared_there():
    """Widths timed in no common pool of batch sizes give no table: compared across pools, one
    timed only at small batches would look cheap at large ones."""
    policy = TimedWidths(2)
    policy.seconds[1][1] += [1.0, 1.0]
    policy.seconds[2][8] += [2.0, 2.0]
    with pytest.raises(BlockwiseRequestError, match="give more --sentences or --repeats"):
        policy.table(least=1)


@pytest.fixture
def caller_threads():
    """torch at 2 threads (the tests' own run at 1), restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(threads)


def test_batch_threads_asked_win_else_the_tables_never_above_the_callers():
    table = hand_made()
    table.threads = {1: 1, 8: 2}  # one thread measured faster at batch 1, two at 8
    policy = TableWidth(table, BlockwiseStats())
    assert [batch_threads(0, policy, b, 2) for b in (1, 4, 8, 64)] == [1, 1, 2, 2]
    assert [batch_threads(0, policy, b, 1) for b in (1, 8)] == [1, 1]  # the caller's one thread stays
    assert batch_threads(3, policy, 1, 2) == batch_threads(3, FixedWidth(2), 1, 2) == 3  # asked for
    assert batch_threads(0, FixedWidth(2), 1, 2) is None  # no table: the caller's
    table.threads = {}
    assert batch_threads(0, policy, 1, 2) is None


@pytest.mark.parametrize("asked", [0, 3])
def test_a_batch_decodes_under_its_threads_and_the_callers_come_back(data_dir, tmp_path, caller_threads, asked):
    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    table = hand_made()
    table.threads = {1: 1, 8: 2}
    save_table(table, str(tmp_path / "widths.json"))
    generator = BlockwiseOptions(max_len_b=20, widths=str(tmp_path / "widths.json"), threads=asked).generator(
        model, task.target_dictionary)
    seen, width = [], generator.policy.width
    generator.policy.width = lambda batch_size: seen.append(torch.get_num_threads()) or width(batch_size)
    for bsz, inside in ((1, asked or 1), (8, asked or 2)):
        sample = random_sample(task, bsz=bsz, seed=6)
        assert_same(greedy(model, task, sample, max_len_b=20), generator.generate([model], sample))
        assert set(seen) == {inside} and torch.get_num_threads() == caller_threads
        seen.clear()
    with pytest.raises(BlockwiseRequestError, match="--blockwise-threads must be at least 0"):
        BlockwiseOptions(threads=-1)


def test_calibration_keeps_the_faster_thread_count_by_batch_size(caller_threads, monkeypatch):
    from fairseq_bpd import bench, calibration

    def decode(generator, model, samples):  # one thread is faster at batch 1, two at 4
        batch_size, threads = len(samples[0]), torch.get_num_threads()
        return {}, {(1, 1): 1.0, (1, 2): 1.5, (4, 1): 2.0, (4, 2): 1.2}[batch_size, threads]

    monkeypatch.setattr(bench, "decode", decode)
    batches = {1: [[0]] * 3, 4: [[0] * 4] * 2}
    assert calibration.fastest_threads(None, None, batches, repeats=2) == {1: 1, 4: 2}
    assert torch.get_num_threads() == caller_threads


def test_tables_round_trip_and_bad_ones_are_refused(tmp_path):
    path = str(tmp_path / "widths.json")
    save_table(hand_made(), path)
    assert load_table(path) == hand_made()
    with_speeds = WidthTable([1.0, 1.5], {1: {1: 1.0}, 2: {1: 1.5}}, speeds={1: {1: 10.0}, 2: {1: 12.5}},
                             threads={1: 1, 8: 2})
    save_table(with_speeds, path)
    assert load_table(path) == with_speeds
    with open(path, "w") as f:
        json.dump({"expected": [1.0, 1.5], "seconds": {"1": {"1": 1.0}}}, f)
    with pytest.raises(BlockwiseRequestError, match="--blockwise-widths: .* seconds for each of its widths"):
        load_table(path)
    for bad in ({"expected": "12", "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}},
                {"expected": [1.0, 1.5], "seconds": {"1": {"1": float("nan")}, "2": {"1": 1.0}}},
                {"expected": [1.0, 1.5], "seconds": {"1": {"1": 1.0}, "2": {"1": -1.0}}},
                {"expected": [1.0, float("inf")], "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}},
                {"expected": [0.5, 1.5], "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}},
                {"expected": [1.0, 1.5], "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}, "speeds": {"1": {"1": 0}}},
                {"expected": [1.0, 1.5], "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}, "threads": {"1": 1.5}}):
        with open(path, "w") as f:
            json.dump(bad, f)
        with pytest.raises(BlockwiseRequestError, match="--blockwise-widths: "):
            load_table(path)
    with pytest.raises(BlockwiseRequestError, match="--blockwise-widths: cannot read"):
        load_table(str(tmp_path / "missing.json"))
    with open(path, "w") as f:  # speeds of width 1 only: decoding would look width 2 up
        json.dump({"expected": [1.0, 1.5], "seconds": {"1": {"1": 1.0}, "2": {"1": 1.0}}, "speeds": {"1": {"1": 9.0}}}, f)
    with pytest.raises(BlockwiseRequestError, match=r"for each of its widths \(and speeds, if any\)"):
        load_table(path)


def test_the_default_applies_to_an_exact_chain_of_no_width_asked():
    assert BlockwiseOptions().chooses_width and BlockwiseOptions(confidence=0.5, proposal_vocab=8).chooses_width
    for asked in ({"block_size": 4}, {"adaptive": True}, {"tree": 4}, {"topk": 2}, {"min_block": 2},
                  {"sampling": True}):
        assert not BlockwiseOptions(**asked).chooses_width
        with pytest.raises(BlockwiseRequestError, match="--blockwise-widths chooses"):
            BlockwiseOptions(widths="table.json", **asked)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty width-table cache of this test's own."""
    folder = tmp_path / "widths"
    monkeypatch.setenv("FAIRSEQ_BPD_WIDTHS", str(folder))
    return folder


def is_width_one(policy):
    """Without a table the default decodes at width 1, greedy's step without proposals."""
    return isinstance(policy, FixedWidth) and policy.width(1) == policy.width(64) == 1


def test_the_default_finds_its_table_or_decodes_at_width_one(data_dir, cache, tmp_path, monkeypatch):
    task, model, _ = build(data_dir, "--block-size", "4", seed=3)
    d = task.target_dictionary
    assert is_width_one(BlockwiseOptions().generator(model, d).policy)  # no table here
    assert type(BlockwiseOptions(block_size=4).generator(model, d).policy).__name__ == "FixedWidth"
    save_table(hand_made(), table_path(model))
    policy = BlockwiseOptions().generator(model, d).policy
    assert isinstance(policy, TableWidth) and policy.table == hand_made()
    other = build(data_dir, "--block-size", "4", seed=4)[1]  # other weights: not its table
    assert is_width_one(BlockwiseOptions().generator(other, d).policy)
    with monkeypatch.context() as patch:  # changed code: not its table either
        patch.setattr(widths, "code_version", lambda: "changed")
        assert is_width_one(BlockwiseOptions().generator(model, d).policy)
    with open(table_path(model), "w") as f:  # a broken table in the cache: width 1, said, not refused
        f.write("{")
    assert is_width_one(BlockwiseOptions().generator(model, d).policy)
    with pytest.raises(BlockwiseRequestError, match="cannot read a width table"):  # one the user named is
        BlockwiseOptions(widths=table_path(model)).generator(model, d)
    save_table(hand_made(3), str(tmp_path / "k3.json"))
    with pytest.raises(BlockwiseRequestError, match="widths 1..3, the checkpoint's k is 4"):
        BlockwiseOptions(widths=str(tmp_path / "k3.json")).generator(model, d)


@pytest.mark.parametrize("bsz", [1, 64])
@pytest.mark.parametrize("table", ["hand-made", "none"])
def test_the_default_gives_greedy_output(data_dir, cache, tmp_path, bsz, table):
    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    sample = random_sample(task, bsz=bsz, seed=6)
    options = BlockwiseOptions(max_len_b=20)
    if table == "hand-made":  # width 4 at batch 1, 3 at 2-3, 1 from 4: a batch of 64 crosses over
        options = options.replace(widths=str(tmp_path / "widths.json"))
        save_table(hand_made(), options.widths)
    generator = options.generator(model, task.target_dictionary)
    assert_same(greedy(model, task, sample, max_len_b=20), generator.generate([model], sample))
    chosen = generator.stats.widths
    if table == "hand-made":
        assert set(chosen) == {4} if bsz == 1 else 1 in chosen and set(chosen) <= {1, 3, 4}


def test_a_table_policy_is_given_no_limit_where_none_bites(data_dir, cache, tmp_path):
    """TableWidth reads nothing in observe(): the loop builds `limit` only near max_len."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    sample = random_sample(task, bsz=3, seed=6)
    options = BlockwiseOptions(max_len_b=20, widths=str(tmp_path / "widths.json"))
    save_table(hand_made(), options.widths)
    generator = options.generator(model, task.target_dictionary)
    assert isinstance(generator.policy, TableWidth) and not generator.policy.observes
    limits = []
    generator.policy.observe = lambda width, kept, added, limit: limits.append(limit)
    assert_same(greedy(model, task, sample, max_len_b=20), generator.generate([model], sample))
    assert None in limits


def test_the_hub_decodes_at_the_width_asked_not_the_one_trained_with(data_dir, cache, tmp_path):
    """fairseq's hub builds the task from the checkpoint's saved options: their --block-size
    is the training run's k, no decoding request; what from_pretrained is given is one."""
    from fairseq.models.transformer import TransformerModel
    from test_model import save

    path, _ = save(data_dir, "--block-size", "3")
    assert torch.load(path, weights_only=False)["cfg"]["task"]["block_size"] == 3

    def policy(**overrides):
        hub = TransformerModel.from_pretrained(data_dir, checkpoint_file=os.path.basename(path),
                                               data_name_or_path=data_dir, user_dir=PLUGIN,
                                               task="translation_blockwise", blockwise=True, **overrides)
        return hub.task.build_generator(hub.models, Namespace()).policy

    assert is_width_one(policy())  # no table measured here: the default's width 1, not 3
    save_table(hand_made(3), str(tmp_path / "k3.json"))
    named = policy(blockwise_widths=str(tmp_path / "k3.json"))  # a flag the checkpoint never saved
    assert isinstance(named, TableWidth) and named.table == hand_made(3)
    assert isinstance(policy(block_size=2), FixedWidth) and policy(block_size=2).width(1) == 2


def test_a_cached_table_of_another_k_decodes_at_width_one(data_dir, cache, caplog):
    task, model, _ = build(data_dir, "--block-size", "4", seed=3)
    save_table(hand_made(3), table_path(model))  # in the cache, not named by the user: no refusal
    with caplog.at_level("WARNING"):
        assert is_width_one(BlockwiseOptions().generator(model, task.target_dictionary).policy)
    assert "cached width table" in caplog.text and "the checkpoint's k is 4" in caplog.text


def test_the_fingerprint_is_hashed_once_until_a_weight_changes(data_dir, monkeypatch):
    model = build(data_dir, "--block-size", "4", seed=3)[1]
    first = widths.fingerprint(model)
    hashed = []
    sha1 = hashlib.sha1
    monkeypatch.setattr(hashlib, "sha1", lambda *a: hashed.append(1) or sha1(*a))
    assert widths.fingerprint(model) == first and not hashed  # the hub asks on every translate()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert widths.fingerprint(model) != first and hashed == [1]
    changed = widths.fingerprint(model)
    # The parameters' .data replaced: same tensors, same versions, another dtype.
    model.float() if next(model.parameters()).dtype == torch.float64 else model.double()
    assert widths.fingerprint(model) != changed and hashed == [1, 1]
    with torch.inference_mode():  # inference tensors keep no version: hashed each time, no error
        frozen = build(data_dir, "--block-size", "4", seed=3)[1]
        assert widths.fingerprint(frozen) == widths.fingerprint(frozen) and len(hashed) == 4


def python(script, *args, env, fails=False):
    process = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *map(str, args)],
                             capture_output=True, text=True, env=env, timeout=300)
    assert (process.returncode != 0) == fails, process.stdout + process.stderr[-3000:]
    return process.stdout + process.stderr


def test_calibrating_on_a_split_the_data_lacks_is_refused_by_name(tmp_path_factory, tmp_path):
    tiny = trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))
    env = {**ENV, "FAIRSEQ_BPD_WIDTHS": str(tmp_path / "cache")}
    out = python("calibrate_widths.py", "--data", tiny.data, "--path", tiny.checkpoint, "--subset", "nosuch",
                 "--cpu", env=env, fails=True)
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"error: --subset nosuch: {tiny.data} holds no such split (it holds: test, ") \
        and last.endswith(", train, valid)"), out[-2000:]
    assert not os.path.exists(tmp_path / "cache")
    # Refused before the model loads, not after minutes of measuring.
    for flags, said in ((["--out", tmp_path], f"--out {tmp_path}: not a file that can be written"),
                        (["--out", f"{tmp_path}/new/"], f"--out {tmp_path}/new/: not a file that can be written"),
                        (["--threads", -1], "--threads must be at least 1 (got -1)")):
        out = python("calibrate_widths.py", "--data", tiny.data, "--path", tiny.checkpoint, *flags, "--cpu",
                     env=env, fails=True)
        assert said in out.strip().splitlines()[-1], out[-2000:]


def generate(tiny, *args, env, fails=False):
    process = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fairseq-generate"), tiny.data, "--user-dir", PLUGIN,
         "--task", "translation_blockwise", "--path", tiny.checkpoint, "--cpu", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300)
    assert (process.returncode != 0) == fails, process.stderr[-3000:]
    return process.stdout + process.stderr


def widths_chosen(output):
    found = re.search(r"block widths chosen \{([\d: ]+)\}", output)
    assert found, output[-2000:]
    return dict(map(int, entry.split(":")) for entry in found[1].split())


def test_calibrate_then_generate_with_blockwise_alone(tmp_path_factory, tmp_path):
    tiny = trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))  # test_cli's model, trained once
    env = {**ENV, "FAIRSEQ_BPD_WIDTHS": str(tmp_path / "cache")}
    source = widths.code_version.__wrapped__()  # the table's key holds it: read afresh
    out = python("calibrate_widths.py", "--data", tiny.data, "--path", tiny.checkpoint, "--batch-sizes", 1, 8,
                 "--sentences", 8, "--repeats", 1, "--cpu", "--out", tmp_path / "copy.json", env=env)
    [written] = os.listdir(tmp_path / "cache")
    table = load_table(str(tmp_path / "cache" / written))
    assert table == load_table(str(tmp_path / "copy.json")) and len(table.expected) == 3
    python("calibrate_widths.py", "--data", tiny.data, "--path", tiny.checkpoint, "--if-missing", "--cpu",
           "--out", tmp_path / "kept.json", env=env)  # measures nothing, but writes the copy asked for
    assert load_table(str(tmp_path / "kept.json")) == table
    assert table.expected[0] == 1.0 and table.expected[2] >= table.expected[1] > 1.0, out  # trained heads pass
    greedy_run = generate(tiny, "--beam", 1, "--batch-size", 8, env=env)
    default = generate(tiny, "--blockwise", "--batch-size", 8, env=env)
    if widths.code_version.__wrapped__() != source:
        pytest.skip("the plugin's source changed while this test ran: the table is no longer its code's")
    assert "no width table" not in default
    assert_same_hypotheses(hypotheses(greedy_run), hypotheses(default))
    assert set(widths_chosen(default)) <= {table.width(b) for b in range(1, 9)}
    assert summary(default).sentences == 20

    # A hand-made table where width 2 pays at every batch size: every block after the first is 2 wide.
    forced = WidthTable([1.0, 1.9, 1.9], {1: {1: 1.0, 8: 2.0}, 2: {1: 1.0, 8: 2.0}, 3: {1: 2.0, 8: 4.0}})
    save_table(forced, str(tmp_path / "forced.json"))
    two = generate(tiny, "--blockwise", "--blockwise-widths", tmp_path / "forced.json", "--batch-size", 8, env=env)
    assert_same_hypotheses(hypotheses(greedy_run), hypotheses(two))
    assert widths_chosen(two).keys() == {2} and set(summary(two).histogram) <= {1, 2}
    assert "was measured on 'a machine'" not in two  # forced names no machine
    refused = generate(tiny, "--blockwise", "--blockwise-widths", tmp_path / "forced.json", "--block-size", 2,
                       env=env, fails=True)
    assert "--blockwise-widths chooses" in refused
