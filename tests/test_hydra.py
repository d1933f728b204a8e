"""Hydra trees: under --blockwise-tree, chained heads propose each node's children after the
node's own token, and decoding stays exactly fairseq's greedy output."""
import random

import pytest
import torch

from conftest import random_sample
from test_chained import chained
from test_generator import RecordingProposer, assert_same, blockwise, greedy

from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.heads import decoding_logits
from fairseq_bpd.options import BlockwiseOptions
from fairseq_bpd.tree import Tree, best_paths, default_rates


@torch.inference_mode()
def per_path(heads, features, token, path, vocab=0):
    """The token of the node at `path` (ranks), computed along that path alone: b."""
    for d, rank in enumerate(path):
        features = heads.link(d, features, token)
        token = decoding_logits(heads.decoder, features, vocab).topk(rank + 1, dim=-1)[1][:, rank]
    return token


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("hidden", [(), ("--head-ffn-dim", "8")])
@pytest.mark.parametrize("vocab", [0, 9])
def test_each_node_follows_its_own_parent_one_link_per_depth(data_dir, vocab, hidden, lean):
    """On ChainWeights (lean; a hidden layer narrower than the features: logits through
    W2 P) and on the modules (a hook on them)."""
    task, model, _ = chained(data_dir, 5, *hidden, seed=2)
    heads = model.decoder.heads
    for fc_out in heads.fc_out:  # biases that ChainWeights carries from link to link
        fc_out.bias.data.normal_(0, 0.5)
    tree = Tree.best(default_rates(4), 16, 4)
    assert not tree.is_chain and any(p[0] > 0 and len(p) > 1 for p in tree.path_tuples()[1:])
    torch.manual_seed(0)
    features, token = torch.randn(6, 16, dtype=torch.float64), torch.randint(4, 28, (6,))
    proposals, _ = heads.propose(features, token, 5, vocab, tree.topn)
    handle = None if lean else heads.fc_in[0].register_forward_hook(lambda *args: None)
    calls = []  # (depth, rows) of each link, the module's or ChainWeights'
    link = heads.link
    heads.link = lambda d, f, t: calls.append((d, t.numel())) or link(d, f, t)
    with torch.inference_mode():
        weights = heads.decoding_weights(vocab)  # what nodes() finds (arranged under inference_mode)
        assert (weights is not None) == lean
        if lean:
            lean_link = weights.link
            weights.link = lambda i, g, t, *args: calls.append((i, t.numel())) or lean_link(i, g, t, *args)
        nodes = heads.nodes(proposals, tree, features, token, vocab)  # b x n-1
    del heads.link
    if lean:
        del weights.link
    else:
        handle.remove()
    # One batched link per depth, over that depth's parents: b x P_d rows.
    parents = [len(set(p.tolist())) for _, p in tree.levels]
    assert calls == [(d, 6 * count) for d, count in enumerate(parents)]
    for v, path in enumerate(tree.path_tuples()[1:], start=1):
        assert nodes[:, v - 1].tolist() == per_path(heads, features, token, path, vocab).tolist(), path
    # The rank-0 path is propose()'s chain; the gather of propose() is not Hydra's tree.
    chain = [v for v, p in enumerate(tree.path_tuples()[1:]) if not any(p)]
    assert nodes[:, chain].tolist() == proposals[:, : len(chain), 0].tolist()
    assert not torch.equal(nodes, proposals[:, tree.depth[1:] - 1, tree.rank[1:]])


def test_decoding_verifies_the_tree_each_parent_continues(data_dir):
    """Every block the generator feeds holds, at each node, the token its own path gives."""
    task, model, _ = chained(data_dir, 4, seed=3)
    decoder = model.decoder
    sample = random_sample(task, bsz=5, seed=3)
    expected = greedy(model, task, sample, max_len_b=15)
    proposed, blocks = [], []

    class Recorded(BlockwiseGenerator):
        def next_proposals(self, features, token, encoder_out, batch):
            proposed.append((features.clone(), token.clone()))
            return super().next_proposals(features, token, encoder_out, batch)

    forward_block = decoder.forward_block
    decoder.forward_block = lambda block, *args: blocks.append(block.clone()) or forward_block(block, *args)
    hypos, generator = blockwise(model, task, sample, 4, Recorded, tree=16, max_len_b=15)
    del decoder.forward_block
    assert_same(expected, hypos)
    paths = generator.layout.path_tuples()
    assert len(blocks) == len(proposed) + 1 > 3  # the first block is BOS alone
    for (features, token), block in zip(proposed, blocks[1:]):
        assert block[:, 0].tolist() == token.tolist() and block.size(1) == len(paths)
        for v, path in enumerate(paths[1:], start=1):
            assert block[:, v].tolist() == per_path(decoder.heads, features, token, path).tolist(), path


