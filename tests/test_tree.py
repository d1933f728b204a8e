"""--blockwise-tree: candidate trees verified in one pass give exactly fairseq's greedy output."""
import json
from argparse import Namespace
import math
import random

import pytest
import torch

from conftest import build, random_sample
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationTask
from test_generator import CacheWatch, Oracle, assert_same, blockwise, ending_model, eos_ending, greedy
from test_refusals import PrefixBlocker, generation_args, repeats

from fairseq_bpd.tree import Tree, best_paths, default_rates, load_rates

NEG = -math.inf


def test_a_hand_built_tree_has_its_mask_positions_and_parents():
    #        root
    #       /    \
    #     (0)    (1)
    #    /   \     \
    # (0,0) (0,1) (1,0)
    #   |
    # (0,0,0)
    tree = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.size == 7 and tree.max_depth == 3 and tree.topn == 2
    assert tree.parents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]  # positions after the root, by depth
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.chain.tolist() == [True, True, False, True, False, False, True]
    assert tree.paths.tolist() == [[0, 0, 0, 0], [0, 1, 1, 1], [0, 2, 2, 2], [0, 1, 3, 3],
                                   [0, 1, 4, 4], [0, 2, 5, 5], [0, 1, 3, 6]]
    visible = [[1, 0, 0, 0, 0, 0, 0],
               [1, 1, 0, 0, 0, 0, 0],
               [1, 0, 1, 0, 0, 0, 0],
               [1, 1, 0, 1, 0, 0, 0],
               [1, 1, 0, 0, 1, 0, 0],
               [1, 0, 1, 0, 0, 1, 0],
               [1, 1, 0, 1, 0, 0, 1]]
    assert tree.mask.eq(0).long().tolist() == visible
    assert tree.mask[~tree.mask.eq(0)].eq(NEG).all()
    assert [nodes.tolist() for nodes, _ in tree.levels] == [[1, 2], [3, 4, 5], [6]]
    assert tree.upto(1).path_tuples() == [(), (0,), (1,)]
    assert tree.upto(5) is tree


def test_a_chain_is_the_causal_block():
    chain = Tree.chain_of(4)
    assert chain.parents.tolist() == [0, 0, 1, 2, 3] and chain.depth.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(chain.mask, torch.triu(torch.full((5, 5), NEG), 1))
    assert chain.chain.all() and chain.topn == 1


def test_best_paths_take_the_highest_expected_acceptance():
    rates = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.05], [0.4, 0.1, 0.0]]
    paths = best_paths(rates, 5)
    # products: (0,) .6, (1,) .2, (0,0) .3, (0,1) .18, (0,0,0) .12, (2,) .1, (1,0) .1
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    tree = Tree(paths)
    assert math.isclose(tree.expected_tokens(rates), 1 + 0.6 + 0.2 + 0.3 + 0.18 + 0.12)
    # Every node's parent is in the tree, and more nodes never lose expected tokens.
    for size in range(1, 40):
        paths = best_paths(default_rates(7), size)
        assert len(paths) == size and all(p[:-1] in paths or len(p) == 1 for p in paths)
    sizes = [Tree(best_paths(default_rates(7), n)).expected_tokens(default_rates(7)) for n in (1, 4, 16, 64)]
    assert sizes == sorted(sizes)
    # Only top choices: the tree is the chain.
    assert best_paths([[0.9]] * 3, 8) == [(0,), (0, 0), (0, 0, 0)]


def test_rates_files_are_read_or_refused_by_name(tmp_path):
    good = tmp_path / "rates.json"
    good.write_text(json.dumps({"rates": [[0.5, 0.2], [0.3, 0.1]]}))
    assert load_rates(str(good)) == [[0.5, 0.2], [0.3, 0.1]]
    for name, text in (("missing.json", None), ("bad.json", "{"), ("empty.json", '{"rates": []}'),
                       ("range.json", '{"rates": [[1.5]]}'), ("string.json", '{"rates": [["0.5"]]}'),
                       ("null.json", '{"rates": [[0.5, null]]}'), ("nested.json", '{"rates": [[0.5], [[0.3]]]}'),
                       ("boolean.json", '{"rates": [[true]]}'), ("nan.json", '{"rates": [[NaN]]}'),
                       ("table.json", '{"rates": {"2": [0.5]}}')):
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"^--blockwise-tree-rates: .*{name}"):
            load_rates(str(tmp_path / name))


