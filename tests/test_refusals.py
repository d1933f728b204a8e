"""Every generation option fairseq defines keeps its meaning under --blockwise, or is refused by name."""
import dataclasses
import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from fairseq import options
from fairseq.dataclass.configs import GenerationConfig
from fairseq.ngram_repeat_block import NGramRepeatBlock
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationTask

from conftest import PLUGIN, build, random_sample, write_dicts
from test_generator import Oracle, assert_same, blockwise, greedy

from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.sampling import SpeculativeSampler

FIELDS = [f.name for f in dataclasses.fields(GenerationConfig) if not f.name.startswith("_")]
HONOURED = None
SAMPLED = "speculative sampling"  # its distribution is fairseq's: tests/test_sampling.py

# Each GenerationConfig field: values other than its default, each HONOURED (tokens and
# scores identical to fairseq's --beam 1), SAMPLED (fairseq's sampling distribution) or
# refused with a message naming the flag.
SWEEP = {
    "beam": [(1, HONOURED), (0, "--beam 0 was given"), (4, "--beam 4 was given"),
             (5, "--beam 5 was given")],  # 5: fairseq's default, but given
    "nbest": [(2, "--nbest must be 1")],
    "max_len_a": [(0.5, HONOURED)],
    "max_len_b": [(3, HONOURED)],
    "min_len": [(6, HONOURED)],
    "match_source_len": [(True, HONOURED)],
    "unnormalized": [(True, HONOURED)],
    "lenpen": [(0.6, HONOURED)],
    "unkpen": [(-3.0, HONOURED)],
    "no_repeat_ngram_size": [(2, HONOURED)],
    "temperature": [(0.7, HONOURED), (0.0, "--temperature must be greater than 0")],
    "sampling": [(True, SAMPLED)],
    "sampling_topk": [(5, "--sampling-topk requires --sampling")],  # fairseq refuses it alone
    "sampling_topp": [(0.5, "--sampling-topp requires --sampling")],
    "diverse_beam_groups": [(2, "--diverse-beam-groups")],
    "diversity_rate": [(-0.5, "--diversity-rate"), (0.0, "--diversity-rate"), (0.5, "--diversity-rate")],
    "prefix_size": [(1, "--prefix-size")],
    "constraints": [("ordered", "--constraints")],
    "score_reference": [(True, "--score-reference")],
    "print_alignment": [("hard", "--print-alignment")],
    "lm_path": [("lm.pt", "--lm-path")],
    "retain_dropout": [(True, "--retain-dropout")],
    # Read by fairseq-generate around the generator, the same for both: printing,
    # scoring, post-processing, seeding.
    "print_step": [(True, HONOURED)],
    "replace_unk": [("", HONOURED)],
    "sacrebleu": [(True, HONOURED)],
    "no_seed_provided": [(True, HONOURED)],
    # Read only with a flag that is refused above.
    "diverse_beam_strength": [(0.9, HONOURED)],
    "lm_weight": [(0.3, HONOURED)],
    "retain_dropout_modules": [(["TransformerDecoderLayer"], HONOURED)],
    # Other tasks' generators (multilingual second pass, iterative refinement, speech);
    # fairseq's SequenceGenerator ignores them, and so does blockwise decoding.
    "beam_mt": [(4, HONOURED)],
    "max_len_a_mt": [(0.5, HONOURED)],
    "max_len_b_mt": [(3, HONOURED)],
    "lenpen_mt": [(0.6, HONOURED)],
    "no_early_stop": [(True, HONOURED)],
    "no_beamable_mm": [(True, HONOURED)],
    "iter_decode_eos_penalty": [(0.5, HONOURED)],
    "iter_decode_max_iter": [(3, HONOURED)],
    "iter_decode_force_max_iter": [(True, HONOURED)],
    "iter_decode_with_beam": [(2, HONOURED)],
    "iter_decode_with_external_reranker": [(True, HONOURED)],
    "retain_iter_history": [(True, HONOURED)],
    "decoding_format": [("unigram", HONOURED)],
    "eos_token": [("</s>", HONOURED)],
}
CASES = [(name, value, refusal) for name, values in SWEEP.items() for value, refusal in values]


def test_the_sweep_covers_every_generation_field():
    """A field fairseq adds fails here until it is classified below."""
    assert sorted(SWEEP) == sorted(FIELDS)
    defaults = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
    assert all(value != defaults[name] for name, value, _ in CASES if name != "beam")


def generation_args(**override):
    """GenerationConfig's defaults as fairseq-generate passes them, at --beam 1 and a short max_len_b."""
    args = {f.name: f.default for f in dataclasses.fields(GenerationConfig) if not f.name.startswith("_")}
    return Namespace(**{**args, "beam": 1, "max_len_b": 20, **override})


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """The tests' tiny seeded float64 model under --blockwise, and a batch of 5 sentences."""
    data = write_dicts(str(tmp_path_factory.mktemp("data")))
    task, model, _ = build(data, "--block-size", "4", "--blockwise", seed=2)
    return task, model, random_sample(task, bsz=5, seed=11)


