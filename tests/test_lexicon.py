"""--blockwise-proposal-lexicon: the draft proposes among the first N entries and the rarer
tokens that the batch's source words bring; decoding stays exactly greedy."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import build, random_sample
from test_draft import DRAFT, draft
from test_draft_precision import reduced_model
from test_generator import assert_same, blockwise, greedy

from fairseq_bpd import kernels
from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.lexicon import FORMAT, ProposalLexicon, ProposalVocabulary
from fairseq_bpd.options import BlockwiseOptions
from fairseq_bpd.product import Int8Product

FIRST = 9  # the shortlist: the four specials and w0..w4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lexicon_of(task, pairs, first=FIRST):
    """A ProposalLexicon from {source word index: [target word indices]} (conftest's w0..w23)."""
    src, tgt = task.source_dictionary, task.target_dictionary
    return ProposalLexicon({src[s]: [tgt[t] for t in targets] for s, targets in pairs.items()}, first)


def every_word_adds(task, targets):
    """Each source word adds `targets` (target indices)."""
    d = task.source_dictionary
    return lexicon_of(task, {s: targets for s in range(d.nspecial, len(d))})


def test_a_batch_vocabulary_is_the_shortlist_and_its_source_words_extras(data_dir):
    task, _, _ = build(data_dir, "--block-size", "3", *DRAFT)
    src, tgt = task.source_dictionary, task.target_dictionary
    lexicon = lexicon_of(task, {5: [20, 12, 3], 6: [12, 25], 7: [4]})  # 3 and 4 lie in the shortlist
    lexicon.table[src[8]] = ["no-such-word"]  # dropped: the target dictionary lacks it
    tokens = torch.tensor([[src.pad(), 5, 6, src.eos()], [7, 7, 9, src.eos()]])
    vocab = lexicon.vocabulary(tokens, FIRST, src, tgt)
    assert isinstance(vocab, ProposalVocabulary) and vocab.extras.tolist() == [12, 20, 25]
    assert vocab.ids.tolist() == list(range(FIRST)) + [12, 20, 25] and vocab.size() == FIRST + 3
    assert vocab.tokens(torch.tensor([[0, 9], [10, 11]])).tolist() == [[0, 12], [20, 25]]
    assert lexicon.vocabulary(torch.tensor([[7, 8, src.eos()]]), FIRST, src, tgt) == FIRST  # nothing past it
    assert lexicon.vocabulary(tokens, 21, src, tgt).extras.tolist() == [25]


def test_a_lexicon_file_round_trips_and_bad_files_are_named(data_dir, tmp_path):
    task, _, _ = build(data_dir, "--block-size", "3", *DRAFT)
    path = tmp_path / "lexicon.json"
    lexicon_of(task, {5: [20, 12]}).save(path)
    loaded = ProposalLexicon.load(path)
    assert loaded.first == FIRST and loaded.table == {task.source_dictionary[5]: ["w16", "w8"]}
    assert BlockwiseOptions(proposal_lexicon=str(path)).proposal_lexicon.table == loaded.table
    (tmp_path / "bad.json").write_text(json.dumps({"format": FORMAT, "table": {"w1": "w2"}}))
    for i, first in enumerate((None, [1], "abc", -1, 2.5, True)):
        (tmp_path / f"first{i}.json").write_text(json.dumps({"format": FORMAT, "first": first, "table": {"w1": ["w2"]}}))
        with pytest.raises(BlockwiseRequestError, match=f"first{i}.json: not a proposal lexicon"):
            BlockwiseOptions(proposal_lexicon=str(tmp_path / f"first{i}.json"))
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "utf8.json").write_bytes(json.dumps({"format": FORMAT, "table": {"größe": ["ß"]}},
                                                    ensure_ascii=False).encode("utf-8"))
    assert ProposalLexicon.load(tmp_path / "utf8.json").table == {"größe": ["ß"]}  # whatever the locale
    (tmp_path / "other.json").write_text(json.dumps({"rates": []}))
    (tmp_path / "broken.json").write_text("{")
    for name, problem in (("missing.json", "cannot read"), ("broken.json", "cannot read"), ("deep.json", "cannot read"),
                          ("bad.json", "not a proposal lexicon"), ("other.json", "not a proposal lexicon")):
        with pytest.raises(BlockwiseRequestError, match=f"--blockwise-proposal-lexicon .*{name}: {problem}"):
            BlockwiseOptions(proposal_lexicon=str(tmp_path / name))
    with pytest.raises(BlockwiseRequestError, match="proposal_lexicon must be"):
        BlockwiseOptions(proposal_lexicon=3)