class TreeOracle(Oracle):
    """Proposes, at each head, the true token at rank `place(sentence)` among wrong ones
    (None: nowhere), so the accepted path runs through chosen branches of the tree."""

    def __init__(self, *args, place, **kwargs):
        super().__init__(*args, agree=True, **kwargs)
        self.place = place

    def next_proposals(self, features, token, encoder_out, batch):
        true = super().next_proposals(features, token, encoder_out, batch)[..., 0]  # b x k-1
        topn = self.layout.topn
        rows = []
        for row, s in enumerate(batch.sentence.tolist()):
            wrong = [[4 + (int(x) - 3 + r) % 20 for r in range(1, topn + 1)] for x in true[row]]
            rank = self.place(s)
            if rank is not None and rank < topn:
                for h in range(true.size(1)):
                    wrong[h][rank] = int(true[row, h])
            rows.append(wrong)
        return torch.tensor(rows, dtype=torch.long).view(len(rows), true.size(1), topn)


@pytest.mark.parametrize("size", [1, 4, 16, 64])
@pytest.mark.parametrize("bsz,seed", [(1, 0), (1, 1), (64, 2)])
def test_random_heads_with_trees_give_greedy_output(data_dir, size, bsz, seed):
    task, model, _ = build(data_dir, "--block-size", "5", seed=seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    expected = greedy(model, task, sample, max_len_b=12)
    hypos, generator = blockwise(model, task, sample, 5, tree=size, max_len_b=12)
    assert_same(expected, hypos)
    assert generator.layout.size == size + 1


@pytest.mark.parametrize("size", [4, 16, 64])
@pytest.mark.parametrize("bsz", [1, 9, 64])
def test_oracle_and_adversarial_trees_give_greedy_output(data_dir, size, bsz):
    task, model, _ = build(data_dir, "--block-size", "4", seed=3)
    sample = random_sample(task, bsz=bsz, seed=3)
    expected = greedy(model, task, sample, max_len_b=12)
    references = [e["tokens"] for e in expected]
    tokens = sum(len(r) for r in references)
    invocations = {}
    # rank 0 for some sentences, rank 1 or 2 for others (a branch off the chain), or nowhere.
    for name, place in (("top", lambda s: 0), ("mixed", lambda s: (1, 0, None, 2)[s % 4]),
                        ("never", lambda s: None)):
        hypos, generator = blockwise(model, task, sample, 4, TreeOracle, tree=size, max_len_b=12,
                                     references=references, place=place)
        assert_same(expected, hypos)
        invocations[name] = generator.stats.invocations
    assert invocations["never"] == tokens  # one token per invocation, as greedy
    assert invocations["top"] <= invocations["mixed"] <= invocations["never"]
    if bsz > 1:  # enough sentences long enough to tell them apart
        assert invocations["top"] < invocations["mixed"] < invocations["never"]
    # Where the tree holds the true token at every depth, whole blocks are accepted.
    assert invocations["top"] <= sum(math.ceil((len(r) - 1) / 4) + 1 for r in references)


@pytest.mark.parametrize("options", [{"max_len_b": 3}, {"max_len_a": 0.5, "max_len_b": 2},
                                     {"min_len": 6, "max_len_b": 9}, {"unk_penalty": -3.0},
                                     {"temperature": 0.7}, {"no_repeat_ngram_size": 2},
                                     {"normalize_scores": False}])
def test_greedy_options_keep_their_meaning_in_a_tree(data_dir, options):
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=5, seed=11)
    expected = greedy(model, task, sample, **options)
    references = [e["tokens"] for e in expected]
    for place in (lambda s: s % 3, lambda s: None):
        hypos, _ = blockwise(model, task, sample, 4, TreeOracle, tree=16, references=references,
                             place=place, **options)
        assert_same(expected, hypos)
    assert_same(expected, blockwise(model, task, sample, 4, tree=16, **options)[0])


@pytest.mark.parametrize("flags", [["--decoder-learned-pos"], ["--decoder-normalize-before", "--no-decoder-final-norm"],
                                   ["--decoder-normalize-before", "--layernorm-embedding", "--no-scale-embedding"],
                                   ["--head-layout", "paper"], ["--block-size", "2"]])
