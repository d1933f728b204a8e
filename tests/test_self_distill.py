"""Greedy self-distillation (scripts/self_distill.sh, scripts/get_source_text.py) and frozen
chained heads through the real CLIs, on a tiny corpus."""
import os
import re
import sqlite3
import subprocess
import sys

import pytest
import torch

from conftest import PLUGIN
from test_train import BLOCKWISE, ENV, TINY, binarised_corpus, fairseq, finish

sys.path.insert(0, os.path.join(os.path.dirname(PLUGIN), "scripts"))
import get_source_text  # noqa: E402
import hold_out  # noqa: E402

SELF_DISTILL = os.path.join(os.path.dirname(PLUGIN), "scripts", "self_distill.sh")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain transformer and chained heads trained on it frozen."""
    root = tmp_path_factory.mktemp("chained")
    data = binarised_corpus(root)
    finish(fairseq("fairseq-train", data, *TINY, "--task", "translation", "--arch", "transformer",
                   "--criterion", "label_smoothed_cross_entropy", "--save-dir", f"{root}/base"))
    base = f"{root}/base/checkpoint_last.pt"
    log = finish(fairseq("fairseq-train", data, *TINY, *BLOCKWISE, "--head-type", "chained",
                         "--finetune-from-model", base, "--freeze-base", "--save-dir", f"{root}/heads"))
    return {"root": root, "data": data, "base": base, "heads": f"{root}/heads/checkpoint_last.pt", "log": log}


def hypotheses(output):
    """fairseq-generate's H- lines, by sentence id: {id: tokens}."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", output, re.M)}


def test_frozen_chained_heads_keep_the_base_greedy_output(runs):
    base, trained = torch.load(runs["base"])["model"], torch.load(runs["heads"])["model"]
    for key, value in base.items():
        assert torch.equal(trained[key], value), key
    assert {key for key in trained if key not in base} == {
        f"decoder.heads.{fc}.{i}.{p}" for fc in ("fc_in", "fc_out") for i in (0, 1) for p in ("weight", "bias")}
    assert trained["decoder.heads.fc_out.1.weight"].abs().sum() > 0  # initialised to zero, then trained
    line = re.search(r"\| valid \| epoch 001 \|.*", runs["log"]).group(0)
    assert all(f"| acc_h{h} " in line for h in (1, 2, 3)) and "| block " in line, line

    common = ["--gen-subset", "valid", "--max-tokens", "500", "--cpu", "--num-workers", "0",
              "--required-batch-size-multiple", "1"]
    greedy = finish(fairseq("fairseq-generate", runs["data"], "--path", runs["base"], "--user-dir", PLUGIN,
                            "--beam", "1", *common))
    chained = finish(fairseq("fairseq-generate", runs["data"], "--path", runs["heads"], "--user-dir", PLUGIN,
                             "--task", "translation_blockwise", "--blockwise", *common))
    assert len(hypotheses(greedy)) == 20
    assert hypotheses(chained) == hypotheses(greedy)
    assert "blockwise: 20 sentences" in chained


def self_distill(*args, **env):
    return subprocess.run(["bash", SELF_DISTILL, *args], env={**ENV, **env}, text=True, capture_output=True)


def test_self_distill_pairs_every_source_line_with_the_base_greedy_output(runs, tmp_path):
    source = runs["root"] / "raw" / "valid.de"
    out = tmp_path / "distilled"
    done = self_distill(runs["data"], runs["base"], str(source), str(out), "--cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    targets = (out / "text" / "train.bpe.en").read_text().splitlines()
    assert len(targets) == 20 and (out / "text" / "train.bpe.de").read_text() == source.read_text()
    greedy = hypotheses(finish(fairseq("fairseq-generate", runs["data"], "--path", runs["base"], "--user-dir",
                                       PLUGIN, "--beam", "1", "--gen-subset", "valid", "--cpu", "--required-batch-size-multiple", "1",
                                       "--max-len-a", "1.2", "--max-len-b", "10")))
    assert targets == [greedy[i] for i in range(20)]
    assert "20 sents" in (out / "preprocess-train.log").read_text()
    assert os.path.islink(out / "valid.de-en.en.bin")  # human references stay for BLEU
    # The chained checkpoint's blockwise decoding makes the same targets, as a test split.
    again = self_distill(runs["data"], runs["heads"], str(source), str(out), "--cpu",
                         "--task", "translation_blockwise", "--blockwise", SPLIT="test")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "text" / "test.bpe.en").read_text().splitlines() == targets
    assert not os.path.islink(out / "test.de-en.en.bin")


