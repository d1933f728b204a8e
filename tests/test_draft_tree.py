"""--head-type draft with --blockwise-tree: each node's children drafted after the node's own
path (its ancestors' steps only in the draft's self-attention); decoding stays exactly greedy."""
import math

import pytest
import torch

from conftest import random_sample
from test_draft import WatchedDraft, eos_draft, random_draft, teacher_forced
from test_generator import assert_same, blockwise, greedy

import fairseq_bpd.draft as draft_module
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.heads import decoding_logits
from fairseq_bpd.options import BlockwiseOptions
from fairseq_bpd.tree import Tree, default_rates


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bsz", [1, 7])
def test_random_draft_trees_give_greedy_output(data_dir, seed, bsz):
    """Sentences of different lengths in a batch; trees of 4 and 8 nodes on k=4, a deeper
    one of 16 on k=6; a shortlist, and trees cut by --blockwise-confidence."""
    for k, sizes in ((4, (4, 8)), (6, (16,))):
        task, model = random_draft(data_dir, k, seed)
        sample = random_sample(task, bsz=bsz, seed=seed)
        expected = greedy(model, task, sample)
        for size in sizes:
            for options in ({}, {"proposal_vocab": 9}, {"confidence": 0.2}):
                hypos, generator = blockwise(model, task, sample, k, tree=size, **options)
                assert_same(expected, hypos)
                assert generator.layout.size == size + 1 and not generator.layout.is_chain


@pytest.mark.parametrize("vocab", [0, 9])
def test_the_rank_0_path_is_the_chain_and_propose_first_changes_no_node(data_dir, vocab):
    """nodes() after propose() in the same block (--blockwise-confidence) reads the first
    step propose() made, and gives the nodes that nodes() alone gives; the tree's rank-0
    path is propose()'s chain, and other nodes are not the chain's alternatives."""
    task, model = random_draft(data_dir, 5, seed=4)
    heads, tree = model.decoder.heads, Tree.best(default_rates(4), 16, 4)
    sample = random_sample(task, bsz=3, seed=4)
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    torch.manual_seed(4)
    features, token = torch.randn(3, 16, dtype=torch.float64), torch.randint(4, 28, (3,))
    with torch.inference_mode():
        heads.state = None
        alone = heads.nodes(None, tree, features, token, vocab, encoder_out)
        length = heads.state.length.clone()
        heads.state = None
        proposals, _ = heads.propose(features, token, 5, vocab, tree.topn, encoder_out)
        after = heads.nodes(proposals, tree, features, token, vocab, encoder_out)
    assert after.tolist() == alone.tolist() and heads.state.length.tolist() == length.tolist() == [1, 1, 1]
    chain = [v - 1 for v, p in enumerate(tree.path_tuples()) if p and not any(p)]
    assert after[:, chain].tolist() == proposals[:, : len(chain), 0].tolist()
    assert not torch.equal(after, proposals[:, tree.depth[1:] - 1, tree.rank[1:]])


class WatchedTree(WatchedDraft):
    """The model's draft under a tree: records each block's first step (WatchedDraft) and, of
    every nodes() call, the draft's own tokens and each parent's drafted features beside its
    sentence and accepted prefix; then puts greedy's continuation at the nodes that
    `place(sentence)` names (rank place at every depth along greedy's path; None: the
    draft's own tokens; "never": a wrong token at every node). reads: whether the generator
    calls propose() before nodes() (the flag's default for a proposer that does not say)."""

    def __init__(self, heads, references, place, eos, reads=False):
        super().__init__(heads, references, True, eos)
        self.place, self.nodes_read_proposals, self.trees, self.steps = place, reads, [], []

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        if self.sentence is None:
            self.sentence = torch.arange(features.size(0))
        return self.heads.propose(features, token, width, vocab, topn, encoder_out, log_probs, confidence)

    def nodes(self, proposals, tree, features, token, vocab=0, encoder_out=None):
        if self.sentence is None:
            self.sentence = torch.arange(features.size(0))
        steps, decode_step = [], draft_module.decode_step
        draft_module.decode_step = lambda *args: steps.append(decode_step(*args)) or steps[-1]
        try:
            nodes = self.heads.nodes(proposals, tree, features, token, vocab, encoder_out)
        finally:
            draft_module.decode_step = decode_step
        deeper = len(tree.hydra) - 1  # the steps of the depths below the root: the last ones made
        self.steps.append(deeper)
        g = [self.heads.state.root[:, None]] + [s.view(len(token), -1, s.size(-1)) for s in steps[len(steps) - deeper:]]
        length = self.heads.state.length
        self.trees.append((self.sentence.clone(), length.clone(), tree, nodes.clone(), [x.clone() for x in g], vocab))
        paths = tree.path_tuples()
        for row, (s, n) in enumerate(zip(self.sentence.tolist(), length.tolist())):
            truth = self.references[s].tolist()[n - 1 :] + [self.eos] * tree.size
            assert int(token[row]) == truth[0]  # the root: greedy's next token
            place, right = self.place(s), [True]
            for v, path in enumerate(paths[1:], start=1):
                right.append(right[int(tree.parents[v])] and path[-1] == place)
                if right[v]:
                    nodes[row, v - 1] = truth[len(path)]
                elif place == "never":
                    nodes[row, v - 1] = 4 + (truth[len(path)] - 3) % 20  # never greedy's, never a special
        return nodes