def test_trees_on_other_decoder_layouts_give_greedy_output(data_dir, flags):
    task, model, _ = build(data_dir, "--block-size", "4", *flags, seed=5)
    k = model.decoder.block_size
    sample = random_sample(task, bsz=9, seed=5, max_len=30)  # sources of 3 to 31 tokens
    expected = greedy(model, task, sample)
    references = [e["tokens"] for e in expected]
    assert_same(expected, blockwise(model, task, sample, k, tree=16)[0])
    hypos, _ = blockwise(model, task, sample, k, TreeOracle, tree=16, references=references, place=lambda s: s % 3)
    assert_same(expected, hypos)


def test_an_ngram_blocker_that_bites_inside_tree_paths_gives_greedy_output(data_dir):
    """fairseq's CPU blocker never bans (test_refusals.py): a tree's per-node prefixes are
    checked with the one that reads the generated tokens, as the CUDA kernel does."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=9, seed=11)
    stock = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_b=20, no_repeat_ngram_size=2)
    stock.repeat_ngram_blocker = PrefixBlocker(2, use_extension=False)
    expected = [h[0] for h in stock.generate([model], sample)]
    plain = greedy(model, task, sample)
    assert [e["tokens"].tolist() for e in expected] != [e["tokens"].tolist() for e in plain]  # it bites
    assert not any(repeats(e["tokens"].tolist(), 2) for e in expected)

    class Blocked(TreeOracle):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.repeat_ngram_blocker = PrefixBlocker(2, use_extension=False)

    references = [e["tokens"] for e in expected]
    for place in (lambda s: 0, lambda s: s % 3, lambda s: None):
        hypos, _ = blockwise(model, task, sample, 4, Blocked, tree=16, references=references, place=place,
                             no_repeat_ngram_size=2)
        assert_same(expected, hypos)


def test_match_source_len_in_a_tree_gives_fairseqs_output(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=7, seed=11)
    constrained = TranslationTask.build_generator(task, [model], generation_args(match_source_len=True))
    expected = [h[0] for h in constrained.generate([model], sample)]
    assert [len(e["tokens"]) - 1 for e in expected] == sample["net_input"]["src_lengths"].tolist()
    assert_same(expected, blockwise(model, task, sample, 4, tree=16, match_source_len=True)[0])
    hypos, _ = blockwise(model, task, sample, 4, TreeOracle, tree=16, references=[e["tokens"] for e in expected],
                         place=lambda s: s % 3, match_source_len=True)
    assert_same(expected, hypos)


def test_eos_inside_a_tree_path_ends_the_sentence(data_dir):
    model, task, sample, expected, references = eos_ending(data_dir)
    for place in (lambda s: 0, lambda s: s % 3, lambda s: (None, 1)[s % 2]):
        hypos, _ = blockwise(model, task, sample, 4, TreeOracle, tree=16, references=references, place=place)
        assert_same(expected, hypos)
    assert_same(expected, blockwise(model, task, sample, 4, tree=16)[0])


@pytest.mark.parametrize("options", [{"proposal_vocab": 9}, {"confidence": 0.3}, {"topk": 2},
                                     {"min_block": 2}])
def test_decoding_flags_work_with_a_tree(data_dir, options):
    task, model, _ = build(data_dir, "--block-size", "4", seed=4)
    sample = random_sample(task, bsz=7, seed=4)
    expected = greedy(model, task, sample)
    hypos, tree_generator = blockwise(model, task, sample, 4, tree=16, **options)
    chain, chain_generator = blockwise(model, task, sample, 4, **options)
    if "topk" in options or "min_block" in options:  # relaxed: not greedy, but as long
        assert all(len(h[0]["tokens"]) > 0 for h in hypos)
        assert tree_generator.stats.invocations <= sum(len(e["tokens"]) for e in expected)
    else:
        assert_same(expected, hypos)
        assert_same(expected, chain)


def test_trees_accept_more_than_the_chain_on_the_same_heads(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4", seed=6)
    sample = random_sample(task, bsz=16, seed=6)
    expected = greedy(model, task, sample)
    stats = {}
    for name, options in (("chain", {}), ("top choices only", {"tree": 8, "tree_rates": [[0.9]] * 3}),
                          ("16", {"tree": 16}), ("64", {"tree": 64})):
        hypos, generator = blockwise(model, task, sample, 4, **options)
        assert_same(expected, hypos)
        stats[name] = generator.stats
    # A tree of top choices only is the chain: the same blocks, the same counts.
    assert stats["top choices only"].accepted == stats["chain"].accepted
    assert stats["chain"].mean_accepted_block() < stats["16"].mean_accepted_block()
    assert stats["16"].mean_accepted_block() <= stats["64"].mean_accepted_block()


def test_cache_compaction_of_tree_paths_matches_a_full_prefix_pass(data_dir):
    """Feeding trees and keeping a different path per sentence equals recomputing the prefix."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=9)
    decoder, eos = model.decoder, task.target_dictionary.eos()
    sample = random_sample(task, bsz=3, seed=9)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    tree = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    n = tree.size
    torch.manual_seed(0)
    prefixes = [[] for _ in range(3)]
    cached = torch.zeros(3, dtype=torch.long)
    state = {}
    for round_, nodes in enumerate(([0, 0, 0], [6, 2, 4], [1, 0, 5], [3, 6, 6], [0, 4, 2])):
        block = torch.randint(4, 28, (3, n))
        block[:, 0] = eos if round_ == 0 else block[:, 0]
        positions = cached[:, None] + tree.depth
        features, _ = decoder.forward_block(block, positions, encoder_out, state, tree.mask)
        for i in range(3):
            one = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([i]))
            for node in range(n):
                path = tree.paths[node, : int(tree.depth[node]) + 1]
                full_input = torch.tensor(prefixes[i] + block[i, path].tolist())[None]
                full, _ = decoder.extract_features(full_input, one)
                assert torch.allclose(features[i, node], full[0, -1], atol=1e-6, rtol=0)
        nodes = torch.tensor(nodes)
        keep, kept = tree.paths[nodes], tree.depth[nodes] + 1
        for i in range(3):
            prefixes[i] += block[i, keep[i, : kept[i]]].tolist()
        cached = decoder.crop_cache(state, cached, n, keep, kept)
        assert cached.tolist() == [len(p) for p in prefixes]