@pytest.mark.parametrize("name,value,refusal", CASES, ids=[f"{n}={v}" for n, v, _ in CASES])
def test_every_generation_field_is_honoured_or_refused(seeded, name, value, refusal):
    task, model, sample = seeded
    args = generation_args(**{name: value})
    if refusal is SAMPLED:
        assert isinstance(task.build_generator([model], args), SpeculativeSampler)
        return
    if refusal is not HONOURED:
        with pytest.raises(BlockwiseRequestError, match=f"^--blockwise: .*{refusal}"):
            task.build_generator([model], args)
        return
    stock = TranslationTask.build_generator(task, [model], generation_args(**{name: value, "beam": 1}))
    expected = [h[0] for h in stock.generate([model], sample)]
    generator = task.build_generator([model], args)
    assert_same(expected, generator.generate([model], sample), attention=False)  # the task built it


def test_match_source_len_gives_every_output_its_source_length(seeded):
    task, model, sample = seeded
    lengths = sample["net_input"]["src_lengths"].tolist()
    expected = greedy(model, task, sample)
    assert [len(e["tokens"]) - 1 for e in expected] != lengths  # the constraint bites
    constrained = TranslationTask.build_generator(task, [model], generation_args(match_source_len=True))
    expected = [h[0] for h in constrained.generate([model], sample)]
    assert [len(e["tokens"]) - 1 for e in expected] == lengths  # then EOS
    for agree in (True, False):
        hypos, _ = blockwise(model, task, sample, 4, Oracle, references=[e["tokens"] for e in expected],
                             agree=agree, match_source_len=True)
        assert_same(expected, hypos)


class PrefixBlocker(NGramRepeatBlock):
    """fairseq's n-gram blocker reading BOS and the generated tokens only, as its CUDA kernel does.

    On the CPU fairseq's own blocker compares the last entries of the whole padded
    token row, which are padding while decoding: it never blocks, in greedy or blockwise.
    """

    def forward(self, tokens, lprobs, bsz, beam_size, step):
        return self._no_repeat_ngram(tokens[:, : step + 1], lprobs, bsz, beam_size, step)


def repeats(tokens, n):
    ngrams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(ngrams) != len(set(ngrams))


def test_no_repeat_ngram_blocking_that_bites_gives_greedy_output(seeded):
    task, model, sample = seeded
    plain = greedy(model, task, sample)
    assert any(repeats(e["tokens"].tolist(), 2) for e in plain), "the seeded model should repeat itself"
    stock = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_b=20, no_repeat_ngram_size=2)
    assert_same(plain, stock.generate([model], sample))  # fairseq's CPU blocker blocks nothing
    stock.repeat_ngram_blocker = PrefixBlocker(2, use_extension=False)
    expected = [h[0] for h in stock.generate([model], sample)]
    assert not any(repeats(e["tokens"].tolist(), 2) for e in expected)
    assert [e["tokens"].tolist() for e in expected] != [e["tokens"].tolist() for e in plain]

    class Blocked(Oracle):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.repeat_ngram_blocker = PrefixBlocker(2, use_extension=False)

    references = [e["tokens"] for e in expected]
    for agree in (True, False, lambda s: s % 2 == 0):
        hypos, _ = blockwise(model, task, sample, 4, Blocked, references=references, agree=agree,
                             no_repeat_ngram_size=2)
        assert_same(expected, hypos)


def test_a_beam_is_a_request_only_when_given(seeded):
    """--eval-bleu-args hands build_generator a Namespace of the JSON's keys alone."""
    task, model, _ = seeded
    args = Namespace(**json.loads("{}"))
    assert task.build_generator([model], args).block_size == 4
    assert args.beam == 1  # what fairseq-generate prints
    for beam in (5, 2):
        with pytest.raises(BlockwiseRequestError, match=f"--beam {beam} was given"):
            task.build_generator([model], Namespace(**json.loads(f'{{"beam": {beam}}}')))


def test_task_options_in_eval_bleu_args_are_refused(seeded):
    """fairseq hands --eval-bleu-args' JSON to build_generator as generation options."""
    task, model, _ = seeded
    assert task.build_generator([model], Namespace(**json.loads('{"block_size": 4, "blockwise": true}')))
    for options, name in (('{"blockwise_topk": 2}', "blockwise_topk"), ('{"block_size": 2}', "block_size")):
        with pytest.raises(BlockwiseRequestError, match=f"^{name} is an option of the task, not of generation"):
            task.build_generator([model], Namespace(**json.loads(options)))