def test_the_lexicon_is_refused_where_it_adds_nothing(data_dir):
    task, model, _ = draft(data_dir, 3)
    lexicon = every_word_adds(task, [12])
    with pytest.raises(BlockwiseRequestError, match="whole dictionary already: give --blockwise-proposal-vocab"):
        BlockwiseGenerator(model, task.target_dictionary, block_size=3, proposal_lexicon=lexicon)
    strangers = ProposalLexicon({"nowhere": ["w12"]}, FIRST)
    with pytest.raises(BlockwiseRequestError, match="none of its words are in the model's dictionaries"):
        BlockwiseGenerator(model, task.target_dictionary, block_size=3, proposal_vocab=FIRST,
                           proposal_lexicon=strangers)
    task, chained, _ = build(data_dir, "--block-size", "3", "--head-type", "chained")
    with pytest.raises(BlockwiseRequestError, match=r"draft decoder's proposals \(--head-type draft\)"):
        BlockwiseGenerator(chained, task.target_dictionary, block_size=3, proposal_vocab=FIRST,
                           proposal_lexicon=lexicon)


class RecordedNodes:
    """A proposer whose tree nodes are recorded in `into`; the rest is `proposer`'s."""

    def __init__(self, proposer, into):
        self.proposer, self.into = proposer, into

    def nodes(self, *args):
        out = self.proposer.nodes(*args)
        self.into.append(out.clone())
        return out

    def __getattr__(self, name):
        return getattr(self.proposer, name)


def recorded_proposals(generator):
    """Every block's proposals the generator's loop receives (its chains, and a tree's nodes),
    recorded in a list it returns."""
    proposals, next_proposals = [], generator.next_proposals

    def recording(*args):
        out = next_proposals(*args)
        proposals.append(out.clone())
        return out
    generator.next_proposals = recording
    generator.__dict__["proposer"] = RecordedNodes(generator.proposer, proposals)
    return proposals


@pytest.mark.parametrize("bsz", [1, 7])
@pytest.mark.parametrize("seed", range(2))
def test_a_lexicon_of_every_word_proposes_as_the_whole_dictionary(data_dir, bsz, seed):
    """Where every source word brings every token past the shortlist, the draft proposes what
    it proposes over the whole dictionary, block after block; both give greedy's output."""
    task, model, _ = draft(data_dir, 4, seed=seed)
    d = task.target_dictionary
    sample = random_sample(task, bsz=bsz, seed=seed)
    expected = greedy(model, task, sample)
    whole = BlockwiseGenerator(model, d, block_size=4, max_len_b=20)
    lexical = BlockwiseGenerator(model, d, block_size=4, max_len_b=20, proposal_vocab=FIRST,
                                 proposal_lexicon=every_word_adds(task, list(range(FIRST, len(d)))))
    records = [recorded_proposals(g) for g in (whole, lexical)]
    for g in (whole, lexical):
        assert_same(expected, g.generate([model], sample))
    assert len(records[0]) == len(records[1]) > 3
    assert all(torch.equal(a, b) for a, b in zip(*records))
    assert whole.stats.accepted == lexical.stats.accepted


