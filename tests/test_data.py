"""Tests for the data-preparation scripts (offline, small data only)."""
import os
import sqlite3
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import detok  # noqa: E402
import get_bible  # noqa: E402
import prepare_data  # noqa: E402

SUBJ = [("der Mann", "the man"), ("die Frau", "the woman"), ("das Kind", "the child"),
        ("der König", "the king"), ("die Stadt", "the city")]
VERB = [("sieht", "sees"), ("liebt", "loves"), ("ruft", "calls"), ("findet", "finds")]
OBJ = [("den Hund", "the dog"), ("das Haus", "the house"), ("den Brief", "the letter")]


def toy_pairs(n, offset=0):
    """n German/English sentence pairs built from a small grammar."""
    pairs = []
    for i in range(offset, offset + n):
        (sd, se), (vd, ve), (od, oe) = (SUBJ[i % 5], VERB[i // 5 % 4],
                                        OBJ[i // 20 % 3])
        pairs.append((f"{sd.capitalize()} {vd} {od}, sagt er.",
                      f"{se.capitalize()} {ve} {oe}, he says."))
    return pairs


def write_corpus(prefix, pairs):
    """Write PREFIX.de and PREFIX.en."""
    for i, lang in enumerate(("de", "en")):
        Path(f"{prefix}.{lang}").write_text(
            "".join(p[i] + "\n" for p in pairs), encoding="utf-8")


def cli_args(tmp_path, out="bin"):
    """Arguments for prepare_data.main on the corpus under tmp_path."""
    return ["--src", "de", "--tgt", "en", "--train", str(tmp_path / "train"),
            "--valid", str(tmp_path / "valid"), "--test", str(tmp_path / "test"),
            "--out", str(tmp_path / out), "--merges", "50"]


@pytest.fixture
def corpus(tmp_path):
    """A tiny train/valid/test corpus: 60/7/5 pairs."""
    write_corpus(tmp_path / "train", toy_pairs(60))
    write_corpus(tmp_path / "valid", toy_pairs(7, offset=3))
    write_corpus(tmp_path / "test", toy_pairs(5, offset=11))
    return tmp_path


def test_prepare_builds_joined_data_bin(corpus, capsys):
    from fairseq.data import Dictionary, data_utils

    prepare_data.main(cli_args(corpus))
    out = corpus / "bin"
    assert (out / "dict.de.txt").read_bytes() == (out / "dict.en.txt").read_bytes()
    dictionary = Dictionary.load(str(out / "dict.de.txt"))
    for split, n in (("train", 60), ("valid", 7), ("test", 5)):
        for lang in ("de", "en"):
            stem = str(out / f"{split}.de-en.{lang}")
            assert os.path.exists(stem + ".bin") and os.path.exists(stem + ".idx")
            ds = data_utils.load_indexed_dataset(stem, dictionary)
            assert len(ds) == n
            assert (out / "text" / f"{split}.bpe.{lang}").exists()
    assert (out / "bpe.codes").read_text().startswith("#version")
    assert (out / "raw" / "test.en").read_text() == (corpus / "test.en").read_text()

    # A rerun on unchanged input is skipped; a new setting rebuilds.
    capsys.readouterr()
    prepare_data.main(cli_args(corpus))
    assert "up to date" in capsys.readouterr().out
    prepare_data.main(cli_args(corpus)[:-1] + ["40"])
    assert "up to date" not in capsys.readouterr().out
    # Up to date by .done, but a file it wrote deleted since: was "up to date", the file gone.
    (out / "text" / "train.bpe.de").unlink()
    prepare_data.main(cli_args(corpus)[:-1] + ["40"])
    assert "lacks " + str(out / "text" / "train.bpe.de") in capsys.readouterr().out
    assert len((out / "text" / "train.bpe.de").read_text().split("\n")) == 60 + 1


def test_missing_file_names_the_file(corpus):
    os.remove(corpus / "valid.en")
    with pytest.raises(SystemExit, match=r"not found: .*valid\.en"):
        prepare_data.main(cli_args(corpus))


def test_mismatched_line_counts_name_both_files(corpus):
    write_corpus(corpus / "test", toy_pairs(5))
    with open(corpus / "test.en", "a", encoding="utf-8") as f:
        f.write("One more line.\n")
    with pytest.raises(SystemExit) as err:
        prepare_data.main(cli_args(corpus))
    msg = str(err.value)
    assert "test.de has 5 lines" in msg and "test.en has 6 lines" in msg


def test_empty_corpus_names_the_file(corpus):
    write_corpus(corpus / "train", [])
    with pytest.raises(SystemExit, match=r"empty corpus: .*train\.de"):
        prepare_data.main(cli_args(corpus))
    assert not (corpus / "bin").exists()


@pytest.mark.parametrize("raw, clean", [
    ("(3:19) Dies aber ist das Gericht.", "Dies aber ist das Gericht."),
    ("auf daß jeder [nicht verloren gehe, sondern] ewiges Leben habe.",
     "auf daß jeder nicht verloren gehe, sondern ewiges Leben habe."),
    ("one golden spoon of ten [shekels], full of incense;",
     "one golden spoon of ten shekels, full of incense;"),
    ("gestellt auf ewig. * * *", "gestellt auf ewig."),
    ("Er\u00adbarmen {und} (Gnade) <hier>", "Erbarmen und Gnade hier"),
    ("God`s  Spirit \t was  there (3, 4) .", "God's Spirit was there."),
    ("(*)", ""),
])
def test_clean_text(raw, clean):
    assert get_bible.clean_text(raw) == clean


def test_bible_pairs_drops_placeholders_and_psalm_headings(tmp_path):
    db = tmp_path / "bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bible (bbName TEXT, bNumber INT, cNumber INT, "
                "vNumber INT, vText TEXT)")
    con.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?)", [
        ("e", 1, 1, 1, "Im Anfang schuf Gott [die] Himmel."),
        ("4", 1, 1, 1, "In the beginning God created the heavens."),
        ("e", 19, 2, 12, "Küsset den Sohn!"),
        ("4", 19, 2, 12, "Give sincere homage to the Son. Psalm 3 A Psalm by David."),
        ("e", 19, 3, 1, "(Ein Psalm von David.) Jehova! wie viele sind meiner Bedränger!"),
        ("4", 19, 3, 1, "Yahweh, how my adversaries have increased!"),
        ("e", 40, 23, 14, "(*)"),
        ("4", 40, 23, 14, "But woe to you."),
        ("e", 44, 8, 37, "(MISSING) [KJV: And Philip said.]"),
        ("4", 44, 8, 37, "dummy verses inserted by amos"),
    ])
    con.commit()
    con.close()
    assert list(get_bible.bible_pairs(str(db))) == [
        (1, "Im Anfang schuf Gott die Himmel.", "In the beginning God created the heavens."),
        (19, "Küsset den Sohn!", "Give sincere homage to the Son."),
        (19, "Jehova! wie viele sind meiner Bedränger!",
         "Yahweh, how my adversaries have increased!"),
    ]


