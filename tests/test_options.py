"""BlockwiseOptions: one validated value, its defaults read from the flags' own dataclasses."""
import dataclasses
import json
import logging
from argparse import Namespace

import pytest
from fairseq.dataclass.configs import GenerationConfig

from conftest import build
from test_refusals import generation_args

from fairseq_bpd.adaptive import AdaptiveBlockwiseGenerator
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.generator import BlockwiseGenerator, BlockwiseStats
from fairseq_bpd.options import BlockwiseDecodingConfig, BlockwiseOptions
from fairseq_bpd.sampling import SpeculativeSampler
from fairseq_bpd.task import TranslationBlockwiseConfig
from fairseq_bpd import tree


def test_defaults_are_the_flags_own():
    flags = {f.name: f.default for f in dataclasses.fields(BlockwiseDecodingConfig)}
    generation = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
    options = BlockwiseOptions()
    assert options.block_size is flags["block_size"]
    for name in ("topk", "min_block", "proposal_vocab", "confidence", "distance", "adaptive", "tree"):
        assert getattr(options, name) == flags[f"blockwise_{name}"]
    for name in ("sampling", "sampling_topk", "sampling_topp", "max_len_a", "max_len_b", "min_len",
                 "temperature", "match_source_len", "no_repeat_ngram_size"):
        assert getattr(options, name) == generation[name]
    assert (options.normalize_scores, options.len_penalty, options.unk_penalty) == (
        not generation["unnormalized"], generation["lenpen"], generation["unkpen"])
    # The task's config is TranslationConfig plus these flags, defaults and all.
    assert {f.name for f in dataclasses.fields(TranslationBlockwiseConfig)} >= set(flags)


@pytest.mark.parametrize("args", [Namespace(), generation_args(beam=5, max_len_b=200)])
def test_from_configs_of_defaults_is_the_default(args):
    """A partial Namespace (--eval-bleu-args' JSON) keeps GenerationConfig's defaults; the
    commands' hypotheses carry no attention (nothing of fairseq's reads it)."""
    assert BlockwiseOptions.from_configs(TranslationBlockwiseConfig(), args) == BlockwiseOptions(attention=False)
    assert BlockwiseOptions().attention  # built directly, as fairseq's SequenceGenerator


