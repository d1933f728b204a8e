"""Nothing dropped, and bad requests refused by name, through fairseq's CLIs.

Most runs call a CLI's entry point (cli_main, with sys.argv set) in this process: the
same code as the command, without the 3 s interpreter start-up each. A few run as real
commands to show what a user sees.
"""
import contextlib
import importlib
import io
import logging
import os
import subprocess
import sys
from argparse import Namespace
from unittest import mock

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import build
from cli_support import BIN, ENV, PLUGIN, TEST_SUBSETS, assert_same_hypotheses, hypotheses, run, trained

from fairseq_bpd.errors import BlockwiseRequestError

SIZES = {n: subset for subset, n in TEST_SUBSETS.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


def cli_main(tool, *args, stdin=""):
    """fairseq-<tool>'s entry point in this process, as the command would run it: its stdout."""
    module = importlib.import_module(f"fairseq_cli.{tool}")  # imported late: it configures logging
    stdout = io.StringIO()
    argv = [f"fairseq-{tool}", *map(str, args)]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "stdin", io.StringIO(stdin)):
        with contextlib.redirect_stdout(stdout):
            module.cli_main()
    return stdout.getvalue()


def generate(tiny, *args, checkpoint=None):
    # No data-loading worker: each run's worker would make the next run wait 5 s to join it.
    return cli_main("generate", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                    "--path", checkpoint or tiny.checkpoint, "--cpu", "--num-workers", 0, *args)