@pytest.mark.parametrize("flags,message", [
    (["--blockwise-tree", "-1"], "--blockwise-tree must be between 0 \\(the chain\\) and 1024 nodes \\(got -1\\)"),
    (["--blockwise-tree", "5000"], "--blockwise-tree must be between 0 .* \\(got 5000\\)"),
    (["--blockwise-tree-rates", "rates.json"], "--blockwise-tree-rates shapes a tree; give --blockwise-tree N"),
    (["--blockwise-tree", "8", "--blockwise-tree-rates", "/nonexistent/rates.json"],
     "--blockwise-tree-rates: cannot read /nonexistent/rates.json \\(No such file or directory\\)"),
])
def test_bad_tree_requests_are_refused_by_name(data_dir, flags, message):
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", *flags)
    with pytest.raises(ValueError, match=f"^--blockwise: {message}"):
        task.build_generator([model], Namespace(beam=1))


@pytest.mark.parametrize("text,why", [
    ("{bad", "is not JSON \\(Expecting property name"),
    ("[[0.9, 0.5]]", 'is no scripts/tree_rates.py file: it has no "rates" entry$'),
    ('{"heads": 2}', 'is no scripts/tree_rates.py file: it has no "rates" entry$'),
    ('{"rates": "high"}', "holds no heads x ranks table of rates in \\[0, 1\\]$"),
])
def test_a_malformed_rates_file_is_refused_saying_what_is_wrong(data_dir, tmp_path, text, why):
    rates = tmp_path / "rates.json"
    rates.write_text(text)
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", "--blockwise-tree", "3",
                           "--blockwise-tree-rates", str(rates))
    with pytest.raises(ValueError, match=f"^--blockwise: --blockwise-tree-rates: {rates} {why}"):
        task.build_generator([model], Namespace(beam=1))


def test_the_task_builds_the_tree_it_was_asked_for(data_dir, tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates": [[0.9, 0.5], [0.1, 0.0]]}))
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", "--blockwise-tree", "3",
                           "--blockwise-tree-rates", str(rates))
    generator = task.build_generator([model], Namespace(beam=1))
    # .9 (0,), .5 (1,), .09 (0,0): the second choice of head 2 beats head 3's first.
    assert generator.layout.path_tuples() == [(), (0,), (1,), (0, 0)]