def test_ding_pairs_keeps_whole_example_sentences(tmp_path):
    path = tmp_path / "trans-de-en" / "usr/share/trans/de-en"
    path.parent.mkdir(parents=True)
    path.write_text(
        "# Version :: test\n"
        "Abhilfe {f} | Das ist nicht einfach. | Hilf mir!; Hilf uns! :: "
        "remedy | That is not easy. | Help me!; Help us!\n"
        "Aal {m} [cook.] :: eel\n", encoding="utf-8")
    assert list(get_bible.ding_pairs(str(tmp_path))) == [
        ("Das ist nicht einfach.", "That is not easy."), ("Hilf mir!", "Help me!")]


def test_detokenize_removes_bpe_and_moses_tokens():
    assert detok.remove_bpe("Lich@@ t und Fin@@") == "Licht und Fin"
    assert detok.detokenize("Und Gott sprach : Es wer@@ de Licht !", "de") == \
        "Und Gott sprach: Es werde Licht!"
    assert detok.detokenize("God 's Spirit , \" he said . \"", "en") == \
        "God's Spirit, \"he said.\""
    assert detok.main(["--lang", "en", os.devnull]) is None


def test_line_separators_inside_lines_keep_pairs_aligned(tmp_path):
    """str.splitlines() breaks at U+2028, U+0085, \\r, ...: each is a space inside a line."""
    pairs = toy_pairs(60)
    marked = list(pairs)
    marked[10] = (pairs[10][0].replace(" sagt", "\u2028sagt"), pairs[10][1])
    marked[40] = (pairs[40][0], pairs[40][1].replace(" he", "\x85he"))
    marked[20] = (pairs[20][0].replace(" ", "\u2029", 1), pairs[20][1])
    marked[30] = (pairs[30][0], pairs[30][1].replace(" ", "\v", 1))
    # Three extra breaks on each side: read with splitlines, 63 pairs, all but 10 misaligned.
    marked[50] = (pairs[50][0].replace(" ", "\r", 1), pairs[50][1].replace(" ", "\x1c", 1))
    for name, corpus in (("plain", pairs), ("marked", marked)):
        (tmp_path / name).mkdir()
        write_corpus(tmp_path / name / "train", corpus)
        write_corpus(tmp_path / name / "valid", corpus[:7])
        write_corpus(tmp_path / name / "test", [corpus[10]] + corpus[40:44])
        prepare_data.main(cli_args(tmp_path / name))
    plain, marked_out = tmp_path / "plain" / "bin", tmp_path / "marked" / "bin"
    for name, n in (("train.tok.de", 60), ("train.tok.en", 60), ("train.bpe.de", 60),
                    ("train.bpe.en", 60), ("test.tok.en", 5)):
        lines = (marked_out / "text" / name).read_text(encoding="utf-8").split("\n")
        assert len(lines) == n + 1  # the last newline
        assert lines == (plain / "text" / name).read_text(encoding="utf-8").split("\n"), name
    # The references for BLEU: one line a pair, whatever reads them.
    assert (marked_out / "raw" / "test.en").read_text(encoding="utf-8").splitlines() == \
        [en.replace("\x85", " ") for _, en in [marked[10]] + marked[40:44]]
    assert (marked_out / "train.de-en.en.bin").read_bytes() == (plain / "train.de-en.en.bin").read_bytes()