def masked_to(vocabulary, logits):
    """logits ... x V with -inf outside the token ids `vocabulary` (a set)."""
    outside = torch.tensor([t not in vocabulary for t in range(logits.size(-1))])
    return logits.masked_fill(outside, -math.inf)


@pytest.mark.parametrize("topn", [1, 3])
def test_a_proposals_log_probs_are_its_tokens_over_the_batch_vocabulary(data_dir, topn):
    """propose() asked for log-probs (the protocol's default) gathers them at the chosen
    columns: each proposal's log-prob over the batch vocabulary, as the whole dictionary's
    with every other token's logit -inf gives it."""
    task, model, _ = draft(data_dir, 4, seed=2)
    d, heads = task.target_dictionary, model.decoder.heads
    sample = random_sample(task, bsz=3, seed=2)
    lexicon = lexicon_of(task, {s: [FIRST + (s % 7) * 2] for s in range(4, 28)})
    vocab = lexicon.vocabulary(sample["net_input"]["src_tokens"], FIRST, task.source_dictionary, d)
    allowed = set(vocab.ids.tolist())
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    features, token = torch.randn(3, model.decoder.embed_tokens.weight.size(1), dtype=torch.float64), torch.tensor([5, 6, 7])
    with torch.no_grad():
        heads.state = None
        tokens, lprobs = heads.propose(features, token, 4, vocab, topn, encoder_out)
        heads.state = None
        logits = DraftDecoder.logits
        DraftDecoder.logits = lambda self, drafted, v: masked_to(allowed, logits(self, drafted, 0))
        try:
            wanted, wanted_lprobs = heads.propose(features, token, 4, 0, topn, encoder_out)
        finally:
            DraftDecoder.logits = logits
    assert torch.equal(tokens, wanted) and set(tokens.flatten().tolist()) <= allowed
    assert torch.allclose(lprobs, wanted_lprobs, atol=1e-12)
    assert bool((tokens >= FIRST).any())  # an extra among them: its log-prob read at its column


@pytest.mark.parametrize("bsz", [1, 7])
@pytest.mark.parametrize("options", [{}, {"confidence": 0.2}, {"tree": 6, "tree_rates": ((0.6, 0.2),) * 3}])
def test_the_draft_proposes_the_best_token_of_the_batch_vocabulary(data_dir, monkeypatch, bsz, options):
    """With some source words bringing some tokens, each proposal is the draft's best among
    the shortlist and the batch's extras: what it proposes over the whole dictionary with
    every other token's logit -inf (chains, confidence cuts, per-node trees of the same
    shape); the output greedy's, adaptive widths' too."""
    task, model, _ = draft(data_dir, 4, seed=3)
    d = task.target_dictionary
    sample = random_sample(task, bsz=bsz, seed=3)
    expected = greedy(model, task, sample)
    lexicon = lexicon_of(task, {s: [FIRST + (s % 7) * 2] for s in range(4, 28)})  # 7 of the 19 past the shortlist
    vocab = lexicon.vocabulary(sample["net_input"]["src_tokens"], FIRST, task.source_dictionary, d)
    allowed = set(vocab.ids.tolist())
    assert len(allowed) < len(d) - 1  # some tokens are left out
    lexical = BlockwiseOptions(block_size=4, max_len_b=20, proposal_vocab=FIRST, proposal_lexicon=lexicon,
                               **options).generator(model, d)
    made = recorded_proposals(lexical)
    assert_same(expected, lexical.generate([model], sample))
    adaptive = BlockwiseOptions(block_size=4, max_len_b=20, proposal_vocab=FIRST, proposal_lexicon=lexicon,
                                adaptive=True).generator(model, d)
    assert_same(expected, adaptive.generate([model], sample))
    logits = DraftDecoder.logits
    monkeypatch.setattr(DraftDecoder, "logits", lambda self, drafted, v: masked_to(allowed, logits(self, drafted, 0)))
    reference = BlockwiseOptions(block_size=4, max_len_b=20, **options).generator(model, d)
    wanted = recorded_proposals(reference)
    assert_same(expected, reference.generate([model], sample))
    assert len(made) == len(wanted) >= 3
    assert all(torch.equal(a, b) for a, b in zip(made, wanted))
    if bsz > 1:
        assert any(bool((p >= FIRST).any()) for p in made)  # the extras are proposed
    assert all(set(p.flatten().tolist()) <= allowed for p in made)


