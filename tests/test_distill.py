"""scripts/distill.sh: reruns distil again when their inputs changed, and every target is
paired with the source it was translated from (scripts/distill_targets.py checks it)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PLUGIN
from test_data import SCRIPTS, cli_args, toy_pairs, write_corpus
from test_train import ENV, TINY, finish, fairseq

sys.path.insert(0, str(SCRIPTS))
import distill_targets  # noqa: E402
import prepare_data  # noqa: E402

# recipe.sh passes --user-dir: the plugin's allow-list loads a plain transformer weights-only.
GENERATE = ["--user-dir", PLUGIN, "--cpu", "--num-workers", "0", "--batch-size", "16"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A data-bin made by prepare_data.py from 60 toy pairs, and a plain transformer on it."""
    root = tmp_path_factory.mktemp("distill")
    write_corpus(root / "train", toy_pairs(60))
    write_corpus(root / "valid", toy_pairs(7, offset=3))
    write_corpus(root / "test", toy_pairs(5, offset=11))
    prepare_data.main(cli_args(root))
    finish(fairseq(
        "fairseq-train", str(root / "bin"), *TINY, "--task", "translation", "--arch", "transformer",
        "--criterion", "label_smoothed_cross_entropy", "--save-dir", str(root / "base"),
        "--disable-validation",
    ))
    return root / "bin", root / "base" / "checkpoint_last.pt"


def distill(data, checkpoint, out, sentences=None):
    """Run distill.sh; its output (stdout and stderr). Fails the test if it fails."""
    env = {**ENV, **({"SENTENCES": str(sentences)} if sentences else {})}
    process = subprocess.run(
        ["bash", str(SCRIPTS / "distill.sh"), str(data), str(checkpoint), str(out), *GENERATE],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-3000:]
    return output


def lines(path):
    return Path(path).read_text(encoding="utf-8").split("\n")[:-1]


def assert_paired(out, sources):
    """OUT's train set: the given sources, each with the hypothesis fairseq-generate made for it,
    and both sides binarised to as many sentences."""
    from fairseq.data import data_utils

    assert lines(out / "text" / "train.bpe.de") == sources
    generated = lines(out / "generate-train.txt")
    source_of = dict(re.findall(r"^S-(\d+)\t(.*)$", "\n".join(generated), re.M))
    hypothesis_of = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", "\n".join(generated), re.M))
    assert [source_of[str(i)] for i in range(len(sources))] == sources
    assert lines(out / "text" / "train.bpe.en") == [hypothesis_of[str(i)] for i in range(len(sources))]
    for lang in ("de", "en"):
        assert len(data_utils.load_indexed_dataset(str(out / f"train.de-en.{lang}"), None)) == len(sources)


def test_rerun_distils_again_when_an_input_changed(base, tmp_path):
    data, checkpoint = base
    out = tmp_path / "distilled"
    source = lines(data / "text" / "train.bpe.de")
    distill(data, checkpoint, out, sentences=37)
    assert_paired(out, source[:37])

    log = distill(data, checkpoint, out, sentences=50)  # was 50 sources with 37 targets
    assert_paired(out, source[:50])
    assert "distilling again" in log

    # Unchanged inputs: the targets are reused, not translated again.
    before = (out / "generate-train.txt").stat().st_mtime_ns
    assert "distilling again" not in distill(data, checkpoint, out, sentences=50)
    assert (out / "generate-train.txt").stat().st_mtime_ns == before
    assert_paired(out, source[:50])
    # Its generate output deleted, to translate again: was a FileNotFoundError traceback.
    (out / "generate-train.txt").unlink()
    distill(data, checkpoint, out, sentences=50)
    assert_paired(out, source[:50])

    # The same N of reshuffled data: was every pair misaligned, without a word.
    for lang in ("de", "en"):
        path = data / "text" / f"train.bpe.{lang}"
        path.write_text("".join(line + "\n" for line in reversed(lines(path))), encoding="utf-8")
    assert "distilling again" in distill(data, checkpoint, out, sentences=50)
    assert_paired(out, source[::-1][:50])

    # A new base checkpoint at the same path (recipe.sh rerun after more training).
    state = torch.load(checkpoint)
    state["model"]["decoder.output_projection.weight"] *= 2
    torch.save(state, checkpoint)
    assert "distilling again" in distill(data, checkpoint, out, sentences=50)
    assert_paired(out, source[::-1][:50])


def write_generate(path, sources, hypotheses):
    with open(path, "w", encoding="utf-8") as f:
        for i, text in sources.items():
            f.write(f"S-{i}\t{text}\n")
        for i, text in hypotheses.items():
            f.write(f"H-{i}\t-0.5\t{text}\nD-{i}\t-0.5\t{text}\nP-{i}\t-0.1 -0.2\n")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "train.bpe.de"
    path.write_text("a b\nc d@@ e\nf\n", encoding="utf-8")
    return str(path)