def test_self_distill_bad_input_is_named(runs, tmp_path):
    data, base = runs["data"], runs["base"]
    blank, empty = tmp_path / "blank.de", tmp_path / "empty.de"
    blank.write_text("w1 w2\n \nw3\n")
    empty.write_text("")
    out = str(tmp_path / "out")
    cases = [
        ((data, base, str(tmp_path / "missing.de"), out), {}, "not found: " + str(tmp_path / "missing.de")),
        ((data, base, str(blank), out), {}, "line 2 is blank"),
        ((data, base, str(empty), out), {}, "is empty"),
        ((data, str(tmp_path / "none.pt"), str(blank), out), {}, "not found: "),
        ((data, base, str(blank), out), {"SPLIT": "dev"}, "SPLIT must be train, valid or test"),
        ((data, base, str(blank), out), {"SRC": "fr"}, "no dict.fr.txt"),
        ((data, base), {}, "usage:"),
    ]
    for args, env, message in cases:
        done = self_distill(*args, **env)
        assert done.returncode != 0 and message in done.stderr, (args, env, done.stderr)
    assert not os.path.exists(os.path.join(out, "text", "train.bpe.en"))


def test_source_text_leaves_out_valid_and_test_books(tmp_path, capsys):
    db = tmp_path / "bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bible (bbName TEXT, bNumber INT, cNumber INT, vNumber INT, vText TEXT)")
    con.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?)", [
        ("s", 1, 1, 1, "Im Anfang schuf Gott den Himmel (1,1)."),
        ("s", 6, 1, 1, "Josua, valid."), ("s", 7, 1, 1, "Richter, test."),
        ("s", 45, 1, 1, "Römer, test."), ("s", 46, 1, 1, "Korinther, valid."),
        ("s", 40, 23, 14, "(*)"), ("s", 66, 22, 21, "Die Gnade sei mit allen!"),
        ("e", 1, 1, 1, "Im Anfang schuf Gott die Himmel."),
    ])
    con.commit()
    con.close()
    out = tmp_path / "extra.de"
    codes = tmp_path / "codes"
    codes.write_text("#version: 0.2\nj a</w>\n")  # one merge: "ja" stays whole, other words split
    get_source_text.main([str(out), "--db", str(db), "--codes", str(codes)])
    assert out.read_text().splitlines() == ["Im Anfang schuf Gott den Himmel.", "Die Gnade sei mit allen!"]
    assert len((tmp_path / "extra.de.bpe").read_text().splitlines()) == 2
    assert get_source_text.bpe_lines(["ja, Ja!"], str(codes), "de") == ["ja , J@@ a !"]
    assert "2 verses" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--bible 'x': no such translation"):
        get_source_text.main([str(out), "--db", str(db), "--bible", "x"])
    with pytest.raises(SystemExit, match="--codes: file not found"):
        get_source_text.main([str(out), "--db", str(db), "--codes", str(tmp_path / "nope")])