def assert_nodes_teacher_forced(model, task, sample, references, proposer):
    """Every node with children was drafted as the teacher-forced draft on the accepted
    prefix followed by that node's own path (block_features); every node's token is its
    parent's rank-r choice there. A sibling's or a cousin's entry in a node's attention
    would change its features. The tolerance is the base's: fairseq's attention takes its
    softmax in float32, so its block pass and the full-prefix pass differ by about 1e-7
    even in float64, and the draft reads those features."""
    d, rows = task.target_dictionary, []
    for sentence, length, tree, nodes, g, vocab in proposer.trees:
        paths = tree.paths  # n x D+1: each node's ancestors by depth
        for b, (s, n) in enumerate(zip(sentence.tolist(), length.tolist())):
            if n > len(references[s]):  # the root is past the sentence's end
                continue
            for depth, (parents, *_) in enumerate(tree.hydra):
                for r, v in enumerate(parents.tolist()):
                    path = paths[v, 1 : depth + 1]
                    tokens = torch.cat([references[s][:n], nodes[b, path - 1]])
                    rows.append((s, n, depth, tokens, g[depth][b, r], tree, v, nodes[b], vocab))
    inputs = torch.full((len(rows), max(len(r[3]) for r in rows) + 1), d.pad())
    for r, (_, _, _, tokens, *_) in enumerate(rows):
        inputs[r, 0] = d.eos()
        inputs[r, 1 : len(tokens) + 1] = tokens
    _, _, block = teacher_forced(model, sample, inputs, torch.tensor([r[0] for r in rows]))
    deep = 0
    for r, (s, n, depth, _, drafted, tree, v, nodes, vocab) in enumerate(rows):
        want = block[r, n - 1, depth + 1]  # the step after the node's path: what predicts its children
        assert torch.allclose(drafted, want, atol=1e-6), (s, n, v)
        children = (tree.parents == v).nonzero()[:, 0]
        children = children[children > 0]
        with torch.inference_mode():  # drafted in decoding: an inference tensor
            best = decoding_logits(model.decoder, drafted, vocab).topk(int(tree.rank[children].max()) + 1)[1]
        assert nodes[children - 1].tolist() == best[tree.rank[children]].tolist(), (s, n, v)
        deep += depth > 0
    assert deep > len(references) and len({r[0] for r in rows}) == len(references)


def watched_tree(model, task, expected, place, size, reads=False, **options):
    proposer = WatchedTree(model.decoder.heads, [e["tokens"] for e in expected], place,
                           task.target_dictionary.eos(), reads)
    options = BlockwiseOptions(max_len_b=options.pop("max_len_b", 20), tree=size, **options)
    return proposer, BlockwiseGenerator(model, task.target_dictionary, options, proposer=proposer)


@pytest.mark.parametrize("reads", [False, True])
@pytest.mark.parametrize("size", [8, 16])
def test_each_node_is_drafted_on_its_own_path(data_dir, size, reads):
    """Through blocks accepted at every depth, EOS inside paths and sentences leaving: every
    node's drafted features are the teacher-forced draft's on its own path, one draft step
    per depth below the root, and the block's first step (fed once a block, whether or not
    propose() came first) the teacher-forced one (the root's, depth 0)."""
    model, task, sample, expected = eos_draft(data_dir)
    references = [e["tokens"] for e in expected]
    proposer, generator = watched_tree(model, task, expected, lambda s: (0, 1, None)[s % 3], size, reads)
    assert_same(expected, generator.generate([model], sample))
    tree = generator.layout
    assert any(len(parents) > 1 for parents, *_ in tree.hydra[1:])  # siblings or cousins below depth 1
    assert len(proposer.first) == len(proposer.trees)  # the first step once a block
    assert set(proposer.steps) == {len(tree.hydra) - 1}
    assert len(generator.stats.accepted) > 2
    assert_nodes_teacher_forced(model, task, sample, references, proposer)


