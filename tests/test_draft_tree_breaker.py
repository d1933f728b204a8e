"""--head-type draft with --blockwise-tree pushed at its edges: many tree shapes and batch
sizes, sentences leaving mid-tree, the draft's cache growing, relaxed acceptance rules, a
generator reused, the hub and fairseq-interactive, other dtypes and bad input. Output
equal to greedy's cannot tell a wrong draft from a right one (the base verifies every
node), so the trees are also checked node by node against the teacher-forced draft."""
import copy
import os
import random

import pytest
import torch

from conftest import PLUGIN, random_sample
from test_draft import draft, random_draft, teacher_forced
from test_draft_tree import WatchedTree, assert_nodes_teacher_forced
from test_generator import assert_same, blockwise, greedy

from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.options import BlockwiseOptions
from fairseq_bpd.tree import Tree, default_rates


def eos_biased(data_dir, k, seed, bias):
    """A random k-head draft model whose greedy output ends sooner the larger `bias` (on EOS)."""
    task, model = random_draft(data_dir, k, seed)
    eos = task.target_dictionary.eos()
    if bias:
        model.decoder.output_projection.register_forward_hook(
            lambda module, inputs, out: out + bias * (torch.arange(out.size(-1)) == eos))
    return task, model


def watched_decode(model, task, sample, references, place, size, **options):
    """Decode under WatchedTree (greedy's continuation put where `place` says) and return the
    hypotheses, the proposer and the generator; the draft's recording hook is removed after."""
    proposer = WatchedTree(model.decoder.heads, references, place, task.target_dictionary.eos())
    options = BlockwiseOptions(tree=size, **{"max_len_b": 20, **options})
    generator = BlockwiseGenerator(model, task.target_dictionary, options, proposer=proposer)
    try:
        hypos = generator.generate([model], sample)
    finally:
        del model.decoder.heads.feed_accepted
    return hypos, proposer, generator


def assert_first_steps_near_teacher_forced(model, task, sample, references, proposer):
    """Every block's first draft step (WatchedTree.first), nodes()'s or propose()'s, is the teacher-forced draft's on the whole prefix, within 1e-6: the base's
    features in a tree's block pass differ from the full prefix's by about 1e-7 (fairseq's
    float32 attention softmax), as in assert_nodes_teacher_forced."""
    pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
    inputs = torch.nn.utils.rnn.pad_sequence([torch.cat([torch.tensor([eos]), r]) for r in references],
                                             batch_first=True, padding_value=pad)
    block = teacher_forced(model, sample, inputs)[2]  # B x T x k x C
    firsts = [(s, j, features) for sentence, position, drafted in proposer.first
              for s, j, features in zip(sentence.tolist(), position.tolist(), drafted)
              if j < len(references[s])]  # none past the output's end
    got, want = torch.stack([f for *_, f in firsts]), torch.stack([block[s, j, 1] for s, j, _ in firsts])
    assert torch.allclose(got, want, atol=1e-6), float((got - want).abs().max())
    assert {s for s, *_ in firsts} == set(range(len(references)))  # every sentence's


# k, nodes, batch, max_len_b, the draft cache's first columns, EOS bias, options
SHAPES = [
    (3, 5, 13, 20, 64, 0.6, {}),
    (5, 12, 9, 7, 1, 0.4, {"confidence": 0.25}),
    (6, 24, 5, 20, 3, 0.6, {"proposal_vocab": 8}),
    (8, 32, 2, 20, 1, 0.4, {}),
    (8, 32, 13, 11, 64, 0.6, {"confidence": 0.1}),
    (4, 16, 1, 20, 2, 0.6, {}),
    (8, 3, 6, 20, 64, 0.4, {"block_size": 4}),
]


