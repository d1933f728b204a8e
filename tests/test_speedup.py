"""python -m fairseq_bpd.speedup end to end on a tiny corpus: a plain --arch transformer
checkpoint gets heads, keeps its translations through fairseq-generate, and bad input is
refused by name before anything is written."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from cli_support import ENV, TRAIN, assert_same_hypotheses, hypotheses, run, write_corpus
from conftest import PLUGIN

from fairseq_bpd import speedup, speedup_steps

ROOT = os.path.dirname(PLUGIN)
UPDATES = 20


def speed_up(*args):
    """The command as a user runs it; its exit status and output."""
    process = subprocess.run([sys.executable, "-m", "fairseq_bpd.speedup", *map(str, args)], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=600)
    return process.returncode, process.stdout + process.stderr


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A plain transformer on the tiny corpus, and the command's run on it (3 chained heads)."""
    root = tmp_path_factory.mktemp("speedup")
    raw, data = root / "raw", root / "bin"
    raw.mkdir()
    write_corpus(raw)
    run("fairseq-preprocess", "--source-lang", "de", "--target-lang", "en", "--joined-dictionary",
        "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
        "--destdir", data, "--workers", "1")
    run("fairseq-train", data, "--task", "translation", "--arch", "transformer", *TRAIN,
        "--criterion", "label_smoothed_cross_entropy", "--max-update", "200", "--disable-validation",
        "--save-interval", "100000", "--save-dir", root / "base")
    base, out = root / "base" / "checkpoint_last.pt", root / "out"
    status, output = speed_up(base, data, raw / "train.de", out, "--updates", UPDATES, "--proposal-heads", 3,
                              "--cpu", "--num-workers", 0)
    assert status == 0, output[-4000:]
    return {"root": root, "raw": raw, "data": data, "base": base, "out": out, "output": output}


def test_the_original_translations_are_unchanged_through_fairseq_generate(made):
    common = ["--gen-subset", "test", "--max-tokens", "500", "--required-batch-size-multiple", "1", "--cpu",
              "--num-workers", "0"]
    greedy = run("fairseq-generate", made["data"], "--path", made["base"], "--user-dir", PLUGIN, "--beam", "1", *common)
    blockwise = run("fairseq-generate", made["data"], "--path", made["out"] / "checkpoint.pt", "--user-dir", PLUGIN,
                    "--task", "translation_blockwise", "--blockwise", *common)
    assert len(hypotheses(greedy)) == 20
    assert_same_hypotheses(hypotheses(greedy), hypotheses(blockwise))
    base, trained = torch.load(made["base"])["model"], torch.load(made["out"] / "checkpoint.pt")["model"]
    assert all(torch.equal(trained[key], value) for key, value in base.items())
    assert any(key.startswith("decoder.heads.") for key in trained)


def test_every_step_ran_and_the_end_says_what_the_heads_accept_and_the_speed(made):
    record = json.loads((made["out"] / "speedup.json").read_text())
    assert list(record["steps"]) == list(speedup.STEPS)
    assert record["steps"]["train"]["updates"] == UPDATES
    assert record["steps"]["check"]["identical"] == 20
    assert "20/20 valid sentences identical to CHECKPOINT's greedy output" in made["output"]
    assert f"the heads accept {record['steps']['check']['mean_accepted']:.2f} tokens per decoder invocation" in made["output"]
    assert "batch 1, the first 20 valid sentences, one run each" in made["output"]
    assert f"/{UPDATES} updates, about " in made["output"]  # the time left, from fairseq's log lines
    assert "| INFO | train_inner |" in made["output"]  # fairseq's own log lines


def test_the_width_table_is_measured_for_blockwise_alone(made):
    """Step 5 writes the table --blockwise alone finds (the user's cache: the tests' own folder)
    and a copy beside the checkpoint; the speed step's blockwise decoder then uses it."""
    from fairseq_bpd.widths import load_table

    table = load_table(str(made["out"] / "checkpoint.widths.json"))
    assert len(table.expected) == 3 and table.expected[0] == 1.0
    assert any(name.endswith(".json") for name in os.listdir(os.environ["FAIRSEQ_BPD_WIDTHS"]))
    chosen = json.loads((made["out"] / "speedup.json").read_text())["steps"]["widths"]["chosen"]
    assert "widths --blockwise chooses by batch size: " + " ".join(f"{b}:{w}" for b, w in chosen.items()) in made["output"]