def test_hold_out_splits_by_source_and_binarises_both_splits(tmp_path, capsys):
    data = binarised_corpus(tmp_path)
    (tmp_path / "pairs" / "text").mkdir(parents=True)
    sources = (tmp_path / "raw" / "train.de").read_text().splitlines()
    targets = (tmp_path / "raw" / "train.en").read_text().splitlines()
    distinct = {}
    for source, target in zip(sources, targets):
        distinct.setdefault(source, target)  # one pair a source, as self-distillation makes
    sources, targets = list(distinct), list(distinct.values())

    def split(n, out):
        for lang, lines in (("de", sources[:n]), ("en", targets[:n])):
            (tmp_path / "pairs" / "text" / f"train.bpe.{lang}").write_text("".join(line + "\n" for line in lines))
        hold_out.main([str(tmp_path / "pairs"), str(tmp_path / out), "--one-in", "5", "--data", data])
        text = tmp_path / out / "text"
        return {name: list(zip((text / f"{name}.bpe.de").read_text().splitlines(),
                               (text / f"{name}.bpe.en").read_text().splitlines())) for name in ("train", "valid")}

    full = split(len(sources), "full")
    assert sorted(full["train"] + full["valid"]) == sorted(zip(sources, targets))
    assert 0 < len(full["valid"]) < len(sources) / 2
    assert all(hold_out.held_out(s, 5) for s, _ in full["valid"]) and not any(hold_out.held_out(s, 5) for s, _ in full["train"])
    for split_name in ("train", "valid"):
        assert (tmp_path / "full" / f"{split_name}.de-en.en.bin").stat().st_size > 0
    assert f"{len(full['train'])} train and {len(full['valid'])} held-out (valid) pairs" in capsys.readouterr().out
    # Fewer pairs of the same text hold out the same sources among them.
    half = split(len(sources) // 2, "half")
    first = set(sources[: len(sources) // 2])
    assert half["valid"] == [pair for pair in full["valid"] if pair[0] in first]


def test_hold_out_trains_on_a_random_draw_of_the_pairs(tmp_path, capsys):
    """--train-pairs N: N of the training pairs (a seeded draw, in order), the held-out split
    the full one's; N outside 1..the training pairs is refused naming the flag."""
    data = binarised_corpus(tmp_path)
    (tmp_path / "pairs" / "text").mkdir(parents=True)
    for lang in ("de", "en"):
        lines = list(dict.fromkeys((tmp_path / "raw" / f"train.{lang}").read_text().splitlines()))[:40]
        (tmp_path / "pairs" / "text" / f"train.bpe.{lang}").write_text("".join(line + "\n" for line in lines))

    def split(out, *flags):
        hold_out.main([str(tmp_path / "pairs"), str(tmp_path / out), "--one-in", "5", "--data", data, *flags])
        text = tmp_path / out / "text"
        return {name: list(zip((text / f"{name}.bpe.de").read_text().splitlines(),
                               (text / f"{name}.bpe.en").read_text().splitlines())) for name in ("train", "valid")}

    full = split("full")
    drawn = split("drawn", "--train-pairs", "7")
    assert len(drawn["train"]) == 7 and drawn["valid"] == full["valid"]
    assert drawn["train"] == [pair for pair in full["train"] if pair in set(drawn["train"])]  # in order
    assert split("again", "--train-pairs", "7")["train"] == drawn["train"]
    assert split("other", "--train-pairs", "7", "--seed", "2")["train"] != drawn["train"]
    assert "7 train and" in capsys.readouterr().out
    for count in ("0", str(len(full["train"]) + 1)):
        with pytest.raises(SystemExit, match=f"--train-pairs must be 1 to the {len(full['train'])} training pairs"):
            split("bad", "--train-pairs", count)


def test_hold_out_bad_input_is_named(tmp_path):
    (tmp_path / "pairs" / "text").mkdir(parents=True)
    (tmp_path / "pairs" / "text" / "train.bpe.de").write_text("a\nb\n")
    (tmp_path / "pairs" / "text" / "train.bpe.en").write_text("x\n")
    for args, message in (
        ([str(tmp_path / "none"), str(tmp_path / "out")], "not found: "),
        ([str(tmp_path / "pairs"), str(tmp_path / "out")], "2 source lines but 1 target lines"),
        ([str(tmp_path / "pairs"), str(tmp_path / "out"), "--one-in", "1"], "--one-in must be 2 or more"),
    ):
        with pytest.raises(SystemExit, match=message):
            hold_out.main(args)
    (tmp_path / "pairs" / "text" / "train.bpe.en").write_text("x\ny\n")
    with pytest.raises(SystemExit, match="no valid pairs .of 2. with --one-in 1000"):
        hold_out.main([str(tmp_path / "pairs"), str(tmp_path / "out"), "--one-in", "1000"])