def test_a_line_break_in_what_was_written_is_caught(corpus, monkeypatch):
    """Counts are checked on what was written, as fairseq-preprocess reads it."""
    tokenize = prepare_data.tokenize

    def tokenize_breaking_a_line(lines, lang, workers=2):
        out = tokenize(lines, lang, workers)
        return [out[0].replace(" ", "\r", 1)] + out[1:]

    monkeypatch.setattr(prepare_data, "tokenize", tokenize_breaking_a_line)
    with pytest.raises(SystemExit, match=r"train\.tok\.de has 61 lines for 60 sentence pairs"):
        prepare_data.main(cli_args(corpus))
    assert not (corpus / "bin" / ".done").exists()


def test_non_utf8_input_names_the_file(corpus):
    (corpus / "valid.en").write_bytes("The man sees the dog.\nThe caf\xe9 he says.\n".encode("latin-1"))
    with pytest.raises(SystemExit, match=r"valid\.en is not UTF-8 text: line 2"):
        prepare_data.main(cli_args(corpus))


def test_byte_order_mark_is_dropped(corpus):
    for name in ("train.de", "train.en", "test.en"):
        path = corpus / name
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    prepare_data.main(cli_args(corpus))
    out = corpus / "bin"
    dictionary = (out / "dict.en.txt").read_text(encoding="utf-8")
    assert "\ufeff" not in dictionary
    references = (out / "raw" / "test.en").read_text(encoding="utf-8")
    assert references == "".join(en + "\n" for _, en in toy_pairs(5, offset=11))
    first = (out / "text" / "train.tok.de").read_text(encoding="utf-8").split("\n")[0]
    assert first == "Der mann sieht den Hund , sagt er ."  # no BOM token before "Der"


def test_classic_mac_line_ends_are_line_ends(corpus):
    """Was: files whose lines end in a bare CR (no newline at all) read as one line each,
    so a corpus in them came out as one pair, without a word."""
    for name in ("train.de", "train.en", "test.en"):
        path = corpus / name
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))
    prepare_data.main(cli_args(corpus))
    out = corpus / "bin"
    tokens = (out / "text" / "train.tok.de").read_text(encoding="utf-8").split("\n")
    assert len(tokens) == 60 + 1 and tokens[0] == "Der mann sieht den Hund , sagt er ."
    references = (out / "raw" / "test.en").read_text(encoding="utf-8")
    assert references == "".join(en + "\n" for _, en in toy_pairs(5, offset=11))


def test_byte_order_marks_of_joined_files_are_dropped(corpus):
    """cat a b of two files saved with a BOM leaves one at the start of b's first line."""
    for name, first in (("train.de", 30), ("train.en", 30), ("test.en", 2)):
        path = corpus / name
        lines = path.read_bytes().split(b"\n")
        bom = b"\xef\xbb\xbf"
        path.write_bytes(bom + b"\n".join(lines[:first]) + b"\n" + bom + b"\n".join(lines[first:]))
    prepare_data.main(cli_args(corpus))
    out = corpus / "bin"
    assert "\ufeff" not in (out / "dict.en.txt").read_text(encoding="utf-8")
    references = (out / "raw" / "test.en").read_text(encoding="utf-8")
    assert references == "".join(en + "\n" for _, en in toy_pairs(5, offset=11))
    joined = (out / "text" / "train.tok.de").read_text(encoding="utf-8").split("\n")[30]
    assert joined == "Der mann ruft das Haus , sagt er ."  # no BOM token before "Der"


@pytest.mark.parametrize("flags, message", [
    (["--workers", "0"], "--workers must be 1 or more (got 0)"),  # was a ZeroDivisionError
    (["--tgt", "de"], "--src and --tgt must be two languages (got de for both)"),  # was de-de "pairs"
])
def test_bad_flags_are_named(corpus, capsys, flags, message):
    with pytest.raises(SystemExit):
        prepare_data.main(cli_args(corpus) + flags)
    assert message in capsys.readouterr().err
    assert not (corpus / "bin").exists()
