"""Nothing dropped, and bad requests refused by name, through fairseq's CLIs.

Most runs call a CLI's entry point (cli_main, with sys.argv set) in this process: the
same code as the command, without the 3 s interpreter start-up each. A few run as real
commands to show what a user sees.
"""
import contextlib
import importlib
import io
import logging
import sys
from argparse import Namespace
from unittest import mock

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import build
from cli_support import PLUGIN, TEST_SUBSETS, hypotheses, run, trained

SIZES = {n: subset for subset, n in TEST_SUBSETS.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


def cli_main(tool, *args, stdin="", stdout=None):
    """fairseq-<tool>'s entry point in this process, as the command would run it: its stdout.

    Pass `stdout` (a StringIO) to read what a failing run printed before it failed.
    """
    module = importlib.import_module(f"fairseq_cli.{tool}")  # imported late: it configures logging
    stdout = stdout or io.StringIO()
    argv = [f"fairseq-{tool}", *map(str, args)]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "stdin", io.StringIO(stdin)):
        with contextlib.redirect_stdout(stdout):
            module.cli_main()
    return stdout.getvalue()


def generate(tiny, *args, checkpoint=None):
    # No data-loading worker: each run's worker would make the next run wait 5 s to join it.
    return cli_main("generate", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                    "--path", checkpoint or tiny.checkpoint, "--cpu", "--num-workers", 0, *args)


def interactive(tiny, *args, stdin, data=None, checkpoint=None, stdout=None):
    return cli_main("interactive", data or tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                    "--path", checkpoint or tiny.checkpoint, "--cpu", "--source-lang", "de",
                    "--target-lang", "en", *args, stdin=stdin, stdout=stdout)


@pytest.mark.parametrize("decoding", [["--blockwise"], ["--beam", 1]])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.parametrize("n", [5, 9, 17])
def test_generate_translates_every_sentence(tiny, n, batch_size, decoding):
    # Stock fairseq drops a last batch that is not a multiple of --required-batch-size-multiple.
    output = generate(tiny, "--gen-subset", SIZES[n], "--batch-size", batch_size,
                      "--required-batch-size-multiple", 8, *decoding)
    assert sorted(hypotheses(output)) == list(range(n))


def test_validation_scores_every_sentence(tiny):
    # fairseq-validate takes its task from the checkpoint (translation_blockwise).
    output = run("fairseq-validate", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                 "--path", tiny.checkpoint, "--cpu",
                 "--valid-subset", ",".join(SIZES[n] for n in (5, 9, 17)), "--batch-size", 4,
                 "--required-batch-size-multiple", 8)
    for n in (5, 9, 17):
        with open(f"{tiny.raw}/{SIZES[n]}.en") as f:
            target_tokens = sum(len(line.split()) + 1 for line in f)  # with EOS
        line = next(line for line in output.splitlines() if f"valid on '{SIZES[n]}' subset" in line)
        assert f"| bsz {n}" in line and f"| wpb {target_tokens} " in line, line


@pytest.fixture(scope="module")
def headless(tiny, tmp_path_factory):
    """The tiny checkpoint as a plain transformer: its heads removed, its arch `transformer`."""
    state = checkpoint_utils.load_checkpoint_to_cpu(tiny.checkpoint)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = "transformer"
    state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("decoder.heads.")}
    path = tmp_path_factory.mktemp("headless") / "transformer.pt"
    torch.save(state, path)
    return str(path)


def test_headless_checkpoint_decodes_without_blockwise(tiny, headless):
    assert len(hypotheses(generate(tiny, "--beam", 1, "--batch-size", 8, checkpoint=headless))) == 20