def interactive(tiny, *args, stdin, data=None, checkpoint=None):
    return cli_main("interactive", data or tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                    "--path", checkpoint or tiny.checkpoint, "--cpu", "--source-lang", "de",
                    "--target-lang", "en", *args, stdin=stdin)


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
    "--sampling --match-source-len": (["--sampling", "--beam", 1, "--match-source-len"],
                                      "--match-source-len cannot be combined with --sampling"),
    "--sampling --beam 2": (["--sampling", "--beam", 2, "--nbest", 2],
                            "speculative sampling draws one sample, but --beam 2 was given"),
    "--sampling-topk without --sampling": (["--sampling-topk", 5], "--sampling-topk requires --sampling"),
    "--sampling-topp without --sampling": (["--sampling-topp", 0.9], "--sampling-topp requires --sampling"),
    "--prefix-size": (["--prefix-size", 1], "--prefix-size"),
    "--nbest 2": (["--nbest", 2], "--nbest must be 1"),
    "--score-reference": (["--score-reference"], "--score-reference"),
    "--print-alignment": (["--print-alignment"], "--print-alignment"),
    "--blockwise-topk 0": (["--blockwise-topk", 0], "--blockwise-topk must be between 1 and 47"),
    "--blockwise-min-block 0": (["--blockwise-min-block", 0], "--blockwise-min-block must be at least 1"),
    "--blockwise-confidence 1.5": (["--blockwise-confidence", 1.5], "--blockwise-confidence must be between 0 and 1"),
    "--blockwise-proposal-vocab -1": (["--blockwise-proposal-vocab", -1],
                                      "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
    "--blockwise-proposal-vocab 2": (["--blockwise-proposal-vocab", 2],
                                     "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
    "--blockwise-proposal-vocab 10000": (["--blockwise-proposal-vocab", 10000],
                                         "--blockwise-proposal-vocab must be 0 \\(all\\) or between 5"),
    "--blockwise-topk 48": (["--blockwise-topk", 48], "--blockwise-topk must be between 1 and 47"),
    "--diversity-rate -0.5": (["--diversity-rate", -0.5], "--diversity-rate"),
    "--diverse-beam-groups 2": (["--diverse-beam-groups", 2], "--diverse-beam-groups"),
    "--retain-dropout": (["--retain-dropout"], "--retain-dropout"),
    "--temperature 0": (["--temperature", 0], "--temperature must be greater than 0"),
}


@pytest.mark.parametrize("request_", BAD_REQUESTS.values(), ids=list(BAD_REQUESTS))
def test_generate_refuses_by_name(tiny, request_):
    args, message = request_
    with pytest.raises(BlockwiseRequestError, match=f"^--blockwise: .*{message}"):
        generate(tiny, "--blockwise", "--batch-size", 8, *args)


def test_refusals_without_heads_and_with_constraints(tiny, headless):
    with pytest.raises(BlockwiseRequestError, match="^--blockwise: the checkpoint has no proposal heads"):
        generate(tiny, "--blockwise", "--batch-size", 8, checkpoint=headless)
    with pytest.raises(BlockwiseRequestError, match="^--blockwise: cannot be combined with --constraints"):
        interactive(tiny, "--blockwise", "--constraints", stdin="s1 s2\tt1\n")


def test_refuses_a_language_model(data_dir):
    """fairseq-generate --lm-path hands its LM to build_generator; blockwise would ignore it."""
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise")
    with pytest.raises(BlockwiseRequestError, match="^--blockwise: cannot be combined with --lm-path"):
        task.build_generator([model], Namespace(beam=1), extra_gen_cls_kwargs={"lm_model": model, "lm_weight": 0.3})


def refused(tool, *args, stdin=None):
    """Run a fairseq command that must refuse: the refusal, its stderr's last line."""
    process = subprocess.run([os.path.join(BIN, tool), *map(str, args)], input=stdin, capture_output=True,
                             text=True, env=ENV, timeout=300)
    output = process.stdout + process.stderr
    assert process.returncode != 0 and "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [process.stderr.splitlines()[-1]], output[-3000:]
    return errors[0]


def test_commands_print_a_refusal_on_one_line(tiny):
    """fairseq-generate and -interactive end with `error: --blockwise: ...`, not a traceback."""
    decode = ["--user-dir", PLUGIN, "--task", "translation_blockwise", "--path", tiny.checkpoint, "--cpu",
              "--blockwise"]
    assert refused("fairseq-generate", tiny.data, *decode, "--beam", 5) == (
        "error: --blockwise: decoding is greedy, but --beam 5 was given; use --beam 1 (from the hub: "
        "translate(..., beam=1)) or drop --blockwise"
    )
    assert refused("fairseq-interactive", tiny.data, *decode, "--diversity-rate", -0.5,
                   "--source-lang", "de", "--target-lang", "en", stdin="s1 s2\n").startswith(
        "error: --blockwise: cannot be combined with --diversity-rate"
    )


def test_unreadable_tree_rates_and_a_distance_without_numbers_are_one_line_refusals(tiny, tmp_path):
    """Refusals made while another error is handled (a bad rates file, a dictionary of
    words under --blockwise-distance) still print one line, not two chained tracebacks."""
    decode = ["--user-dir", PLUGIN, "--task", "translation_blockwise", "--path", tiny.checkpoint, "--cpu",
              "--blockwise", "--gen-subset", "valid"]
    bad = tmp_path / "rates.json"
    bad.write_text("{bad")
    assert refused("fairseq-generate", tiny.data, *decode, "--blockwise-tree", 2, "--blockwise-tree-rates",
                   bad).startswith(f"error: --blockwise: --blockwise-tree-rates: {bad} is not JSON (")
    assert refused("fairseq-generate", tiny.data, *decode, "--blockwise-distance", 1).startswith(
        "error: --blockwise: --blockwise-distance 1.0 needs a target dictionary of numbers")


def test_training_refuses_an_adaptive_softmax_on_one_line(tiny, tmp_path):
    assert refused("fairseq-train", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
                   "--arch", "transformer_blockwise", "--block-size", 2, "--adaptive-softmax-cutoff", 20,
                   "--criterion", "blockwise_cross_entropy", "--cpu", "--max-update", 1, "--max-tokens", 500,
                   "--save-dir", tmp_path).startswith("error: --adaptive-softmax-cutoff: ")


def test_a_beam_not_given_is_fairseqs_5_without_blockwise(tiny):
    output = generate(tiny, "--batch-size", 8)
    assert "Generate test with beam=5:" in output and len(hypotheses(output)) == 20


def test_sampling_without_a_beam_is_stocks_without_blockwise(tiny):
    """fairseq checks --nbest against --beam before any task code: the task leaves its 5 alone."""
    sampling = ["--gen-subset", SIZES[5], "--sampling", "--nbest", 5, "--batch-size", 8]
    expected = cli_main("generate", tiny.data, "--user-dir", PLUGIN, "--task", "translation", "--path",
                        tiny.checkpoint, "--cpu", "--num-workers", 0, "--required-batch-size-multiple", 1,
                        *sampling)
    output = generate(tiny, *sampling)
    assert output.count("\nH-") == 25 and "Generate test1 with beam=5:" in output
    assert [line for line in output.splitlines() if line[:2] in ("H-", "P-")] == [
        line for line in expected.splitlines() if line[:2] in ("H-", "P-")
    ]


def test_checkpoint_of_another_dictionary_fails_at_load(tiny, tmp_path):
    for lang in ("de", "en"):  # interactive needs only the dictionaries
        with open(f"{tiny.data}/dict.{lang}.txt") as f:
            (tmp_path / f"dict.{lang}.txt").write_text("".join(f.readlines()[:20]))
    with pytest.raises(RuntimeError, match=r"size mismatch for encoder\.embed_tokens\.weight"):
        interactive(tiny, "--blockwise", stdin="s1 s2\n", data=tmp_path)


def test_interactive_skips_an_overlong_line_naming_it_and_translates_the_rest(tiny, caplog):
    long_line = " ".join(f"s{i}" for i in range(12))
    lines = ["s1 s2 s3", "", long_line, "s4 s5", "s6 s7 s8 s9"]
    source = "\n".join(lines) + "\n"
    read = ["--max-source-positions", 8, "--buffer-size", 2, "--batch-size", 2]
    translations = []
    for decoding in (["--blockwise"], ["--beam", 1]):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            found = hypotheses(interactive(tiny, *read, *decoding, stdin=source))
        assert ("skipped an input of 13 tokens, more than the model's 8 source positions "
                "(--truncate-source cuts it instead): s0 s1 s2 s3 s4 s5 s6 s7 s8 s9 ...") in caplog.text
        assert sorted(found) == [0, 1, 3, 4]  # the empty line translated, as fairseq does
        translations.append({i: tokens for i, (_, tokens) in found.items()})
        # --truncate-source translates its first 7 words (and EOS) instead.
        truncated = hypotheses(interactive(tiny, *read, *decoding, "--truncate-source", stdin=source))
        assert sorted(truncated) == [0, 1, 2, 3, 4]
        cut = hypotheses(interactive(tiny, *decoding, stdin=" ".join(long_line.split()[:7]) + "\n"))
        assert truncated[2][1] == cut[0][1]
    assert translations[0] == translations[1]


def test_generate_skips_overlong_sentences_naming_them(tiny, caplog):
    with open(f"{tiny.raw}/test.de") as f:
        sources = f.read().splitlines()
    fits = [i for i, line in enumerate(sources) if len(line.split()) + 1 <= 6]
    assert 0 < len(fits) < len(sources)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        found = hypotheses(generate(tiny, "--blockwise", "--max-source-positions", 6, "--batch-size", 8))
    assert sorted(found) == fits
    for i, line in enumerate(sources):
        assert (f"source positions (--truncate-source cuts it instead): {line}\n" in caplog.text + "\n") == (
            i not in fits
        )


def test_a_subset_with_every_input_too_long_is_refused_on_one_line(tiny):
    """Nothing left to translate or score: fairseq's summaries would divide by zero."""
    common = ["--user-dir", PLUGIN, "--task", "translation_blockwise", "--path", tiny.checkpoint, "--cpu",
              "--max-source-positions", 2]
    message = ("error: --max-source-positions/--max-target-positions: every one of the 5 sentences of 'test1' "
               "is too long for the model (see the warnings above); --truncate-source cuts long sources instead")
    assert refused("fairseq-generate", tiny.data, *common, "--blockwise", "--gen-subset", SIZES[5]) == message
    assert refused("fairseq-generate", tiny.data, *common, "--blockwise", "--gen-subset", SIZES[5],
                   "--skip-invalid-size-inputs-valid-test") == message  # fairseq's skipping, its warning
    assert refused("fairseq-validate", tiny.data, *common, "--valid-subset", SIZES[5], "--batch-size", 4) == message


def test_the_hub_keeps_fairseqs_error_for_an_overlong_input(tiny):
    """It returns one output per input: skipping would shift the others."""
    from fairseq_bpd.model import BlockwiseTransformerModel

    hub = BlockwiseTransformerModel.from_pretrained(
        tiny.save_dir, checkpoint_file="checkpoint_last.pt", data_name_or_path=tiny.data, user_dir=PLUGIN,
        task="translation_blockwise", blockwise=True, max_source_positions=8,
    )
    with pytest.raises(Exception, match="Size of sample #1 is invalid"):
        hub.translate(["s1 s2", " ".join(f"s{i}" for i in range(12))])


@pytest.mark.parametrize("option", [["--match-source-len"], ["--min-len", 4, "--lenpen", 0.5],
                                    ["--unkpen", -2, "--temperature", 0.7]])
def test_generate_keeps_fairseqs_greedy_options(tiny, option):
    expected = hypotheses(generate(tiny, "--beam", 1, "--batch-size", 8, *option))
    assert_same_hypotheses(expected, hypotheses(generate(tiny, "--blockwise", "--batch-size", 8, *option)))


def test_match_source_len_through_the_hub(tiny):
    from fairseq_bpd.model import BlockwiseTransformerModel

    def load(**overrides):
        return BlockwiseTransformerModel.from_pretrained(
            tiny.save_dir, checkpoint_file="checkpoint_last.pt", data_name_or_path=tiny.data,
            user_dir=PLUGIN, **overrides,
        )

    sentences = ["s1 s2 s3 s4", "s5 s6", "s7 s8 s9 s10 s11 s12"]
    greedy = load().translate(sentences, beam=1, match_source_len=True)
    assert [len(t.split()) for t in greedy] == [5, 3, 7]  # the source's words and EOS
    assert load(task="translation_blockwise", blockwise=True).translate(sentences, match_source_len=True) == greedy


def test_the_hubs_task_options_are_set_when_loading_and_refused_per_call(tiny):
    """--block-size names the heads in the model's options and the block in the task's: loading
    sets the task's. translate()'s keyword arguments reach fairseq's generation options only,
    where a task option would be ignored."""
    from fairseq_bpd.model import BlockwiseTransformerModel

    def load(**overrides):
        return BlockwiseTransformerModel.from_pretrained(
            tiny.save_dir, checkpoint_file="checkpoint_last.pt", data_name_or_path=tiny.data,
            user_dir=PLUGIN, task="translation_blockwise", **overrides,
        )

    sentences = ["s1 s2 s3 s4", "s5 s6", "s7 s8 s9 s10 s11 s12"]
    greedy = load().translate(sentences, beam=1)
    hub = load(blockwise=True, block_size=2)
    assert hub.models[0].decoder.block_size == 3 and hub.task.build_generator(hub.models, Namespace()).block_size == 2
    assert hub.translate(sentences) == greedy
    assert hub.translate(sentences, block_size=2, blockwise=True) == greedy  # the task's own values
    for hub_, option in ((hub, {"block_size": 3}), (hub, {"blockwise_topk": 2}), (load(), {"blockwise": True})):
        name = next(iter(option))
        with pytest.raises(BlockwiseRequestError, match=f"^{name} is an option of the task, not of generation"):
            hub_.translate(sentences, **option)
    with pytest.raises(BlockwiseRequestError, match="--block-size must be between 1 and the checkpoint's 3"):
        load(blockwise=True, block_size=4).translate(sentences)