@pytest.mark.parametrize("k,size,bsz,max_len_b,columns,bias,options", SHAPES)
def test_trees_of_many_shapes_draft_every_node_on_its_own_path(
        data_dir, monkeypatch, k, size, bsz, max_len_b, columns, bias, options):
    """Greedy's continuation put at random ranks (or nowhere) per sentence and block, so that
    paths are accepted at every depth, sentences end at different blocks (the draft's state
    reordered mid-batch) and max length falls inside paths: greedy's output, and every node
    the teacher-forced draft's on its own path (the cache grown from `columns`)."""
    monkeypatch.setattr(DraftDecoder, "cache_columns", columns)
    task, model = eos_biased(data_dir, k, seed=size % 4, bias=bias)
    sample = random_sample(task, bsz=bsz, seed=size + bsz)
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    references = [e["tokens"] for e in expected]
    rng = random.Random(size * bsz)
    place = lambda s: rng.choice([0, 0, 1, 2, None, "never"])  # noqa: E731
    hypos, proposer, generator = watched_decode(model, task, sample, references, place, size,
                                                max_len_b=max_len_b, **options)
    assert_same(expected, hypos)
    assert_first_steps_near_teacher_forced(model, task, sample, references, proposer)
    assert_nodes_teacher_forced(model, task, sample, references, proposer)
    assert max(generator.stats.accepted) > 2 and not generator.layout.is_chain
    if bsz > 1:
        assert len({len(t[0]) for t in proposer.trees}) > 1  # sentences left mid-batch


# k, nodes, batch, max_len_b, the draft cache's first columns, EOS bias, confidence
CUT = [
    (3, 24, 1, 90, 3, 0.4, 0.7),
    (4, 8, 2, 20, 3, 0.0, 0.5),
    (3, 24, 3, 20, 64, 0.4, 0.5),
    (6, 8, 1, 90, 64, 0.4, 0.7),
    (6, 24, 3, 20, 3, 0.0, 0.5),
]


@pytest.mark.parametrize("k,size,bsz,max_len_b,columns,bias,confidence", CUT)
def test_trees_cut_hard_by_confidence_at_small_batches(
        data_dir, monkeypatch, k, size, bsz, max_len_b, columns, bias, confidence):
    """--blockwise-confidence cuts trees at several depths (propose() makes the first step,
    nodes() drafts the cut tree), at batch 1 and as a batch shrinks to it: every first step
    and every node stays the teacher-forced draft's."""
    monkeypatch.setattr(DraftDecoder, "cache_columns", columns)
    task, model = eos_biased(data_dir, k, seed=0, bias=bias)
    sample = random_sample(task, bsz=bsz, seed=bsz)
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    references = [e["tokens"] for e in expected]
    rng = random.Random(k * size)
    place = lambda s: rng.choice([0, 0, 1, 2, None, "never"])  # noqa: E731
    hypos, proposer, generator = watched_decode(model, task, sample, references, place, size,
                                                max_len_b=max_len_b, confidence=confidence)
    assert_same(expected, hypos)
    assert_first_steps_near_teacher_forced(model, task, sample, references, proposer)
    if k > 2:  # deeper than the first step
        assert_nodes_teacher_forced(model, task, sample, references, proposer)
    sizes = {tree.size for _, _, tree, *_ in proposer.trees}
    assert min(sizes) < generator.layout.size and len(sizes) > 1  # trees cut, at several depths


@pytest.mark.parametrize("options", [{"min_block": 3}, {"topk": 2}, {"topk": 2, "min_block": 2, "confidence": 0.1}])
def test_relaxed_rules_keep_the_draft_on_the_accepted_prefix(data_dir, options):
    """--blockwise-min-block and --blockwise-topk accept nodes greedy would not: the draft
    still follows what was accepted (its output, decoded again under the watch, is the same,
    and every node is the teacher-forced draft's on that output's prefix plus its path)."""
    task, model = random_draft(data_dir, 6, seed=2)
    sample = random_sample(task, bsz=6, seed=2)
    plain, first = blockwise(model, task, sample, 6, tree=24, **options)
    outputs = [h[0]["tokens"] for h in plain]
    hypos, proposer, _ = watched_decode(model, task, sample, outputs, lambda s: None, 24, **options)
    assert [h[0]["tokens"].tolist() for h in hypos] == [o.tolist() for o in outputs]
    assert_nodes_teacher_forced(model, task, sample, outputs, proposer)
    if "min_block" in options:
        assert max(first.stats.accepted) >= options["min_block"]


def test_long_outputs_grow_the_drafts_cache_inside_trees(data_dir):
    """Every node right on greedy's path (the deepest accepted every block) for outputs past
    the draft cache's first 64 columns."""
    task, model = random_draft(data_dir, 8, seed=1)
    sample = random_sample(task, bsz=3, seed=1)
    expected = greedy(model, task, sample, max_len_b=100)
    references = [e["tokens"] for e in expected]
    hypos, proposer, generator = watched_decode(model, task, sample, references, lambda s: 0, 32, max_len_b=100)
    assert_same(expected, hypos)
    assert max(int(t[1].max()) for t in proposer.trees) > DraftDecoder.cache_columns
    assert max(generator.stats.accepted) == generator.layout.max_depth + 1
    assert_nodes_teacher_forced(model, task, sample, references, proposer)