BAD_REQUESTS = {
    "--block-size 0": (["--block-size", 0], "--block-size must be between 1 and the checkpoint's 3 heads"),
    "--block-size 4": (["--block-size", 4], "--block-size must be between 1 and the checkpoint's 3 heads"),
    "--beam 4": (["--beam", 4], "--beam 4 was given"),
    "--beam 5": (["--beam", 5], "--beam 5 was given"),  # fairseq's default, but asked for
    # --sampling needs --beam 1: fairseq checks --nbest == --beam first.
    "--sampling --blockwise-topk 2": (["--sampling", "--beam", 1, "--blockwise-topk", 2],
                                      "--blockwise-topk must be 1 with --sampling"),
    "--sampling --blockwise-min-block 2": (["--sampling", "--beam", 1, "--blockwise-min-block", 2],
                                           "--blockwise-min-block must be 1 with --sampling"),
    "--sampling-topp 1.5": (["--sampling", "--beam", 1, "--sampling-topp", 1.5], "--sampling-topp must be in \\(0, 1\\]"),
    "--sampling-topk without --sampling": (["--sampling-topk", 5], "--sampling-topk requires --sampling"),
    "--sampling-topp without --sampling": (["--sampling-topp", 0.9], "--sampling-topp requires --sampling"),
    "--prefix-size": (["--prefix-size", 1], "--prefix-size"),
    "--nbest 2": (["--nbest", 2], "--nbest must be 1"),
    "--score-reference": (["--score-reference"], "--score-reference"),
    "--print-alignment": (["--print-alignment"], "--print-alignment"),
    "--blockwise-topk 0": (["--blockwise-topk", 0], "--blockwise-topk must be at least 1"),
    "--blockwise-min-block 0": (["--blockwise-min-block", 0], "--blockwise-min-block must be at least 1"),
    "--blockwise-confidence 1.5": (["--blockwise-confidence", 1.5], "--blockwise-confidence must be between 0 and 1"),
    "--blockwise-proposal-vocab -1": (["--blockwise-proposal-vocab", -1],
                                      "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
    "--blockwise-proposal-vocab 2": (["--blockwise-proposal-vocab", 2],
                                     "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
    "--blockwise-proposal-vocab 10000": (["--blockwise-proposal-vocab", 10000],
                                         "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
}


@pytest.mark.parametrize("request_", BAD_REQUESTS.values(), ids=list(BAD_REQUESTS))
def test_generate_refuses_by_name(tiny, request_):
    args, message = request_
    with pytest.raises(ValueError, match=f"^--blockwise: .*{message}"):
        generate(tiny, "--blockwise", "--batch-size", 8, *args)


def test_refusals_without_heads_and_with_constraints(tiny, headless):
    with pytest.raises(ValueError, match="^--blockwise: the checkpoint has no proposal heads"):
        generate(tiny, "--blockwise", "--batch-size", 8, checkpoint=headless)
    with pytest.raises(ValueError, match="^--blockwise: cannot be combined with --constraints"):
        interactive(tiny, "--blockwise", "--constraints", stdin="s1 s2\tt1\n")


def test_refuses_a_language_model(data_dir):
    """fairseq-generate --lm-path hands its LM to build_generator; blockwise would ignore it."""
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise")
    with pytest.raises(ValueError, match="^--blockwise: cannot be combined with --lm-path"):
        task.build_generator([model], Namespace(beam=1), extra_gen_cls_kwargs={"lm_model": model, "lm_weight": 0.3})


def test_the_command_line_shows_the_refusal_last(tiny):
    """fairseq's own argument checks end the command with a traceback; ours do the same,
    the message naming the flag on the last line."""
    output = run("fairseq-generate", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                 "--path", tiny.checkpoint, "--cpu", "--blockwise", "--beam", 5, fails=True)
    assert output.strip().splitlines()[-1] == (
        "ValueError: --blockwise: decoding is greedy, but --beam 5 was given; use --beam 1 or drop --blockwise"
    )


def test_checkpoint_of_another_dictionary_fails_at_load(tiny, tmp_path):
    for lang in ("de", "en"):  # interactive needs only the dictionaries
        with open(f"{tiny.data}/dict.{lang}.txt") as f:
            (tmp_path / f"dict.{lang}.txt").write_text("".join(f.readlines()[:20]))
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder\.embed_tokens\.weight"):
        interactive(tiny, "--blockwise", stdin="s1 s2\n", data=tmp_path)


def test_interactive_keeps_going_past_empty_and_overlong_lines(tiny, caplog):
    lines = ["s1 s2 s3", "", " ".join(f"s{i}" for i in range(12)), "s4 s5", "s6 s7 s8 s9"]
    source = "\n".join(lines) + "\n"
    read = ["--max-source-positions", 8, "--buffer-size", 2, "--batch-size", 2]
    translations = []
    for decoding in (["--blockwise"], ["--beam", 1]):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            found = hypotheses(interactive(tiny, *read, *decoding, "--skip-invalid-size-inputs-valid-test",
                                           stdin=source))
        assert "1 samples have invalid sizes and will be skipped" in caplog.text
        assert sorted(found) == [0, 1, 3, 4]  # the empty line translated, as fairseq does
        translations.append({i: tokens for i, (_, tokens) in found.items()})
        # Without --skip-invalid-size-inputs-valid-test fairseq stops at the long line, naming it.
        printed = io.StringIO()
        with pytest.raises(Exception, match="Size of sample #0 is invalid .* --skip-invalid-size-inputs-valid-test"):
            interactive(tiny, *read, *decoding, stdin=source, stdout=printed)
        assert sorted(hypotheses(printed.getvalue())) == [0, 1]
    assert translations[0] == translations[1]