@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("seed", range(2))
def test_the_compiled_chain_drafts_the_extras_as_the_python_steps(data_dir, monkeypatch, k, seed):
    """At batch 1 in float32 the chain is one compiled call that reads the extras' int8
    product and ids: the same proposals as the Python steps on the same weights, block by
    block, and greedy's tokens."""
    assert kernels.module() is not None
    task, model = reduced_model(data_dir, k, seed)
    d = task.target_dictionary
    lexicon = every_word_adds(task, [FIRST + 2, FIRST + 7, FIRST + 11, len(d) - 1])
    sample = random_sample(task, bsz=1, seed=seed)
    calls, compiled_chain = [], DraftDecoder.compiled_chain

    def counted(self, *args):
        out = compiled_chain(self, *args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(DraftDecoder, "compiled_chain", counted)
    runs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(DraftDecoder, "compiled_chain", lambda self, *args: None)
        generator = BlockwiseGenerator(model, d, block_size=k, max_len_b=20, proposal_vocab=FIRST,
                                       proposal_lexicon=lexicon)
        made = recorded_proposals(generator)
        hypos = generator.generate([model], sample)
        if compiled:
            extras = model.decoder.heads.extra_projection(generator.vocabulary(sample["net_input"]["src_tokens"]))
            assert isinstance(extras, Int8Product)
        runs.append((hypos[0][0]["tokens"].tolist(), made))
    assert calls and all(calls)
    (tokens, made), (python_tokens, python_made) = runs
    assert tokens == python_tokens == greedy(model, task, sample)[0]["tokens"].tolist()
    assert len(made) == len(python_made) and all(torch.equal(a, b) for a, b in zip(made, python_made))


class Capture:
    """A compiled draft layer whose chain() calls are recorded (the last call's arguments)."""

    def __init__(self, layer):
        self.layer, self.args = layer, None

    def chain(self, *args):
        self.args = args
        return self.layer.chain(*args)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def test_the_compiled_chain_refuses_extras_it_would_misread(data_dir):
    task, model = reduced_model(data_dir, 3, 0)
    d = task.target_dictionary
    generator = BlockwiseGenerator(model, d, block_size=3, max_len_b=20, proposal_vocab=FIRST,
                                   proposal_lexicon=every_word_adds(task, [FIRST + 2, FIRST + 5]))
    with torch.inference_mode():  # as decoding arranges them, after the generator (whose model.eval() drops them)
        weights = model.decoder.heads.weights()
    layer = weights.layer = Capture(weights.layer)
    generator.generate([model], random_sample(task, bsz=1, seed=0))
    assert layer.args is not None and layer.args[-1].tolist() == [FIRST + 2, FIRST + 5]
    *args, packed, scales, _ = layer.args
    for ids, message in ((torch.tensor([3, 12]), "past the projection"), (torch.tensor([12, 10]), "increasing"),
                         (torch.tensor([12, len(d)]), "within the vocabulary"), (torch.tensor([12]), "one contiguous")):
        with pytest.raises(RuntimeError, match=message):
            layer.layer.chain(*args, packed, scales, ids)
    with pytest.raises(RuntimeError, match="together"):
        layer.layer.chain(*args, packed, None, None)


def run_script(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "proposal_lexicon.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_the_script_counts_companions_in_training_pairs(tmp_path):
    """A tiny corpus binarised by fairseq-preprocess: each source word's most frequent rarer
    companions, at least --min-count pairs each, at most --per-source; held-out splits and
    bad input refused by name."""
    raw, data = tmp_path / "raw", tmp_path / "bin"
    raw.mkdir()
    # "a" comes with "x" in three pairs and "y" in two; "b" with "z" once; frequent "the" everywhere
    pairs = [("a b", "the x z"), ("a", "the x y"), ("a c", "the x y"), ("c", "the")]
    for split in ("train", "valid"):
        (raw / f"{split}.de").write_text("".join(s + "\n" for s, _ in pairs))
        (raw / f"{split}.en").write_text("".join(t + "\n" for _, t in pairs))
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess"), "--source-lang", "de",
                    "--target-lang", "en", "--trainpref", raw / "train", "--validpref", raw / "valid",
                    "--destdir", data, "--workers", "1"], check=True, capture_output=True)
    from fairseq.data import Dictionary
    tgt = Dictionary.load(str(data / "dict.en.txt"))
    first = tgt.index("the") + 1  # "the" is the shortlist's last word; x, y and z lie past it
    assert first <= min(tgt.index(w) for w in "xyz")
    out = tmp_path / "lexicon.json"
    done = run_script(data, out, "--first", first, "--per-source", 1)
    assert done.returncode == 0, done.stderr
    assert ProposalLexicon.load(out).table == {"a": ["x"]}  # "a" and "y" share two pairs, "b" and "z" one
    run_script(data, out, "--first", first, "--per-source", 5, "--min-count", 1)
    table = ProposalLexicon.load(out).table
    assert table["a"] == ["x", "y", "z"] and table["b"] == ["x", "z"] and table["c"] == ["x", "y"]
    for args, message in (((data, out, "--subset", "valid"), "held out"),
                          ((data, out, "--first", len(tgt)), "--first"),
                          ((data, out, "--per-source", 0), "--per-source must be at least 1"),
                          ((tmp_path / "nowhere", out), "no folder"),
                          ((data, out, "--first", first, "--min-count", 9), "nothing to write"),
                          ((data, tmp_path / "nowhere" / "lexicon.json"), "cannot write")):
        failed = run_script(*args)
        assert failed.returncode != 0 and message in failed.stderr, failed.stderr