@pytest.mark.parametrize("rates", [
    [[0.0] * 3] * 4,  # every path as likely: ties broken by path
    [[1.0] * 12] * 4,  # every rank as likely as the top
    [[0.9], [0.5, 0.4, 0.3], [0.1] * 30, [1, 0]],  # ragged, past the shortlist's ranks
    [[0.5, 0.3]] * 9,  # more heads than the block has
])
def test_odd_rate_tables_shape_trees_that_decode_as_greedy(data_dir, rates):
    task, model = random_draft(data_dir, 5, seed=3)
    sample = random_sample(task, bsz=7, seed=1)
    expected = greedy(model, task, sample)
    for options in ({}, {"proposal_vocab": 6}, {"confidence": 0.3}):
        hypos, generator = blockwise(model, task, sample, 5, tree=16, tree_rates=rates, **options)
        assert_same(expected, hypos)
        assert generator.layout.size > 5


def test_greedy_options_shortlists_and_positions_with_draft_trees(data_dir):
    task, model = random_draft(data_dir, 5, seed=4)
    sample = random_sample(task, bsz=7, seed=4)
    for options in ({"min_len": 5}, {"no_repeat_ngram_size": 2}, {"unk_penalty": 0.5}, {"temperature": 0.7},
                    {"max_len_a": 1.5, "max_len_b": 3}, {"len_penalty": 0.3}):
        assert_same(greedy(model, task, sample, **options), blockwise(model, task, sample, 5, tree=16, **options)[0])
    task, model, _ = draft(data_dir, 5, "--head-vocab", "10", seed=3)  # the shortlist bounds the ranks
    sample = random_sample(task, bsz=5, seed=3)
    assert_same(greedy(model, task, sample), blockwise(model, task, sample, 5, tree=64, tree_rates=[[0.9] * 20] * 4)[0])
    task, model, _ = draft(data_dir, 5, "--max-target-positions", "12", seed=3)  # paths run into the last position
    expected = greedy(model, task, sample, max_len_b=200)
    assert max(len(e["tokens"]) for e in expected) == 12
    assert_same(expected, blockwise(model, task, sample, 5, tree=16, max_len_b=200)[0])


def test_one_generator_across_batch_sizes_and_a_chain_after_a_tree(data_dir):
    """The draft's state from one batch (or one block layout) never leaks into the next."""
    task, model = random_draft(data_dir, 5, seed=3)
    samples = [random_sample(task, bsz=bsz, seed=bsz) for bsz in (7, 3, 1, 7, 1, 3)]
    expected = [greedy(model, task, s) for s in samples]
    tree = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20, tree=8))
    chain = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20, block_size=5))
    cut = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20, tree=16, confidence=0.3))
    for i, (sample, want) in enumerate(zip(samples, expected)):
        for generator in (tree, chain, cut)[i % 3 :] + (tree, chain, cut)[: i % 3]:
            assert_same(want, generator.generate([model], sample))
    assert tree.stats.sentences == chain.stats.sentences == sum(len(e) for e in expected)