def test_from_configs_reads_the_task_and_generation_flags(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates": [[0.9, 0.5], [0.4, 0.1]]}))
    cfg = TranslationBlockwiseConfig(block_size=3, blockwise_tree=4, blockwise_tree_rates=str(rates),
                                     blockwise_proposal_vocab=9, blockwise_confidence=0.5)
    args = Namespace(unnormalized=True, lenpen=0.6, unkpen=-2.0, max_len_b=7, temperature=0.7)
    options = BlockwiseOptions.from_configs(cfg, args)
    assert options == BlockwiseOptions(block_size=3, tree=4, tree_rates=((0.9, 0.5), (0.4, 0.1)), proposal_vocab=9,
                                       confidence=0.5, normalize_scores=False, len_penalty=0.6, unk_penalty=-2.0,
                                       max_len_b=7, temperature=0.7, attention=False)
    assert options.tree_rates == ((0.9, 0.5), (0.4, 0.1))  # the path, loaded
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.topk = 2


@pytest.mark.parametrize("fields,message", [
    ({"temperature": 0.0}, "--temperature must be greater than 0"),
    ({"min_block": 0}, "--blockwise-min-block must be at least 1"),
    ({"distance": 1.0, "tree": 4}, "--blockwise-distance cannot be combined"),
    ({"sampling": True, "topk": 2}, "--blockwise-topk must be 1 with --sampling"),
    ({"sampling_topp": 0.5}, "--sampling-topp requires --sampling"),
    ({"adaptive": True, "tree": 4}, "--blockwise-adaptive chooses the width of a greedy chain; drop --blockwise-tree"),
    ({"tree": -1}, "--blockwise-tree must be between 0"),
    ({"tree_rates": "rates.json"}, "--blockwise-tree-rates shapes a tree"),
    ({"tree": 4, "tree_rates": [[2.0]] * 3}, "tree_rates must be a heads x ranks table of rates in \\[0, 1\\]"),
    ({"tree": 4, "tree_rates": [[float("nan")]] * 3}, "tree_rates must be a heads x ranks table"),
    ({"tree": 4, "tree_rates": []}, "tree_rates must be a heads x ranks table"),
])
def test_options_refuse_when_built(fields, message):
    with pytest.raises(BlockwiseRequestError, match=f"^--blockwise: {message}"):
        BlockwiseOptions(**fields)


@pytest.mark.parametrize("fields", [
    {"block_size": "3"}, {"block_size": 2.5}, {"block_size": True}, {"min_block": "2"}, {"tree": 2.5},
    {"confidence": "0.3"}, {"adaptive": 1}, {"max_len_b": None}, {"widths": 5},
])
def test_a_field_of_the_wrong_kind_is_refused_by_name(fields):
    """From Python a count given as a string, a float or a bool would raise a bare TypeError later or
    pass silently (True as a block of one); the refusal names the field, also through replace()."""
    (name, value), = fields.items()
    message = f"^--blockwise: BlockwiseOptions.{name} must be "
    with pytest.raises(BlockwiseRequestError, match=message):
        BlockwiseOptions(**fields)
    with pytest.raises(BlockwiseRequestError, match=message):
        BlockwiseOptions().replace(**fields)
    assert BlockwiseOptions(block_size=3, confidence=1, max_len_a=1).block_size == 3  # ints are numbers


def test_the_options_build_the_generator_they_ask_for(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4")
    d, stats = task.target_dictionary, BlockwiseStats()
    plain = BlockwiseOptions(block_size=3).generator(model, d, stats)
    assert type(plain) is BlockwiseGenerator and plain.block_size == 3 and plain.stats is stats
    assert type(BlockwiseOptions().generator(model, d)).__name__ == "BlockwiseGenerator"
    assert BlockwiseOptions().generator(model, d).block_size == 4  # None: the checkpoint's k
    assert isinstance(BlockwiseOptions(adaptive=True).generator(model, d, explore_every=0), AdaptiveBlockwiseGenerator)
    assert isinstance(BlockwiseOptions(sampling=True).generator(model, d), SpeculativeSampler)
    # The fields as keywords build the same options; the class decodes only its own kind.
    assert BlockwiseGenerator(model, d, block_size=3, tree=4).options == BlockwiseOptions(block_size=3, tree=4)
    with pytest.raises(TypeError, match="options.generator"):
        BlockwiseGenerator(model, d, BlockwiseOptions(sampling=True))


@pytest.mark.parametrize("block_size,where", [(3, "--block-size 3"), (None, "the checkpoint's 4 heads")])
def test_a_min_block_larger_than_the_block_is_refused_by_name(data_dir, block_size, where):
    task, model, _ = build(data_dir, "--block-size", "4")
    width = block_size or 4
    options = BlockwiseOptions(block_size=block_size, min_block=width)  # the whole block: allowed
    assert options.generator(model, task.target_dictionary).rule.min_block == width
    message = f"^--blockwise: --blockwise-min-block {width + 1} is larger than the block: .* {width} \\({where}\\)"
    with pytest.raises(BlockwiseRequestError, match=message):
        options.replace(min_block=width + 1).generator(model, task.target_dictionary)


def test_blockwise_flags_without_blockwise_are_named_in_one_warning(data_dir, caplog):
    task, model, _ = build(data_dir, "--block-size", "4", "--blockwise-topk", "2", "--blockwise-tree", "8")
    with caplog.at_level(logging.WARNING, logger="fairseq_bpd.task"):
        for _ in range(2):
            task.build_generator([model], generation_args(beam=1))
    warnings = [r.getMessage() for r in caplog.records if "without --blockwise" in r.getMessage()]
    assert warnings == ["--blockwise-topk, --blockwise-tree given without --blockwise: ignored "
                        "(fairseq's own search decodes)"]
    task, model, _ = build(data_dir, "--block-size", "4")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fairseq_bpd.task"):
        task.build_generator([model], generation_args(beam=1))
    assert not [r for r in caplog.records if "without --blockwise" in r.getMessage()]


def test_a_tree_shaped_by_rates_of_other_proposals_is_warned_of(data_dir, tmp_path, caplog, monkeypatch):
    """scripts/tree_rates.py records what its rates were measured over; a tree shaped by
    rates of other proposals (another shortlist, a lexicon or none) is exact but may not be
    the fastest, and the generator says so once, naming both. 0 and the dictionary's size
    both mean the whole dictionary."""
    monkeypatch.setattr(tree, "WARNED", set())
    task, model, _ = build(data_dir, "--block-size", "4")  # proposals over the whole dictionary
    rates, size = tmp_path / "rates.json", len(task.target_dictionary)

    def warnings(decoding_vocab=0, **measured):
        rates.write_text(json.dumps({"rates": [[0.9, 0.5]] * 3, **measured}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fairseq_bpd.tree"):
            options = BlockwiseOptions(tree=4, tree_rates=str(rates), proposal_vocab=decoding_vocab)
            options.generator(model, task.target_dictionary)
        return [r.getMessage() for r in caplog.records if "--blockwise-tree-rates" in r.getMessage()]

    assert warnings(proposal_vocab=0, proposal_lexicon=None) == []
    assert warnings(proposal_vocab=size, proposal_lexicon=None) == []  # the whole dictionary, written out
    assert warnings(size, proposal_vocab=0, proposal_lexicon=None) == []
    assert warnings() == []  # a file that does not say
    [shortlist] = warnings(proposal_vocab=6, proposal_lexicon=None)
    assert ("measured over the dictionary's first 6 entries; this decoding proposes over the whole dictionary: "
            "the tree stays exact") in shortlist
    assert warnings(proposal_vocab=6, proposal_lexicon=None) == []  # said once
    [lexicon] = warnings(proposal_vocab=0, proposal_lexicon="lexicon.json")
    assert "over the whole dictionary and a proposal lexicon; this decoding proposes over the whole dictionary:" in lexicon
    assert "--blockwise-proposal-lexicon" in lexicon
    assert BlockwiseOptions(tree=4, tree_rates=str(rates)).tree_rates_over == (0, True)
    assert BlockwiseOptions(tree=4, tree_rates=((0.9, 0.5),) * 3).tree_rates_over is None
    rates.write_text(json.dumps({"rates": [[0.9, 0.5]] * 3, "proposal_vocab": 0, "proposal_lexicon": ""}))
    assert BlockwiseOptions(tree=4, tree_rates=str(rates)).tree_rates_over == (0, False)


def test_a_rates_file_is_read_once(tmp_path, monkeypatch):
    """--blockwise-tree-rates <(...) is a pipe: it can be read once, rates and all."""
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates": [[0.9, 0.5]] * 3, "proposal_vocab": 6, "proposal_lexicon": None}))
    opened, real_open = [], open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    options = BlockwiseOptions(tree=4, tree_rates=str(rates))
    assert (options.tree_rates, options.tree_rates_over) == (((0.9, 0.5),) * 3, (6, False))
    assert opened.count(str(rates)) == 1