@pytest.mark.parametrize("size", [4, 8, 16])
def test_oracle_and_never_agreeing_draft_trees_with_eos_and_max_length_inside_paths(data_dir, size):
    model, task, sample, expected = eos_draft(data_dir)
    tokens = sum(len(e["tokens"]) for e in expected)
    for max_len_b in (20, 5, 7):
        short = greedy(model, task, sample, max_len_b=max_len_b) if max_len_b != 20 else expected
        invocations = {}
        for name, place in (("always", lambda s: 0), ("never", lambda s: "never")):
            proposer, generator = watched_tree(model, task, short, place, size, max_len_b=max_len_b)
            assert_same(short, generator.generate([model], sample))
            invocations[name] = generator.stats.invocations
            assert_nodes_teacher_forced(model, task, sample, [e["tokens"] for e in short], proposer)
            if name == "always":
                assert max(generator.stats.accepted) == generator.layout.max_depth + 1
            else:
                assert set(generator.stats.accepted) == {1}
        if max_len_b == 20:
            assert invocations["never"] == tokens  # one token per invocation, as greedy
            assert invocations["always"] < tokens / 2


def test_a_tree_cut_by_confidence_feeds_the_draft_once_a_block(data_dir):
    """--blockwise-confidence asks propose() for the chain's log-probs and then nodes() for
    the tree it cut: the first step is made once, by propose()."""
    model, task, sample, expected = eos_draft(data_dir)
    heads, decoder = model.decoder.heads, model.decoder
    calls, blocks, feed, forward_block = [], [], heads.feed_accepted, decoder.forward_block
    sizes, nodes = [], heads.nodes
    heads.feed_accepted = lambda *args: calls.append(1) or feed(*args)
    heads.nodes = lambda proposals, tree, *args: sizes.append(tree.size) or nodes(proposals, tree, *args)
    decoder.forward_block = lambda *args: blocks.append(1) or forward_block(*args)
    try:
        for confidence in (0.0, 0.3, 0.6, 0.9):
            for recorded in (calls, blocks, sizes):
                recorded.clear()
            hypos, generator = blockwise(model, task, sample, 4, tree=8, confidence=confidence)
            assert_same(expected, hypos)
            assert len(calls) == len(blocks) - 1  # none after the last block
            cut = len(sizes) < len(calls) or min(sizes) < generator.layout.size
            assert cut == (confidence > 0.5)  # cut trees, blocks of one, or chains
    finally:
        del heads.feed_accepted, heads.nodes, decoder.forward_block


def test_draft_trees_through_the_clis(tmp_path_factory):
    """fairseq-generate --blockwise --blockwise-tree 8 on a tiny draft checkpoint (its base
    frozen) gives the base's --beam 1 output."""
    from cli_support import BLOCK_SIZE, PLUGIN, TRAIN, assert_same_hypotheses, hypotheses, run, summary, trained

    tiny = trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))
    save = tmp_path_factory.mktemp("draft_tree")
    run("fairseq-train", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--arch", "transformer_blockwise", "--block-size", BLOCK_SIZE, "--criterion", "blockwise_cross_entropy",
        *TRAIN, "--head-type", "draft", "--freeze-base", "--max-update", 30, "--finetune-from-model",
        tiny.checkpoint, "--disable-validation", "--save-dir", save)
    common = ("--user-dir", PLUGIN, "--task", "translation_blockwise", "--cpu", "--batch-size", 8)
    greedy_out = run("fairseq-generate", tiny.data, "--path", tiny.checkpoint, *common, "--beam", 1)
    drafted = run("fairseq-generate", tiny.data, "--path", f"{save}/checkpoint_last.pt", *common, "--blockwise",
                  "--blockwise-tree", 8)
    assert_same_hypotheses(hypotheses(greedy_out), hypotheses(drafted))
    assert len(hypotheses(drafted)) == 20 and summary(drafted).mean > 1.0