def parse_generation(data_dir, *flags, parser=options.get_generation_parser):
    return options.parse_args_and_arch(parser(), [data_dir, "--user-dir", PLUGIN, "--task", "translation_blockwise", *flags])


@pytest.mark.parametrize("parser", [options.get_generation_parser, options.get_interactive_generation_parser])
def test_only_blockwise_changes_the_parsed_beam(data_dir, parser):
    """Without --blockwise, fairseq's 5, as stock: fairseq-generate's and -interactive's own checks
    (--sampling needs --nbest equal to --beam) read it before any task code runs."""
    assert parse_generation(data_dir, parser=parser).beam == GenerationConfig.beam
    assert parse_generation(data_dir, "--sampling", "--nbest", "5", parser=parser).beam == 5
    assert parse_generation(data_dir, "--beam", "0", parser=parser).beam == 0  # as typed, as stock
    assert parse_generation(data_dir, "--blockwise", parser=parser).beam == 1
    for typed in (["--beam", "5", "--blockwise"], ["--blockwise", "--beam", "5"], ["--beam=5", "--blockwise"]):
        assert parse_generation(data_dir, *typed, parser=parser).beam == 5, typed
    assert parse_generation(data_dir, "--beam", "1", "--blockwise", parser=parser).beam == 1


def test_blockwise_topk_must_stay_below_the_vocabulary(seeded):
    task, model, sample = seeded
    size = len(task.target_dictionary)
    task.cfg.blockwise_topk = size - 1  # accepts every finite proposal: still runs
    try:
        task.build_generator([model], generation_args()).generate([model], sample)
        for topk in (size, size + 5, 0):
            task.cfg.blockwise_topk = topk
            with pytest.raises(BlockwiseRequestError, match=f"--blockwise-topk must be between 1 and {size - 1}"):
                task.build_generator([model], generation_args())
    finally:
        task.cfg.blockwise_topk = 1


def test_cross_self_attention_models_are_refused(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", "--cross-self-attention")
    with pytest.raises(BlockwiseRequestError, match="^--blockwise: cannot decode a --cross-self-attention model"):
        task.build_generator([model], generation_args())


def test_adaptive_softmax_is_refused_when_the_model_is_built(data_dir):
    """At training, and at loading a checkpoint: both build the model."""
    with pytest.raises(BlockwiseRequestError, match="^--adaptive-softmax-cutoff: the proposal heads need"):
        build(data_dir, "--block-size", "3", "--adaptive-softmax-cutoff", "10")


def test_generator_refusals_are_of_the_one_class(seeded):
    task, model, sample = seeded
    generator = task.build_generator([model], generation_args())
    with pytest.raises(BlockwiseRequestError, match="^--blockwise: cannot decode with a prefix"):
        generator.generate([model], sample, prefix_tokens=torch.ones(5, 1, dtype=torch.long))
    assert issubclass(BlockwiseRequestError, ValueError)  # callers catching ValueError keep working


# What fairseq's console scripts (fairseq-generate, ...) run before the plugin is imported.
AS_FAIRSEQ_COMMAND = "from fairseq_cli.generate import cli_main\n"
PROGRAM = AS_FAIRSEQ_COMMAND + """
import fairseq_bpd
from fairseq_bpd.errors import BlockwiseRequestError
try:
    {}["checkpoint"]
except KeyError:
    raise BlockwiseRequestError("--blockwise: %s")
"""
REFUSAL = "import fairseq_bpd\nfrom fairseq_bpd.errors import BlockwiseRequestError\n" \
    "raise BlockwiseRequestError('--blockwise: refused')\n"


@pytest.mark.parametrize("while_failing", [False, True])
def test_only_a_refusal_that_is_the_whole_story_loses_its_traceback(while_failing):
    """A refusal raised while handling another error shows both, as Python does: the other is news."""
    program = PROGRAM % "refused" if while_failing else AS_FAIRSEQ_COMMAND + REFUSAL
    process = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.path.dirname(PLUGIN)})
    assert process.returncode == 1
    if while_failing:
        assert "KeyError: 'checkpoint'" in process.stderr and process.stderr.rstrip().endswith(
            "BlockwiseRequestError: --blockwise: refused")
    else:
        assert "Traceback" not in process.stderr and process.stderr.splitlines()[-1] == "error: --blockwise: refused"


def test_a_program_that_only_imports_the_plugin_keeps_pythons_traceback():
    """The one-line refusal is for fairseq's commands: importing the plugin changes no other program's hook."""
    program = "import sys\nhook = sys.excepthook\n" + REFUSAL.replace("raise", "assert sys.excepthook is hook\nraise")
    process = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.path.dirname(PLUGIN)})
    assert process.returncode == 1
    assert "Traceback (most recent call last)" in process.stderr and process.stderr.rstrip().endswith(
        "BlockwiseRequestError: --blockwise: refused"), process.stderr