def test_tree_rates_rank_the_batch_vocabulary_under_a_lexicon(data_dir):
    """scripts/tree_rates.py --proposal-lexicon counts a head's rank-r hit only where its
    rank-r proposal over the batch vocabulary (the whole dictionary's logits with every other
    token's -inf) is greedy's token: a lexicon of every word counts as the whole dictionary,
    a partial one as its masked ranking."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from tree_rates import count_hits, ranked_tokens

    task, model, _ = draft(data_dir, 4, seed=4)
    d, src = task.target_dictionary, task.source_dictionary
    sample = random_sample(task, bsz=5, seed=4)
    src_tokens = sample["net_input"]["src_tokens"]
    outputs = [e["tokens"] for e in greedy(model, task, sample, max_len_b=8)]
    whole = every_word_adds(task, list(range(FIRST, len(d)))).vocabulary(src_tokens, FIRST, src, d)
    assert torch.equal(count_hits(model, sample["net_input"], outputs, whole)[0],
                       count_hits(model, sample["net_input"], outputs, 0)[0])
    vocab = lexicon_of(task, {s: [FIRST + (s % 7) * 2] for s in range(4, 28)}).vocabulary(src_tokens, FIRST, src, d)
    allowed = set(vocab.ids.tolist())
    assert len(allowed) < len(d) - 1
    features = torch.randn(2, 6, 3, model.decoder.embed_tokens.weight.size(1), dtype=torch.float64)
    with torch.no_grad():
        ranked = ranked_tokens(model.decoder, features, vocab, 3)
        logits = model.decoder.project(features)
    logits[..., d.pad()] = -math.inf
    assert torch.equal(ranked, masked_to(allowed, logits).topk(3, dim=-1)[1])
    assert set(ranked.flatten().tolist()) <= allowed and bool((ranked >= FIRST).any())
