"""The benchmark harness: fairseq_bpd/bench.py's timer, rows and tables, and scripts/speed.py end to end.

Speed is never asserted: what a benchmark promises is how it measures (warm-up, the
decoders in turn round by round, medians) and that its other columns are exact.
"""
import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from cli_support import ENV, TINY_ARCH, run, trained
from conftest import PLUGIN, build, random_sample

from fairseq_bpd import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED = os.path.join(ROOT, "scripts", "speed.py")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Scripted:
    """A generator whose every run of generate() on a batch takes the next of `durations` on the clock."""

    def __init__(self, name, durations, clock, log):
        self.name, self.durations, self.clock, self.log = name, durations, clock, log

    def generate(self, models, sample):
        self.log.append((self.name, len(sample["id"])))
        self.clock.now += self.durations.pop(0)
        return [[{"tokens": torch.tensor([4, 2])}] for _ in sample["id"]]


def batch(ids):
    return {"id": torch.tensor(ids), "net_input": {"src_tokens": torch.zeros(len(ids), 2, dtype=torch.long)}}


def test_timer_warms_up_then_alternates_round_by_round_and_takes_medians():
    clock, log = FakeClock(), []
    durations = {"a": [9.0, 1.0, 5.0, 3.0], "b": [7.0, 2.0, 8.0, 4.0]}  # a warm-up, then three rounds
    decoders = {name: bench.Decoder(lambda name=name: Scripted(name, durations[name], clock, log), model=None)
                for name in durations}
    timings = bench.Timer(repeats=3, clock=clock).run(decoders, [batch([0, 1])])
    assert log == [("a", 2), ("b", 2)] + [("a", 2), ("b", 2)] * 3
    assert timings["a"].rounds == [1.0, 5.0, 3.0] and timings["a"].seconds == 3.0
    assert timings["b"].rounds == [2.0, 8.0, 4.0] and timings["b"].seconds == 4.0
    assert sorted(timings["a"].hypos) == [0, 1] and timings["a"].stats is None


def test_warm_up_decodes_only_the_first_batches():
    clock, log = FakeClock(), []
    decoder = bench.Decoder(lambda: Scripted("a", [1.0] * 4, clock, log), model=None)
    bench.Timer(repeats=1, warmup=1, clock=clock).run({"a": decoder}, [batch([0, 1]), batch([2])])
    assert log == [("a", 2), ("a", 2), ("a", 1)]


def test_a_decoder_is_built_anew_and_seeded_for_every_run():
    built = []

    class Drawing:
        stats = "fresh"

        def generate(self, models, sample):
            return [[{"tokens": torch.randint(100, (3,))}] for _ in sample["id"]]

    def build():
        built.append(Drawing())
        return built[-1]

    decoder = bench.Decoder(build, model=None, seed=5)
    first, _ = decoder.run([batch([0])])
    second, _ = decoder.run([batch([0])])
    assert len(built) == 2 and decoder.generator is built[1] and decoder.stats == "fresh"
    assert first[0]["tokens"].tolist() == second[0]["tokens"].tolist()