def test_rates_for_fewer_heads_than_the_block_are_refused(data_dir, tmp_path):
    """Measured on a checkpoint of fewer heads, they would silently cut the tree short."""
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates": [[0.9, 0.5]]}))
    task, model, _ = build(data_dir, "--block-size", "4", "--blockwise", "--blockwise-tree", "8",
                           "--blockwise-tree-rates", str(rates))
    message = ("^--blockwise: --blockwise-tree-rates hold rates for head 2 only, but the block "
               r"\(--block-size 4\) proposes with heads 2..4")
    with pytest.raises(ValueError, match=message):
        task.build_generator([model], Namespace(beam=1))
    task.cfg.block_size = 2  # what they cover
    assert task.build_generator([model], Namespace(beam=1)).layout.path_tuples() == [(), (0,), (1,)]
    task.cfg.block_size = 3
    with pytest.raises(ValueError, match=r"\(--block-size 3\) proposes with heads 2..3.* give --block-size 2$"):
        task.build_generator([model], Namespace(beam=1))
    task.cfg.block_size = None  # the checkpoint's k: no flag to name
    with pytest.raises(ValueError, match=r"for head 2 only, but the block \(the checkpoint's 4 heads\)"):
        task.build_generator([model], Namespace(beam=1))


def test_a_tree_ranks_no_deeper_than_the_proposal_vocabulary(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", seed=1)
    sample = random_sample(task, bsz=4, seed=1)
    flat = [[0.5] * 10, [0.5] * 10]  # every rank as good: the tree wants ranks 0..9
    hypos, generator = blockwise(model, task, sample, 3, tree=64, tree_rates=flat, proposal_vocab=5)
    assert generator.layout.topn == 4  # 5 types, padding excluded
    assert_same(greedy(model, task, sample), hypos)


def test_a_smaller_block_size_keeps_the_tree_within_its_heads(data_dir):
    task, model, _ = build(data_dir, "--block-size", "5", seed=8)
    sample = random_sample(task, bsz=6, seed=8)
    hypos, generator = blockwise(model, task, sample, 3, tree=16)
    assert generator.layout.max_depth == 2  # heads 2 and 3 of the checkpoint's 5
    assert_same(greedy(model, task, sample), hypos)


@pytest.mark.parametrize("bsz,max_len_b", [(1, 40), (7, 40), (16, 40), (16, 9)])
@pytest.mark.parametrize("size", [4, 16])
def test_random_tree_paths_among_masked_holes_give_greedy_output(data_dir, size, bsz, max_len_b):
    """Each sentence's true tokens at a random rank per block (or nowhere): chain prefixes
    leave masked holes that a later tree path's compaction must skip."""
    task, model = ending_model(data_dir, 5)
    sample = random_sample(task, bsz=bsz, seed=1, max_len=20)
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    rng = random.Random(size + bsz)
    watch = CacheWatch(model.decoder)
    hypos, generator = blockwise(model, task, sample, 5, TreeOracle, tree=size, max_len_b=max_len_b,
                                 references=[e["tokens"] for e in expected],
                                 place=lambda s: rng.choice([0, 0, 1, 2, None]))
    assert_same(expected, hypos)
    assert len(generator.stats.accepted) > 2
    assert watch.compactions > 0 or bsz == 1  # gathers of a cache whose columns were masked


def test_a_tree_in_a_block_of_head_1_alone_is_refused(data_dir):
    """--block-size 1 leaves no head to propose a node with: the tree would decode greedily."""
    task, model, _ = build(data_dir, "--block-size", "3", "--blockwise", "--blockwise-tree", "8")
    task.cfg.block_size = 1
    with pytest.raises(ValueError, match=r"^--blockwise: --blockwise-tree 8 proposes with heads 2 and "
                                         r"after, but the block \(--block-size 1\) has head 1 alone"):
        task.build_generator([model], Namespace(beam=1))
    task.cfg.block_size = 2
    assert task.build_generator([model], Namespace(beam=1)).layout.path_tuples()[:2] == [(), (0,)]