def test_tree_rates_are_written_beside_the_checkpoint(made):
    rates = json.loads((made["out"] / "checkpoint.tree-rates.json").read_text())
    assert len(rates["rates"]) == 2 and rates["subset"] == "valid" and rates["sentences"] == 20


def test_a_rerun_skips_the_finished_steps(made):
    before = os.path.getmtime(made["out"] / "checkpoint.pt")
    status, output = speed_up(made["base"], made["data"], made["raw"] / "train.de", made["out"], "--updates", UPDATES,
                              "--proposal-heads", 3, "--cpu", "--num-workers", 0)
    assert status == 0, output[-3000:]
    for n, name in enumerate(speedup.STEPS, 1):
        assert f"step {n}/{len(speedup.STEPS)} {name}: done, skipped" in output
    assert "the heads accept" in output
    assert os.path.getmtime(made["out"] / "checkpoint.pt") == before


def test_an_interrupted_training_resumes_from_checkpoint_last(made, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(made["out"], out)
    shutil.rmtree(out / "train")
    record = json.loads((out / "speedup.json").read_text())
    del record["steps"]["train"]  # the later steps' records stay: the test reruns training alone
    (out / "speedup.json").write_text(json.dumps(record))
    argv = [sys.executable, "-m", "fairseq_bpd.speedup", made["base"], made["data"], made["raw"] / "train.de", out,
            "--updates", UPDATES, "--proposal-heads", 3, "--cpu", "--num-workers", 0]
    process = subprocess.Popen(list(map(str, argv)), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:  # killed once a first checkpoint is saved
        if "Saved checkpoint" in line and "checkpoint_last.pt" in line:
            process.kill()
            break
    process.wait()
    assert process.returncode != 0
    status, output = speed_up(*argv[3:])
    assert status == 0, output[-3000:]
    assert "step 1/6 distil: done, skipped" in output and "step 2/6 train: done in" in output
    resumed = re.search(rf"Loaded checkpoint {out}/train/checkpoint_last.pt \(epoch \d+ @ (\d+) updates\)", output)
    assert resumed and 0 < int(resumed.group(1)) < UPDATES, output[-3000:]
    assert json.loads((out / "speedup.json").read_text())["steps"]["train"]["updates"] == UPDATES
    status, output = speed_up(*argv[3:])  # finished training is not resumed
    assert status == 0 and "step 2/6 train: done, skipped" in output


def refused(*args):
    with pytest.raises(SystemExit) as refusal:
        speedup.main([*map(str, args), "--cpu"])
    return str(refusal.value)


def test_a_checkpoint_that_is_no_translation_model_is_refused(made, tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    message = refused(text, made["data"], made["raw"] / "train.de", tmp_path / "out")
    assert message.startswith(f"error: CHECKPOINT {text}: cannot read checkpoint")
    state = torch.load(made["base"])
    state["cfg"]["task"]["_name"] = "language_modeling"
    lm = tmp_path / "lm.pt"
    torch.save(state, lm)
    message = refused(lm, made["data"], made["raw"] / "train.de", tmp_path / "out")
    assert message == (f"error: CHECKPOINT {lm} is a language_modeling model (its --task), not a translation "
                       "model (--task translation)")
    assert not (tmp_path / "out").exists()


def test_a_data_bin_with_other_dictionaries_is_refused(made, tmp_path):
    data = tmp_path / "bin"
    shutil.copytree(made["data"], data)
    entries = (data / "dict.en.txt").read_text().splitlines()
    (data / "dict.en.txt").write_text("\n".join(entries[:-8]) + "\n")
    message = refused(made["base"], data, made["raw"] / "train.de", tmp_path / "out")
    assert message.startswith(f"error: DATA {data}: dict.en.txt has 40 entries where the checkpoint's target "
                              "embeddings have 48")
    entries[0], entries[1] = entries[1], entries[0]  # as many entries, in another order
    (data / "dict.en.txt").write_text("\n".join(entries) + "\n")
    message = refused(made["base"], data, made["raw"] / "train.de", tmp_path / "out")
    assert message.startswith(f"error: DATA {data}: dict.en.txt differs from {made['data']}/dict.en.txt, the "
                              "checkpoint's, from entry 4 on")
    assert not (tmp_path / "out").exists()


def test_an_empty_source_file_is_refused(made, tmp_path):
    empty = tmp_path / "empty.de"
    empty.write_text("")
    message = refused(made["base"], made["data"], empty, tmp_path / "out")
    assert message == f"error: SOURCE {empty} is empty: give it one source sentence a line"


def test_an_output_directory_with_another_runs_files_is_refused_and_left_alone(made, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoint.pt").write_text("someone's\n")
    message = refused(made["base"], made["data"], made["raw"] / "train.de", other)
    assert message == f"error: OUT {other} holds other files and no speedup.json: give a new or empty directory"
    assert os.listdir(other) == ["checkpoint.pt"]
    notes = tmp_path / "notes.txt"
    notes.write_text("someone's\n")
    for out, message in ((notes, f"OUT {notes} is a file, not a directory: give a new or empty directory"),
                         (notes / "out", f"OUT {notes / 'out'}: cannot make the directory (Not a directory)")):
        assert refused(made["base"], made["data"], made["raw"] / "train.de", out) == f"error: {message}"
    assert notes.read_text() == "someone's\n"
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "speedup.json").write_text("{")
    assert refused(made["base"], made["data"], made["raw"] / "train.de", damaged) == (
        f"error: {damaged / 'speedup.json'} is not a speedup record (damaged or another program's): move it "
        "away, or give a new OUT")
    assert (damaged / "speedup.json").read_text() == "{"
    message = refused(made["base"], made["data"], made["raw"] / "valid.de", made["out"], "--updates", UPDATES,
                      "--proposal-heads", 3, "--num-workers", 0)
    assert message.startswith(f"error: OUT {made['out']} holds another run's files (its speedup.json has other "
                              "source, source_sha256)")


def test_a_blockwise_output_that_is_not_the_greedy_output_fails_the_check(made, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(made["out"], out)
    record = json.loads((out / "speedup.json").read_text())
    del record["steps"]["check"], record["steps"]["widths"], record["steps"]["speed"]
    (out / "speedup.json").write_text(json.dumps(record))
    reference = (out / "text" / "greedy-valid.txt").read_text().splitlines()
    changed = next(i for i, line in enumerate(reference) if line.startswith("H-"))
    reference[changed] += " t0"  # as if the heads had changed one translation
    (out / "text" / "greedy-valid.txt").write_text("\n".join(reference) + "\n")
    status, output = speed_up(made["base"], made["data"], made["raw"] / "train.de", out, "--updates", UPDATES,
                              "--proposal-heads", 3, "--cpu", "--num-workers", 0)
    assert status != 0
    assert "error: the check failed: blockwise output differs from CHECKPOINT's greedy output on 1 of 20" in output
    assert "check" not in json.loads((out / "speedup.json").read_text())["steps"]


def test_without_scripts_tree_rates_the_step_is_skipped_and_said(made, monkeypatch, capsys):
    monkeypatch.setattr(speedup_steps, "TREE_RATES", "/nonexistent/tree_rates.py")
    assert speedup_steps.rates(None, None) is None
    assert "skipped: scripts/tree_rates.py comes with the repository" in capsys.readouterr().out


def test_a_source_of_unknown_tokens_draws_a_warning(made, tmp_path, capsys):
    raw = tmp_path / "raw.de"
    raw.write_text("Und Gott sprach: Es werde Licht!\n")
    assert speedup.check_source(str(raw), str(made["data"]), "de") == 1
    assert "warning: 100% of SOURCE's tokens are not in DATA's dict.de.txt" in capsys.readouterr().out


def test_a_flag_fairseq_train_refuses_is_refused_before_anything_is_written(made, tmp_path, capsys):
    with pytest.raises(SystemExit):
        speedup.main([str(made["base"]), str(made["data"]), str(made["raw"] / "train.de"), str(tmp_path / "out"),
                      "--no-such-flag", "--cpu"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