def test_weights_loaded_between_tree_decodes_are_drafted_with(data_dir):
    """load_state_dict and a float32 round trip between decodings: the next tree is drafted
    with the new weights (greedy computed on a copy: its eval() would drop what is kept)."""
    task, model = random_draft(data_dir, 5, seed=3)
    _, other = random_draft(data_dir, 5, seed=4)
    sample = random_sample(task, bsz=4, seed=1)
    place = lambda s: (0, None, 1)[s % 3]  # noqa: E731
    for change in (lambda: model.load_state_dict(other.state_dict()),
                   lambda: blockwise(model.float(), task, sample, 5, tree=16) and model.double()):
        blockwise(model, task, sample, 5, tree=16)  # arranges the draft's weights
        change()
        expected = greedy(copy.deepcopy(model), task, sample)
        references = [e["tokens"] for e in expected]
        hypos, proposer, _ = watched_decode(model, task, sample, references, place, 16)
        assert_same(expected, hypos)
        assert_nodes_teacher_forced(model, task, sample, references, proposer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_draft_trees_in_float32_and_half(data_dir, dtype):
    """The draft's cache and masks in the model's dtype. float32 on these seeds gives
    greedy's output; half (ties and rounding far from float64) decodes every sentence."""
    task, model, _ = draft(data_dir, 5, seed=3, dtype=dtype)
    sample = random_sample(task, bsz=7, seed=1)
    hypos, _ = blockwise(model, task, sample, 5, tree=16)
    assert model.decoder.heads.state.source_keys.dtype == dtype
    if dtype == torch.float32:
        assert_same(greedy(model, task, sample), hypos)
    else:
        assert len(hypos) == 7 and all(torch.isfinite(h[0]["score"]) and len(h[0]["tokens"]) for h in hypos)


@pytest.mark.parametrize("call", ["nodes", "propose"])
def test_the_draft_without_an_encoder_output_says_so(data_dir, call):
    task, model = random_draft(data_dir, 5, seed=3)
    heads, tree = model.decoder.heads, Tree.best(default_rates(4), 8, 4)
    features, token = torch.randn(2, 16, dtype=torch.float64), torch.tensor([5, 6])
    heads.state = None
    with torch.inference_mode(), pytest.raises(ValueError, match="reads the encoder output: pass encoder_out"):
        if call == "nodes":
            heads.nodes(None, tree, features, token, 0, None)
        else:
            heads.propose(features, token, 5, 0, 1, None)


def test_bad_tree_requests_are_refused_by_name(data_dir):
    task, model = random_draft(data_dir, 5, seed=3)
    sample = random_sample(task, bsz=2, seed=1)
    with pytest.raises(BlockwiseRequestError, match="--blockwise-tree must be between 0"):
        blockwise(model, task, sample, 5, tree=-1)
    with pytest.raises(BlockwiseRequestError, match=r"rates for heads 2\.\.3 only, but the block \(--block-size 5\)"):
        blockwise(model, task, sample, 5, tree=8, tree_rates=[[0.5, 0.2]] * 2)
    with pytest.raises(BlockwiseRequestError, match="--blockwise-adaptive chooses the width of a greedy chain"):
        BlockwiseOptions(adaptive=True, tree=8).generator(model, task.target_dictionary)


def test_the_hub_and_interactive_decode_draft_trees_as_greedy(data_dir):
    """A saved draft checkpoint (float32) through BlockwiseTransformerModel.from_pretrained with
    --blockwise-tree and through fairseq-interactive, batches of 4 (the last one 3)."""
    from cli_support import assert_same_hypotheses, hypotheses, run, summary
    from test_model import save

    from fairseq_bpd.model import BlockwiseTransformerModel

    path, _ = save(data_dir, "--block-size", "5", "--head-type", "draft")

    def load(**overrides):
        return BlockwiseTransformerModel.from_pretrained(data_dir, checkpoint_file=os.path.basename(path),
                                                         data_name_or_path=data_dir, user_dir=PLUGIN, **overrides)

    rng = random.Random(0)
    sentences = [" ".join(f"w{rng.randrange(24)}" for _ in range(rng.randint(2, 9))) for _ in range(11)]
    expected = load().translate(sentences, beam=1, max_len_b=30)
    hub = load(task="translation_blockwise", blockwise=True, blockwise_tree=16)
    assert hub.translate(sentences, max_len_b=30) == expected
    assert hub.translate(sentences[:3], max_len_b=30) == expected[:3]  # a smaller batch after
    assert hub.task.blockwise_stats.sentences == 14 and hub.task.blockwise_stats.mean_accepted_block() > 1
    common = ("--user-dir", PLUGIN, "--task", "translation_blockwise", "--cpu", "--source-lang", "de",
              "--target-lang", "en", "--buffer-size", 4, "--batch-size", 4, "--max-len-b", 30)
    stdin = "\n".join(sentences) + "\n"
    beam = run("fairseq-interactive", data_dir, "--path", path, *common, "--beam", 1, stdin=stdin)
    tree = run("fairseq-interactive", data_dir, "--path", path, *common, "--blockwise", "--blockwise-tree", 12,
               stdin=stdin)
    assert_same_hypotheses(hypotheses(beam), hypotheses(tree))
    assert summary(tree).sentences == 11