@pytest.mark.parametrize("size", [4, 16, 32, 64])
@pytest.mark.parametrize("bsz,seed,max_len_b", [(1, 0, 12), (1, 1, 12), (16, 2, 12), (16, 3, 3), (7, 4, 6)])
def test_random_chained_heads_with_trees_give_greedy_output(data_dir, size, bsz, seed, max_len_b):
    """Max length falls inside a tree path where max_len_b is small."""
    task, model, _ = chained(data_dir, 5, seed=seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    for options in ({}, {"proposal_vocab": 9}, {"confidence": 0.2}):
        hypos, generator = blockwise(model, task, sample, 5, tree=size, max_len_b=max_len_b, **options)
        assert_same(expected, hypos)
        assert generator.layout.size == size + 1


def eos_ending_chained(data_dir):
    """Chained heads on a model whose greedy outputs end after 2 to 40 tokens (bsz 16)."""
    task, model, _ = chained(data_dir, 5, seed=1)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 3
    sample = random_sample(task, bsz=16, seed=1, max_len=20)
    expected = greedy(model, task, sample, max_len_b=40)
    assert len({len(e["tokens"]) % 5 for e in expected}) > 2, "EOS should fall at several block offsets"
    return task, model, sample, expected


class HydraOracle(RecordingProposer):
    """Chained heads' chain, and a tree whose nodes follow their own parents: a node on the
    true path has the true next token at rank `place(sentence)` (None: nowhere) among
    children that depend on it; a node off it only children made from its own token."""

    def __init__(self, heads, references, place):
        super().__init__(heads, [r.tolist() + [heads.decoder.dictionary.eos()] * 64 for r in references])
        self.place = place

    def nodes(self, proposals, tree, features, token, vocab=0, encoder_out=None):
        paths, rows = tree.path_tuples(), []
        for row, (s, n) in enumerate(zip(self.sentence.tolist(), self.length.tolist())):
            truth, place = self.references[s][n - 1 :], self.place(s)
            chosen, on_truth = [int(token[row])], [True]
            for v, path in enumerate(paths[1:], start=1):
                parent = int(tree.parents[v])
                wrong = 4 + (chosen[parent] * 3 + path[-1] + len(path)) % 20
                if on_truth[parent] and wrong == truth[len(path)]:
                    wrong = 4 + (wrong - 3) % 20
                right = on_truth[parent] and path[-1] == place
                chosen.append(truth[len(path)] if right else wrong)
                on_truth.append(right)
            rows.append(chosen[1:])
        return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("size", [4, 16, 32])
def test_oracle_and_adversarial_hydra_trees_with_eos_and_max_length_inside_paths(data_dir, size):
    task, model, sample, expected = eos_ending_chained(data_dir)
    references = [e["tokens"] for e in expected]
    tokens = sum(len(r) for r in references)
    rng = random.Random(size)
    invocations = {}
    for name, place in (("top", lambda s: 0), ("mixed", lambda s: (1, 0, None, 2)[s % 4]),
                        ("random", lambda s: rng.choice([0, 1, 2, None])), ("never", lambda s: None)):
        for max_len_b in (40, 7):
            short = greedy(model, task, sample, max_len_b=max_len_b) if max_len_b != 40 else expected
            proposer = HydraOracle(model.decoder.heads, [e["tokens"] for e in short], place)
            generator = BlockwiseGenerator(model, task.target_dictionary,
                                           BlockwiseOptions(block_size=5, tree=size, max_len_b=max_len_b),
                                           proposer=proposer)
            assert_same(short, generator.generate([model], sample))
            if max_len_b == 40:
                invocations[name] = generator.stats.invocations
    assert invocations["never"] == tokens  # one token per invocation, as greedy
    assert invocations["top"] < invocations["mixed"] < invocations["never"]


@pytest.mark.parametrize("size", [16, 64])
def test_hydra_trees_give_greedy_output_with_eos_inside_paths(data_dir, size):
    task, model, sample, expected = eos_ending_chained(data_dir)
    hypos, generator = blockwise(model, task, sample, 5, tree=size, max_len_b=40)
    assert_same(expected, hypos)
    for bsz in (1, 3):
        one = {"id": sample["id"][:bsz], "net_input": {k: v[:bsz] for k, v in sample["net_input"].items()}}
        assert_same(expected[:bsz], blockwise(model, task, one, 5, tree=size, max_len_b=40)[0])


def test_a_chain_of_chained_heads_never_asks_for_tree_nodes(data_dir):
    """The chain keeps its fast path: propose()'s best tokens, no nodes() call."""
    task, model, _ = chained(data_dir, 4, seed=5)
    sample = random_sample(task, bsz=4, seed=5)
    heads = model.decoder.heads
    heads.nodes = lambda *args: pytest.fail("a chain asked for tree nodes")
    only_top = [[0.9]] * 3  # a tree of top choices only is the chain
    for options in ({}, {"tree": 8, "tree_rates": only_top}):
        assert_same(greedy(model, task, sample), blockwise(model, task, sample, 4, **options)[0])
    del heads.nodes


def test_hydra_plan_of_a_hand_built_tree():
    #        root
    #       /    \
    #     (0)    (1)
    #    /   \     \
    # (0,0) (0,1) (1,0)
    #   |
    # (0,0,0)
    tree = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    plan = [(p.tolist(), s.tolist(), c.tolist(), r.tolist(), k.tolist(), topn) for p, s, c, r, k, topn in tree.hydra]
    assert plan == [([0], [0], [1, 2], [0, 0], [0, 1], 2),  # the root's children: head 2 after the first token
                    ([1, 2], [0, 0], [3, 4, 5], [0, 0, 1], [0, 1, 0], 2),  # after (0) and (1), from the root's row
                    ([3], [0], [6], [0], [0], 1)]  # after (0,0), chosen from (0)'s row
    assert Tree(best_paths(default_rates(3), 12)).upto(1).hydra[0][0].tolist() == [0]