def test_rows_on_a_tiny_model_count_identity_invocations_and_blocks(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3")
    samples = [random_sample(task, 3, seed) for seed in (1, 2)]
    samples[1]["id"] += 3  # sentence ids are unique across batches
    tgt_dict = task.target_dictionary
    decoders = {
        "greedy": bench.Decoder(lambda: SequenceGenerator([model], tgt_dict, beam_size=1), model),
        "k": bench.Decoder(lambda: bench.blockwise_generator(model, tgt_dict, {"block_size": 3}), model),
        "width:1": bench.Decoder(lambda: bench.blockwise_generator(model, tgt_dict, {"block_size": 1}), model),
    }
    timings = bench.Timer(repeats=2).run(decoders, samples)
    greedy = timings["greedy"]
    rows = {name: bench.row(name, 3, t, "greedy", greedy, greedy.hypos) for name, t in timings.items()}
    tokens = sum(len(h["tokens"]) for h in greedy.hypos.values())
    assert all(r.identical == r.sentences == 6 for r in rows.values())
    assert rows["greedy"].invocations == tokens and rows["greedy"].speedup == 1.0
    assert rows["width:1"].tokens_per_invocation == 1.0 and rows["width:1"].mean_accepted_block == 1.0
    k = rows["k"]
    stats = timings["k"].stats
    assert k.invocations == stats.invocations and k.tokens_per_invocation == tokens / stats.invocations
    assert k.mean_accepted_block == stats.mean_accepted_block()
    assert sum(k.accepted_histogram.values()) == sum(stats.accepted.values()) and len(k.rounds) == 2
    assert k.speedup == greedy.seconds / k.seconds and k.baseline_seconds == greedy.seconds


def test_row_schema():
    names = [f.name for f in dataclasses.fields(bench.Row)]
    assert names == ["decoder", "batch_size", "sentences", "seconds", "baseline", "baseline_seconds", "speedup",
                     "invocations", "tokens_per_invocation", "mean_accepted_block", "identical", "bleu",
                     "options", "rounds", "accepted_histogram", "widths_chosen"]


def test_a_row_without_a_greedy_reference_has_no_identity_and_blocks_are_counted():
    hypos = {0: {"tokens": torch.tensor([5, 6, 2])}, 1: {"tokens": torch.tensor([5, 2])}}
    stats = SimpleNamespace(invocations=2, accepted=Counter({3: 1, 2: 1}), widths=Counter({3: 2}),
                            mean_accepted_block=lambda: 2.5)
    timing = bench.Timing(2.0, [2.0, 3.0, 1.0], hypos, stats)
    baseline = bench.Timing(4.0, [4.0], hypos, None)
    r = bench.row("sampling", 1, timing, "fairseq sampling", baseline, score=lambda h: 12.5, options={"sampling": True})
    assert (r.identical, r.bleu, r.speedup, r.tokens_per_invocation) == (None, 12.5, 2.0, 2.5)
    assert r.accepted_histogram == {2: 1, 3: 1} and r.widths_chosen == {3: 2} and r.options == {"sampling": True}


def test_table_writer_writes_json_and_markdown(tmp_path):
    r = bench.Row("k", 32, 10, 1.5, "greedy", 3.0, 2.0, 40, 1.25, 2.5, identical=10, bleu=30.0)
    out = str(tmp_path / "sub" / "speed")
    bench.write_table(out, {"device": "CPU", "commit": "abc"}, [r, dataclasses.replace(r, decoder="k,topk=2")],
                      notes=["a note"], examples=[{"id": 0}])
    written = json.loads(open(out + ".json").read())
    assert written["run"] == {"device": "CPU", "commit": "abc"} and written["notes"] == ["a note"]
    assert [row["decoder"] for row in written["rows"]] == ["k", "k,topk=2"] and written["examples"] == [{"id": 0}]
    md = open(out + ".md").read()
    assert md.startswith("device CPU, commit abc\n") and md.rstrip().endswith("a note")
    assert md.count("\n| ") == 1 + 2  # the header, a row each
    assert "| 32 | k | 1.50 | 2.00x | greedy | 1.25 | 2.50 | 40 | 10/10 | 30.00 |" in md


def test_method_profiler_times_wrapped_methods_and_undoes_the_wrapping():
    clock = FakeClock()

    class Part:
        def step(self, seconds):
            clock.now += seconds
            return seconds

    part = Part()
    profiler = bench.MethodProfiler(clock=clock)
    with profiler.wrapping([(part, "step", "step"), (Part, "step", "class step")]):
        assert part.step(2.0) == 2.0
        part.step(1.0)
    assert profiler.calls == {"step": 2} and profiler.seconds == {"step": 3.0}
    assert "step" not in vars(part) and Part.step.__name__ == "step"  # both restored
    profiler.wrap(Part, "step", "class step")()
    assert Part.step.__name__ == "step"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


def with_raw(tiny, tmp_path):
    """The tiny data with raw/ inside: speed.py scores BLEU against DATA/raw, as the recipes lay data out."""
    data = tmp_path / "data"
    data.mkdir()
    for name in os.listdir(tiny.data):
        (data / name).symlink_to(os.path.join(tiny.data, name))
    (data / "raw").symlink_to(tiny.raw)
    return data


def speed(*argv, env=ENV):
    process = subprocess.run([sys.executable, SPEED, *map(str, argv)], capture_output=True, text=True, env=env,
                             timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    return process


def test_speed_script_times_every_row_beside_greedy_and_skips_a_missing_ctranslate2(tiny, tmp_path):
    hidden = tmp_path / "hidden"  # an installed ctranslate2 made absent
    (hidden / "ctranslate2").mkdir(parents=True)
    (hidden / "ctranslate2" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "speed"
    rows = ["greedy", "width:2", "k,topk=2", "adaptive", "tree:4", "sampling,temperature=0.7", "ctranslate2"]
    process = speed("--data", with_raw(tiny, tmp_path), "--path", tiny.checkpoint, "--rows", *rows,
                    "--batch-sizes", 1, 4, "--max-sentences", 6, "--repeats", 1, "--examples", 2, "--out", out,
                    env={**ENV, "PYTHONPATH": f"{hidden}{os.pathsep}{ENV.get('PYTHONPATH', '')}"})
    assert "skipping the ctranslate2 row: ctranslate2 is not installed (.venv/bin/pip install ctranslate2" in process.stderr
    result = json.loads((tmp_path / "speed.json").read_text())
    decoders = ["greedy", "width:2", "k,topk=2", "adaptive", "tree:4", "fairseq sampling,temperature=0.7",
                "sampling,temperature=0.7"]
    assert [(r["batch_size"], r["decoder"]) for r in result["rows"]] == [(b, d) for b in (1, 4) for d in decoders]
    by_name = {(r["batch_size"], r["decoder"]): r for r in result["rows"]}
    for b in (1, 4):
        for name in ("greedy", "width:2", "adaptive", "tree:4"):
            assert by_name[b, name]["identical"] == by_name[b, name]["sentences"] == 6, name
        assert by_name[b, "k,topk=2"]["identical"] <= 6 and by_name[b, "k,topk=2"]["options"]["topk"] == 2
        for name in decoders[-2:]:  # sampled: against fairseq's sampling, no identity
            assert by_name[b, name]["identical"] is None
            assert by_name[b, name]["baseline"] == "fairseq sampling,temperature=0.7"
        assert set(map(int, by_name[b, "adaptive"]["widths_chosen"])) <= {1, 2, 3}
        assert by_name[b, "greedy"]["bleu"] == by_name[b, "width:2"]["bleu"] is not None
    assert by_name[1, "k,topk=2"]["options"]["block_size"] == 3  # k: the checkpoint's
    run_ = result["run"]
    assert run_["commit"] and run_["threads"] >= 1 and "CPU" in run_["device"]
    assert [e["id"] for e in result["examples"]] == [0, 1] and result["examples"][0]["greedy"]
    md = (tmp_path / "speed.md").read_text()
    assert md.count("\n| ") == 1 + 2 * len(decoders) and "skipping the ctranslate2 row" in md
    assert f"commit {run_['commit']}" in md.splitlines()[0]


def test_speed_script_refuses_an_unknown_spec_by_name(tiny, tmp_path):
    process = subprocess.run([sys.executable, SPEED, "--data", tiny.data, "--path", tiny.checkpoint,
                              "--rows", "greedy", "widht:2", "--out", tmp_path / "x"],
                             capture_output=True, text=True, env=ENV, timeout=300)
    assert process.returncode != 0 and "--rows widht:2: unknown kind 'widht'" in process.stderr


@pytest.mark.skipif(__import__("importlib").util.find_spec("ctranslate2") is None,
                    reason="ctranslate2 is an optional dependency of the benchmark")
def test_ctranslate2_row_is_fairseqs_greedy(tiny, tmp_path):
    speed("--data", with_raw(tiny, tmp_path), "--path", tiny.checkpoint, "--rows", "greedy", "ctranslate2",
          "--batch-sizes", 4, "--max-sentences", 8, "--repeats", 1, "--threads", 1, "--out", tmp_path / "ct2")
    rows = {r["decoder"]: r for r in json.loads((tmp_path / "ct2.json").read_text())["rows"]}
    assert rows["ctranslate2"]["identical"] == rows["ctranslate2"]["sentences"] == 8
    assert rows["ctranslate2"]["bleu"] == rows["greedy"]["bleu"]


def test_speed_script_on_the_superres_task_decodes_whole_images(tmp_path):
    data, save = tmp_path / "digits", tmp_path / "checkpoints"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_digits.py"), "--out", data,
                    "--limit", "60", "--valid", "4", "--test", "4"], check=True, capture_output=True, env=ENV)
    run("fairseq-train", data, "--user-dir", PLUGIN, "--task", "superres_blockwise", "--arch", "transformer_blockwise",
        "--block-size", 4, "--criterion", "blockwise_cross_entropy", *TINY_ARCH, "--optimizer", "adam", "--lr", "0.01",
        "--max-tokens", "2000", "--cpu", "--seed", "1", "--num-workers", "0", "--max-update", 10,
        "--disable-validation", "--save-dir", save, "--no-epoch-checkpoints", "--no-progress-bar")
    speed("--data", data, "--path", save / "checkpoint_last.pt", "--rows", "greedy", "k", "distance:2",
          "--batch-sizes", 2, "--repeats", 1, "--out", tmp_path / "sr")
    rows = {r["decoder"]: r for r in json.loads((tmp_path / "sr.json").read_text())["rows"]}
    assert rows["greedy"]["invocations"] == 4 * 65  # 64 pixels and EOS an image, as the task fixes them
    assert rows["k"]["identical"] == 4 and rows["distance:2"]["options"]["distance"] == 2.0
    assert rows["distance:2"]["invocations"] <= rows["k"]["invocations"]


def test_speed_script_refuses_an_unreadable_lexicon_by_name_before_decoding(tiny, tmp_path):
    bad = tmp_path / "lexicon.json"
    bad.write_text('{"format": "something else"}')
    for path in (bad, tmp_path / "missing.json"):
        process = subprocess.run([sys.executable, SPEED, "--data", tiny.data, "--path", tiny.checkpoint,
                                  "--rows", "greedy", "width:2", "--proposal-lexicon", path, "--out", tmp_path / "x"],
                                 capture_output=True, text=True, env=ENV, timeout=300)
        assert process.returncode != 0 and f"--blockwise-proposal-lexicon {path}" in process.stderr
        assert not (tmp_path / "x.json").exists()


def test_speed_script_gives_the_lexicon_to_blockwise_rows_only_and_reads_it_once(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import speed as script
    from fairseq_bpd.lexicon import FORMAT, ProposalLexicon

    path = tmp_path / "lexicon.json"
    path.write_text(json.dumps({"format": FORMAT, "first": 5, "table": {"a": ["b"]}}))
    script.read_once.cache_clear()
    first = script.read_once(str(path))
    assert isinstance(first, ProposalLexicon) and script.read_once(str(path)) is first
    made = []
    monkeypatch.setattr(script.bench, "Decoder", lambda build, model, seed=None: made.append(build.args[2]) or build)
    monkeypatch.setattr(script, "fairseq_generator", lambda *a, **k: None)
    args = SimpleNamespace(tree_rates=None, seed=1)
    parsed = {spec: script.parse_spec(spec, 3) for spec in ("greedy", "width:2", "k,proposal_lexicon=other.json")}
    script.give_lexicon(parsed, str(path))
    assert "proposal_lexicon" not in parsed["greedy"][1]
    assert parsed["k,proposal_lexicon=other.json"][1]["proposal_lexicon"] == "other.json"  # a row's own wins
    parsed = {"width:2": parsed["width:2"], "k": ("blockwise", {"block_size": 3})}
    script.decoders(parsed, None, SimpleNamespace(target_dictionary=None), args, None, str(tmp_path), set())
    made = made[1:]  # greedy first
    assert made[0]["proposal_lexicon"] is first and "proposal_lexicon" not in made[1]
    assert parsed["width:2"][1]["proposal_lexicon"] == str(path)  # the table records the path


def test_a_lexicon_for_heads_that_read_none_is_refused_by_name_before_timing(tiny, tmp_path):
    """speed.py and tree_rates.py refuse --proposal-lexicon for the tiny model's independent
    heads by the row or flag, with fairseq's refusal, before decoding anything."""
    from fairseq_bpd.lexicon import FORMAT

    lexicon = tmp_path / "lexicon.json"
    lexicon.write_text(json.dumps({"format": FORMAT, "first": 5, "table": {"a": ["b"]}}))
    process = subprocess.run([sys.executable, SPEED, "--data", tiny.data, "--path", tiny.checkpoint, "--rows",
                              "greedy", "width:2", "--proposal-lexicon", lexicon, "--out", tmp_path / "x"],
                             capture_output=True, text=True, env=ENV, timeout=300)
    assert process.returncode != 0 and "error: --rows width:2:" in process.stderr
    assert "--blockwise-proposal-lexicon" in process.stderr and "Traceback" not in process.stderr
    assert "greedy" not in process.stdout.split("load seconds")[-1]  # no row was timed
    rates = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tree_rates.py"), "--data", tiny.data,
                            "--path", tiny.checkpoint, "--proposal-lexicon", lexicon, "--out", tmp_path / "r.json"],
                           capture_output=True, text=True, env=ENV, timeout=300)
    assert rates.returncode != 0 and "--blockwise-proposal-lexicon" in rates.stderr
    assert "Traceback" not in rates.stderr and not (tmp_path / "r.json").exists()