def test_targets_come_out_in_sentence_order(tmp_path, source):
    generated, targets = str(tmp_path / "generate.txt"), str(tmp_path / "train.bpe.en")
    # fairseq prints sentences in batch order, and a word outside the dictionary as <unk>.
    write_generate(generated, {2: "f", 0: "a b", 1: "<unk> d@@ e"}, {2: "F", 0: "A B", 1: ""})
    distill_targets.main(["extract", generated, source, targets])
    assert lines(targets) == ["A B", "", "F"]


@pytest.mark.parametrize("sources, hypotheses, message", [
    ({0: "a b", 1: "c d@@ e"}, {0: "A", 1: "C"}, r"has 2 S- lines for the 3 sources in .* \(first missing: S-2\)"),
    ({0: "a b", 1: "c d@@ e", 2: "f"}, {0: "A", 2: "F"}, r"has 2 H- lines for the 3 sources"),
    ({0: "a b", 1: "f", 2: "c d@@ e"}, {0: "A", 1: "F", 2: "C"},
     r"translated S-1 'f', but line 2 of .*train\.bpe\.de is 'c d@@ e': its targets belong to other sources"),
    ({0: "a b", 1: "c d e", 2: "f"}, {0: "A", 1: "C", 2: "F"}, r"translated S-1 'c d e'"),  # --remove-bpe
])
def test_targets_that_do_not_pair_are_refused(tmp_path, source, sources, hypotheses, message):
    generated, targets = str(tmp_path / "generate.txt"), str(tmp_path / "train.bpe.en")
    write_generate(generated, sources, hypotheses)
    with pytest.raises(SystemExit, match=message):
        distill_targets.main(["extract", generated, source, targets])
    assert not os.path.exists(targets)


def test_a_sentence_twice_is_refused(tmp_path, source):
    generated = str(tmp_path / "generate.txt")
    write_generate(generated, {0: "a b", 1: "c d@@ e", 2: "f"}, {0: "A", 1: "C", 2: "F"})
    with open(generated, "a", encoding="utf-8") as f:
        f.write("H-1\t-0.3\tC2\n")
    with pytest.raises(SystemExit, match=r"two H-1 lines"):
        distill_targets.main(["extract", generated, source, str(tmp_path / "out")])


@pytest.fixture
def corpus_text(tmp_path):
    """A data folder as far as distill.sh looks before translating, and a checkpoint file."""
    data = tmp_path / "data bin"  # a space: every path is quoted
    (data / "text").mkdir(parents=True)
    for lang in ("de", "en"):
        (data / f"dict.{lang}.txt").write_text("a 1\n", encoding="utf-8")
        (data / "text" / f"train.bpe.{lang}").write_text(f"{lang} 1\n{lang} 2\n", encoding="utf-8")
    checkpoint = tmp_path / "base.pt"
    checkpoint.write_bytes(b"not read: refused before")
    return data, checkpoint


def refused(data, checkpoint, out, env=()):
    process = subprocess.run(
        ["bash", str(SCRIPTS / "distill.sh"), str(data), str(checkpoint), str(out), *GENERATE],
        env={**ENV, **dict(env)}, capture_output=True, text=True, timeout=60,
    )
    assert process.returncode != 0
    return process.stderr


@pytest.mark.parametrize("out", ["{data}", "{data}/", "{data}/../data bin", "subset of it"])
def test_out_that_is_the_corpus_is_refused_and_nothing_lost(corpus_text, out):
    """Was: OUT = DATA replaced DATA's human train targets with the base model's translations
    (and under SENTENCES, DATA = OUT/subset cut DATA's train text to its first N lines)."""
    data, checkpoint = corpus_text
    before = {path: path.read_bytes() for path in data.rglob("*") if path.is_file()}
    if out == "subset of it":
        data_arg, out_arg = data.parent / "subset", data.parent
        data_arg.symlink_to(data)
    else:
        data_arg, out_arg = data, out.format(data=data)
    message = refused(data_arg, checkpoint, out_arg, {"SENTENCES": "1"})
    assert f"would overwrite the corpus DATA {data_arg}" in message, message
    assert {path: path.read_bytes() for path in data.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("sentences", ["0", "-5", "abc", "1.5"])
def test_sentences_that_is_not_a_count_is_refused(corpus_text, tmp_path, sentences):
    """Was: SENTENCES=0 a traceback from an empty train set, SENTENCES=-5 all but the last 5 pairs."""
    data, checkpoint = corpus_text
    message = refused(data, checkpoint, tmp_path / "out", {"SENTENCES": sentences})
    assert f"SENTENCES={sentences}: give a number of training pairs" in message, message
    assert not (tmp_path / "out").exists()


def test_out_with_references_of_its_own_is_refused(corpus_text, tmp_path):
    """Was: ln -sfn put the link to DATA's references inside OUT/raw, and BLEU went on being
    scored against the old references there (OUT an older prepare_data.py folder)."""
    data, checkpoint = corpus_text
    (tmp_path / "out" / "raw").mkdir(parents=True)
    message = refused(data, checkpoint, tmp_path / "out")
    assert f"error: {tmp_path / 'out'}/raw is a folder of references of its own" in message, message
