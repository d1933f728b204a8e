"""Blockwise decoding gives exactly fairseq's SequenceGenerator(beam_size=1) output."""
import math

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import build, random_sample

from fairseq_bpd.acceptance import confident_width
from fairseq_bpd.cache import IncrementalCache
from fairseq_bpd.generator import BlockwiseGenerator, FixedWidth
from fairseq_bpd.heads import Proposer
from fairseq_bpd.options import BlockwiseOptions

GREEDY_OPTIONS = ("max_len_a", "max_len_b", "min_len", "normalize_scores", "len_penalty",
                  "unk_penalty", "temperature", "no_repeat_ngram_size")


def greedy(model, task, sample, **options):
    options.setdefault("max_len_b", 20)  # random models rarely emit EOS
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=1, **options)
    return [h[0] for h in generator.generate([model], sample)]


class Oracle(BlockwiseGenerator):
    """Proposes from known greedy outputs: `agree` picks the true continuation or a wrong one."""

    def __init__(self, *args, references, agree, **kwargs):
        super().__init__(*args, **kwargs)
        self.references, self.agree = references, agree

    def next_proposals(self, features, token, encoder_out, batch):
        rows, width = [], self.policy.width(len(batch.sentence))
        for s, t in zip(batch.sentence.tolist(), batch.length.tolist()):
            ref = self.references[s].tolist() + [self.eos] * width
            row = ref[t : t + width - 1]
            if not (self.agree(s) if callable(self.agree) else self.agree):
                row = [4 + (x - 3) % 20 for x in row]  # never the reference, never a special
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long).view(len(rows), width - 1, 1)


def blockwise(model, task, sample, block_size, generator_class=BlockwiseGenerator, **options):
    options.setdefault("max_len_b", 20)
    generator = generator_class(model, task.target_dictionary, block_size=block_size, **options)
    return generator.generate([model], sample), generator


def assert_same(expected, hypos, attention=True):
    """hypos are expected's (fairseq's greedy) tokens and scores; their attention fairseq's
    too, or (attention False: a generator the task built, as the commands build it) none."""
    assert len(expected) == len(hypos)
    for e, h in zip(expected, hypos):
        h = h[0]
        assert h["tokens"].tolist() == e["tokens"].tolist()
        # fairseq keeps float32 running sums and reports their differences: compare the
        # sums, within 1e-6 relative (an ulp of a sum near 40 is 4e-6).
        running, expected_running = h["positional_scores"].cumsum(0), e["positional_scores"].cumsum(0)
        assert torch.allclose(running, expected_running, rtol=1e-6, atol=1e-6)
        assert math.isclose(float(h["score"]), float(e["score"]), rel_tol=1e-6, abs_tol=1e-6)
        if attention:
            assert torch.allclose(h["attention"], e["attention"], atol=1e-6)
        else:
            assert h["attention"].numel() == 0


@pytest.mark.parametrize("static", [True, False])
def test_without_attention_the_same_output_and_no_alignment_computed(data_dir, static):
    """attention=False (the commands' options): greedy's tokens and scores, hypo["attention"]
    empty, and no block pass made the alignment layer's weights, on either cache."""
    task, model, _ = build(data_dir, "--block-size", "4")
    model.decoder.static_cache = static
    sample = random_sample(task, bsz=5, seed=11)
    expected = greedy(model, task, sample)
    passes = []
    forward_block = model.decoder.forward_block

    def spy(*args, **kwargs):
        out = forward_block(*args, **kwargs)
        passes.append(out[1])
        return out

    model.decoder.forward_block = spy
    try:
        with_attention, _ = blockwise(model, task, sample, 3)
        seen = len(passes)
        without, _ = blockwise(model, task, sample, 3, attention=False)
    finally:
        del model.decoder.forward_block
    assert all(attn is not None for attn in passes[:seen]) and all(attn is None for attn in passes[seen:])
    for e, a, h in zip(expected, with_attention, without):
        assert h[0]["tokens"].tolist() == a[0]["tokens"].tolist() == e["tokens"].tolist()
        assert torch.equal(h[0]["positional_scores"], a[0]["positional_scores"])
        assert a[0]["attention"].numel() > 0 and h[0]["attention"].numel() == 0


@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize("block_size", [2, 4])
def test_oracle_and_adversarial_heads_give_greedy_output(data_dir, agree, block_size):
    task, model, _ = build(data_dir, "--block-size", "4")
    sample = random_sample(task, bsz=6, seed=3)
    expected = greedy(model, task, sample, max_len_b=12)
    hypos, generator = blockwise(
        model, task, sample, block_size, Oracle, max_len_b=12,
        references=[e["tokens"] for e in expected], agree=agree,
    )
    assert_same(expected, hypos)
    for e, h in zip(expected, hypos):
        m = len(e["tokens"])
        if agree:
            assert h[0]["steps"] <= math.ceil(m / block_size) + 1
        else:
            assert h[0]["steps"] == m  # one token per invocation, as greedy
    if agree:
        # Every verify pass accepts the whole block until the sentence's end.
        assert generator.stats.mean_accepted_block() > block_size - 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bsz", [1, 7])
def test_random_heads_give_greedy_output(data_dir, seed, bsz):
    task, model, _ = build(data_dir, "--block-size", "3", seed=seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    assert_same(greedy(model, task, sample), blockwise(model, task, sample, 3)[0])


@pytest.mark.parametrize("vocab,in_model", [(5, False), (9, False), (9, True)])
def test_proposals_from_a_shortlist_give_greedy_output(data_dir, vocab, in_model):
    # in_model: the model was built with --head-vocab, which decoding then uses by default.
    extra = ["--head-vocab", str(vocab)] if in_model else []
    task, model, _ = build(data_dir, "--block-size", "4", *extra, seed=2)
    sample = random_sample(task, bsz=7, seed=2)
    proposed = []

    class Recorded(BlockwiseGenerator):
        def next_proposals(self, *args):
            proposed.append(super().next_proposals(*args))
            return proposed[-1]

    hypos, _ = blockwise(model, task, sample, 4, Recorded, proposal_vocab=0 if in_model else vocab)
    assert_same(greedy(model, task, sample), hypos)
    assert max(int(p.max()) for p in proposed if p.numel()) < vocab
    assert len(task.target_dictionary) > vocab


@pytest.mark.parametrize("bsz", [1, 7])
def test_blocks_cut_by_confidence_give_greedy_output(data_dir, bsz):
    task, model, _ = build(data_dir, "--block-size", "5", seed=3)
    sample = random_sample(task, bsz=bsz, seed=3)
    expected = greedy(model, task, sample)
    widths = {}

    class Recorded(BlockwiseGenerator):
        def next_proposals(self, features, *args):
            proposals = super().next_proposals(features, *args)
            # What the cut must have kept: the longest run of joint confidence >= P.
            heads = self.model.decoder.heads.block_features(features, self.block_size)[:, 1:]
            logits = self.model.decoder.project(heads)
            logits[..., self.pad] = -math.inf
            joint = logits.log_softmax(dim=-1).max(dim=-1)[0].cumsum(dim=1)
            kept = int((joint >= self.log_confidence).sum(dim=1).max())
            assert proposals.size(1) == kept
            widths.setdefault(self.log_confidence, []).append(kept)
            return proposals

    stats = {}
    for confidence in (0.0, 1e-30, 0.05, 0.3, 1.0):
        hypos, generator = blockwise(model, task, sample, 5, Recorded, confidence=confidence)
        assert_same(expected, hypos)
        stats[confidence] = generator.stats
    assert stats[1e-30].invocations == stats[0.0].invocations
    # At P=1 no proposal is confident enough: one token per invocation, as greedy,
    # and every pass after the first (on BOS alone) is an accepted block of 1.
    tokens = sum(len(e["tokens"]) for e in expected)
    assert set(widths[math.log(1.0)]) == {0}
    assert stats[1.0].invocations == tokens
    assert dict(stats[1.0].accepted) == {1: tokens - bsz}
    cut = widths[math.log(0.3)]
    assert max(cut) > 0 and min(cut) < 4  # some blocks cut, not all to nothing


def test_confident_width_keeps_the_widest_confident_run_in_the_batch():
    best = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.9],  # joint 0.9, 0.81, 0.73, 0.66
                                   [0.5, 1.0, 1.0, 1.0],  # 0.5 throughout
                                   [0.2, 1.0, 1.0, 1.0]]))
    assert confident_width(best[:1], math.log(0.75)) == 2
    assert confident_width(best[:1], math.log(0.5)) == 4
    assert confident_width(best[1:], math.log(0.75)) == 0
    assert confident_width(best, math.log(0.75)) == 2  # the first sentence sets the width
    assert confident_width(best[1:], math.log(0.4)) == 4
    assert confident_width(best[:0], math.log(0.5)) == 0  # no sentence: nothing to propose
    # Cut at each row's first sum below, whatever follows: a log-prob above 0 (not a proposer's
    # softmax) cannot bring the row back.
    assert confident_width(torch.tensor([[-1.0, 2.0, -0.5]]), -0.5) == 0
    assert confident_width(torch.tensor([[-0.1, -1.0, 2.0]]), -0.5) == 1


def test_batch_sizes_agree_with_each_other(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4", seed=5)
    sample = random_sample(task, bsz=64, seed=5)
    together = blockwise(model, task, sample, 4, max_len_b=15)[0]
    expected = greedy(model, task, sample, max_len_b=15)
    assert_same(expected, together)
    for i in (0, 17, 63):
        one = {"id": sample["id"][i:i + 1], "net_input": {k: v[i:i + 1] for k, v in sample["net_input"].items()}}
        # A sentence alone has its own (unpadded) source length, hence max_len; compare on it.
        alone = blockwise(model, task, one, 4, max_len_b=15)[0][0][0]
        assert alone["tokens"].tolist() == greedy(model, task, one, max_len_b=15)[0]["tokens"].tolist()


@pytest.mark.parametrize(
    "options",
    [
        {"max_len_b": 3},  # the maximum length falls inside a block
        {"max_len_a": 0.5, "max_len_b": 2},
        {"min_len": 6, "max_len_b": 9},
        {"unk_penalty": -3.0},  # favour <unk>
        {"len_penalty": 0.6, "normalize_scores": True},
        {"normalize_scores": False},
        {"temperature": 0.7},
        {"no_repeat_ngram_size": 2},
    ],
)
def test_greedy_options_keep_their_meaning(data_dir, options):
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=5, seed=11)
    expected = greedy(model, task, sample, **options)
    for agree in (True, False):
        hypos, _ = blockwise(model, task, sample, 4, Oracle, references=[e["tokens"] for e in expected],
                             agree=agree, **options)
        assert_same(expected, hypos)
    assert_same(expected, blockwise(model, task, sample, 4, **options)[0])


def ending_at_block_offsets(model, task):
    """Bias a tiny k=4 model towards EOS so that its greedy output ends at several
    offsets of a block: the sample and greedy's hypotheses."""
    eos = task.target_dictionary.eos()
    # A bias on EOS makes this tiny model end sentences after 2 to 20 tokens.
    model.decoder.output_projection.register_forward_hook(
        lambda module, inputs, out: out + 0.5 * (torch.arange(out.size(-1)) == eos)
    )
    sample = random_sample(task, bsz=8, seed=4)
    expected = greedy(model, task, sample)
    assert len({len(e["tokens"]) % 4 for e in expected}) > 2, "EOS should fall at several block offsets"
    return sample, expected


def eos_ending(data_dir):
    """A k=4 model whose greedy output ends at several offsets of a block: model, task,
    sample, greedy's hypotheses and their tokens."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=5)
    sample, expected = ending_at_block_offsets(model, task)
    return model, task, sample, expected, [e["tokens"] for e in expected]


def test_eos_inside_a_block_ends_the_sentence(data_dir):
    model, task, sample, expected, references = eos_ending(data_dir)
    for agree in (True, False, lambda s: s % 2 == 0):
        hypos, _ = blockwise(model, task, sample, 4, Oracle, references=references, agree=agree)
        assert_same(expected, hypos)
    assert_same(expected, blockwise(model, task, sample, 4)[0])


def test_sentences_accepting_different_lengths_share_a_batch(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4", seed=7)
    sample = random_sample(task, bsz=9, seed=7)
    expected = greedy(model, task, sample)
    hypos, _ = blockwise(model, task, sample, 4, Oracle, references=[e["tokens"] for e in expected],
                         agree=lambda s: s % 3 != 1)
    assert_same(expected, hypos)
    steps = [h[0]["steps"] for h in hypos]
    assert steps[1] == len(expected[1]["tokens"]) and steps[0] < len(expected[0]["tokens"])


@pytest.mark.parametrize("positions", [[], ["--no-token-positional-embeddings"],
                                       ["--encoder-learned-pos", "--decoder-learned-pos"]])
def test_sinusoidal_learned_and_no_positions(data_dir, positions):
    task, model, _ = build(data_dir, "--block-size", "3", *positions, seed=6)
    sample = random_sample(task, bsz=4, seed=6)
    assert_same(greedy(model, task, sample), blockwise(model, task, sample, 3)[0])


def test_paper_head_layout(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", "--head-layout", "paper", seed=7)
    sample = random_sample(task, bsz=4, seed=7)
    assert_same(greedy(model, task, sample), blockwise(model, task, sample, 3)[0])


def test_block_size_one_is_plain_greedy(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3", seed=8)
    sample = random_sample(task, bsz=4, seed=8)
    expected = greedy(model, task, sample)
    hypos, generator = blockwise(model, task, sample, 1)
    assert_same(expected, hypos)
    assert [h[0]["steps"] for h in hypos] == [len(e["tokens"]) for e in expected]
    assert generator.stats.mean_accepted_block() == 1.0


@pytest.mark.parametrize("flags", [[], ["--decoder-learned-pos"], ["--share-decoder-input-output-embed"]])
def test_decoding_between_fairseqs_optimizer_steps_uses_the_new_weights(data_dir, flags):
    """fairseq's optimizers update p.data in place, which leaves the parameter's version
    counter and storage alone: validation with --blockwise (--eval-bleu) between training
    steps must still decode with the weights just trained, as fairseq's greedy does."""
    from fairseq.optim.adam import Adam

    task, model, _ = build(data_dir, "--block-size", "4", *flags, seed=4)
    sample = random_sample(task, bsz=5, seed=4)
    before = greedy(model, task, sample)
    assert_same(before, blockwise(model, task, sample, 4)[0])  # caches what decoding keeps
    optimizer = Adam(model.parameters(), lr=0.3)
    net_input = dict(sample["net_input"], prev_output_tokens=sample["net_input"]["src_tokens"])
    for _ in range(2):  # fairseq's Trainer: train mode for the step, eval mode to validate
        model.train()
        optimizer.zero_grad()
        logits, _ = model(**net_input)
        (-logits.log_softmax(-1)[..., 7:12].mean()).backward()
        optimizer.step()
        model.eval()
        after = greedy(model, task, sample)
        assert [e["tokens"].tolist() for e in after] != [e["tokens"].tolist() for e in before]
        assert_same(after, blockwise(model, task, sample, 4)[0])
        before = after


class RandomRuns(Oracle):
    """Proposes each sentence's true continuation for a random number of block positions,
    then wrong tokens: the sentences of a batch accept different lengths block after block.
    random_widths: each block's width is drawn too (1 to block_size), as --blockwise-adaptive
    may change it, width 1 (no proposals) included."""

    def __init__(self, *args, seed=0, random_widths=False, **kwargs):
        super().__init__(*args, agree=True, **kwargs)
        self.rng = torch.Generator().manual_seed(seed)
        if random_widths:
            self.policy = RandomWidths(self.block_size, self.rng)

    def next_proposals(self, features, token, encoder_out, batch):
        true = super().next_proposals(features, token, encoder_out, batch)  # b x w-1 x 1
        right = torch.randint(0, true.size(1) + 1, (true.size(0), 1, 1), generator=self.rng)
        return torch.where(torch.arange(true.size(1))[:, None] < right, true, 4 + (true - 3) % 20)


class RandomWidths(FixedWidth):
    """A width policy drawing each block's width (1 to block_size), width 1 often."""

    def __init__(self, block_size, rng):
        super().__init__(block_size)
        self.rng = rng

    def width(self, batch_size):
        if float(torch.rand((), generator=self.rng)) < 0.4:  # the lean path, often after wide blocks
            return 1
        return int(torch.randint(2, self.fixed + 1, (), generator=self.rng))


class CacheWatch:
    """Counts, over the crops of a decoder, those that left masked holes before kept entries
    and the compactions of a cache that had holes."""

    def __init__(self, decoder):
        self.holes = self.compactions = 0
        crop, watch = decoder.crop_cache, self

        def watched_crop(state, *args):
            lengths = crop(state, *args)
            mask = decoder.layers[0].self_attn._get_input_buffer(state)["prev_key_padding_mask"]
            if mask is not None:
                mask = mask.bool()
                assert (~mask).sum(1).tolist() == lengths.tolist()  # the unmasked entries are the prefix
                self.holes += bool((mask[:, :-1] & ~mask[:, 1:]).any())
            return lengths

        class WatchedCache(IncrementalCache):
            def compact(self, cached, old_width, holes, *args):
                watch.compactions += holes is not None
                return super().compact(cached, old_width, holes, *args)

        decoder.crop_cache = watched_crop
        decoder.cache = lambda state: WatchedCache(decoder.layers, state)


def ending_model(data_dir, block_size):
    """A model whose greedy outputs end after 4 to 41 tokens (max_len_b 40) at bsz 16, EOS
    weighted in the plain projection (no hook: decoding takes the transposed copy)."""
    task, model, _ = build(data_dir, "--block-size", str(block_size), seed=1)
    with torch.no_grad():
        model.decoder.output_projection.weight[task.target_dictionary.eos()] *= 3
    return task, model


@pytest.mark.parametrize("random_widths", [False, True])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("bsz,max_len_b", [(1, 40), (7, 40), (16, 40), (16, 9)])
def test_random_acceptance_lengths_with_holes_and_compactions_give_greedy_output(
        data_dir, block_size, bsz, max_len_b, random_widths):
    task, model = ending_model(data_dir, block_size)
    sample = random_sample(task, bsz=bsz, seed=1, max_len=20)
    expected = greedy(model, task, sample, max_len_b=max_len_b)
    watch = CacheWatch(model.decoder)
    hypos, generator = blockwise(model, task, sample, block_size, RandomRuns, max_len_b=max_len_b,
                                 references=[e["tokens"] for e in expected], seed=bsz + block_size,
                                 random_widths=random_widths)
    assert_same(expected, hypos)
    if bsz > 1 and max_len_b == 40:
        assert watch.holes > 0
        assert watch.compactions > 0 or bsz < 16 or (random_widths and block_size == 4)
    assert len(generator.stats.accepted) > 2  # blocks kept many different lengths


@pytest.mark.parametrize("options", [{"match_source_len": True}, {"min_len": 12}, {"unk_penalty": -3.0},
                                     {"temperature": 0.7}, {"max_len_a": 1.0, "max_len_b": 2},
                                     {"len_penalty": 0.6}])
def test_greedy_options_over_random_acceptance_lengths(data_dir, options):
    from fairseq.tasks.translation import TranslationTask
    from test_refusals import generation_args

    task, model = ending_model(data_dir, 6)
    sample = random_sample(task, bsz=16, seed=1, max_len=20)
    options = {"max_len_b": 40, **options}
    if options.get("match_source_len"):  # fairseq's LengthConstrainedBeamSearch, which its task builds
        constrained = TranslationTask.build_generator(task, [model], generation_args(**options))
        expected = [h[0] for h in constrained.generate([model], sample)]
    else:
        expected = greedy(model, task, sample, **options)
    watch = CacheWatch(model.decoder)
    hypos, _ = blockwise(model, task, sample, 6, RandomRuns, references=[e["tokens"] for e in expected], seed=6,
                         **options)
    assert_same(expected, hypos)
    assert watch.holes > 0


def assert_identical(hypos, others):
    """The same tokens, and scores and attention within float32 rounding (they are stored in float32)."""
    for h, o in zip(hypos, others):
        h, o = h[0], o[0]
        assert h["tokens"].tolist() == o["tokens"].tolist()
        running, other_running = h["positional_scores"].cumsum(0), o["positional_scores"].cumsum(0)
        assert torch.allclose(running, other_running, rtol=1e-6, atol=1e-6)
        assert torch.allclose(h["attention"], o["attention"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("options", [{"topk": 2}, {"min_block": 2}, {"topk": 3, "min_block": 3}])
def test_masked_holes_decode_as_gathering_every_block(data_dir, monkeypatch, options):
    """Rules that are not greedy's (--blockwise-topk, --blockwise-min-block): rejected entries
    left as masked holes decode exactly as gathering them out every block."""
    import fairseq_bpd.cache

    task, model = ending_model(data_dir, 5)
    sample = random_sample(task, bsz=16, seed=1, max_len=20)
    eos = task.target_dictionary.eos()
    # Greedy's outputs, then EOS: these rules may run past greedy's end.
    references = [torch.cat([e["tokens"], e["tokens"].new_full((45,), eos)])
                  for e in greedy(model, task, sample, max_len_b=40)]
    watch = CacheWatch(model.decoder)
    held, generator = blockwise(model, task, sample, 5, RandomRuns, max_len_b=40, references=references, seed=5,
                                **options)
    assert watch.holes > 0 and len(generator.stats.accepted) > 2
    monkeypatch.setattr(fairseq_bpd.cache, "COMPACT_AT", -1.0)  # no hole survives a block
    watch.holes = 0
    gathered, _ = blockwise(model, task, sample, 5, RandomRuns, max_len_b=40, references=references, seed=5,
                            **options)
    assert watch.holes == 0
    assert_identical(held, gathered)


@pytest.mark.parametrize("flags", [[], ["--decoder-learned-pos"], ["--share-decoder-input-output-embed"]])
def test_decoding_follows_loaded_weights_and_dtype_changes(data_dir, flags):
    """What decoding keeps of the weights (the transposed projection, the position table) is
    made again after load_state_dict and after a round trip through float32."""
    task, model, _ = build(data_dir, "--block-size", "4", *flags, seed=4)
    _, other, _ = build(data_dir, "--block-size", "4", *flags, seed=5)
    sample = random_sample(task, bsz=5, seed=4)
    before = blockwise(model, task, sample, 4)[0]  # caches
    model.load_state_dict(other.state_dict())
    # Blockwise first: fairseq's SequenceGenerator calls eval(), which drops the caches.
    hypos = blockwise(model, task, sample, 4)[0]
    expected = greedy(model, task, sample)
    assert [e["tokens"].tolist() for e in expected] != [h[0]["tokens"].tolist() for h in before]
    assert_same(expected, hypos)
    model.float()
    blockwise(model, task, sample, 4)  # caches float32 copies
    model.double()  # float32-rounded weights, in float64
    hypos = blockwise(model, task, sample, 4)[0]
    assert_same(greedy(model, task, sample), hypos)


@pytest.mark.parametrize("flags", [[], ["--decoder-learned-pos"]])
def test_outputs_as_long_as_small_max_target_positions_allow(data_dir, flags):
    """--max-target-positions 16: outputs of 15 tokens and EOS, blocks of 8 running into the
    last position (the position table is capped there)."""
    task, model, _ = build(data_dir, "--block-size", "8", "--max-target-positions", "16", *flags, seed=1)
    sample = random_sample(task, bsz=9, seed=1, max_len=14)
    expected = greedy(model, task, sample, max_len_b=200)
    assert max(len(e["tokens"]) for e in expected) == 16
    assert_same(expected, blockwise(model, task, sample, 8, max_len_b=200)[0])
    assert_same(expected, blockwise(model, task, sample, 8, max_len_b=200, tree=16)[0])
    hypos, _ = blockwise(model, task, sample, 8, RandomRuns, max_len_b=200, references=[e["tokens"] for e in expected])
    assert_same(expected, hypos)
    assert model.decoder.position_table(1).size(0) == 1 and model.decoder._position_table.size(0) == 16


def test_nan_log_probs_become_minus_inf_as_in_fairseq(data_dir):
    """fairseq's greedy turns NaN log-probs into -inf (lprobs[lprobs != lprobs] = -inf); head 1's
    log-probs do the same whether the NaNs are few (a NaN or +inf logit poisons its row's
    normaliser) or none (the finite-sum shortcut)."""
    task, model, _ = build(data_dir, "--block-size", "3", seed=3)
    generator = BlockwiseGenerator(model, task.target_dictionary, block_size=3)
    decoder, project = model.decoder, model.decoder.project
    features = torch.randn(2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    steps = torch.tensor([[1, 2, 3], [4, 5, 6]])
    poisoned = {}

    def poisoning(x, vocab=0):
        logits = project(x, vocab)
        for (row, position, word), value in poisoned.items():
            logits[row, position, word] = value
        return logits

    decoder.project = poisoning
    for poisoned in ({}, {(0, 1, 5): math.nan}, {(1, 2, 7): math.inf, (0, 0, 9): -math.inf}):
        logits = project(features)
        for (row, position, word), value in poisoned.items():
            logits[row, position, word] = value
        expected = model.get_normalized_probs((logits, None), log_probs=True)
        expected[expected != expected] = -math.inf
        expected[..., generator.pad] = -math.inf
        lprobs = generator.head1_lprobs(features, steps, None, None, 20, None, torch.tensor([5, 5]))
        assert not lprobs.isnan().any()
        assert torch.equal(lprobs, expected)
        assert lprobs.isinf().all(-1).sum() == sum(v != -math.inf for v in poisoned.values())
    del decoder.project


@pytest.mark.parametrize("flags", [[], ["--decoder-learned-pos"]])
def test_a_model_made_under_inference_mode_decodes_as_greedy(data_dir, flags):
    """Weights made or loaded under torch.inference_mode() are inference tensors, which keep no
    version counter: decoding must neither fail on them nor keep a copy that a later
    load_state_dict (in place, under inference_mode) leaves stale."""
    with torch.inference_mode():
        task, model, _ = build(data_dir, "--block-size", "4", *flags, seed=4)
        _, other, _ = build(data_dir, "--block-size", "4", *flags, seed=5)
        assert model.decoder.output_projection.weight.is_inference()
        sample = random_sample(task, bsz=5, seed=4)
        assert_same(greedy(model, task, sample), blockwise(model, task, sample, 4)[0])
        model.load_state_dict(other.state_dict())
        hypos = blockwise(model, task, sample, 4)[0]  # first: fairseq's generator calls eval()
        assert_same(greedy(model, task, sample), hypos)


def test_scores_are_float32_whatever_torchs_default_dtype(data_dir):
    """fairseq keeps its running scores in float32 (.float()) under any default dtype: so do these."""
    task, model, _ = build(data_dir, "--block-size", "4", seed=2)
    sample = random_sample(task, bsz=5, seed=2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        expected = greedy(model, task, sample)
        hypos = blockwise(model, task, sample, 4)[0]
    finally:
        torch.set_default_dtype(default)
    assert {e["positional_scores"].dtype for e in expected} == {torch.float32}
    assert {h[0]["positional_scores"].dtype for h in hypos} == {h[0]["score"].dtype for h in hypos} == {torch.float32}
    assert {h[0]["attention"].dtype for h in hypos} == {e["attention"].dtype for e in expected}
    assert_same(expected, hypos)


class RecordingProposer(Proposer):
    """A proposer with state: the sentence and committed length of each of its rows, kept in
    step through crop and reorder alone, and checked against greedy's outputs at each block."""

    def __init__(self, heads, references):
        self.heads, self.references = heads, references
        self.sentence = self.length = None
        self.reorders, self.blocks, self.log_probs = [], 0, []

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        assert self.sentence.numel() == features.size(0) == encoder_out["encoder_out"][0].size(1)
        for row, (s, n) in enumerate(zip(self.sentence.tolist(), self.length.tolist())):
            assert int(token[row]) == int(self.references[s][n - 1])  # greedy's next output: its state is right
        self.blocks += 1
        self.log_probs.append(log_probs)
        return self.heads.propose(features, token, width, vocab, topn, encoder_out, log_probs=log_probs,
                                  confidence=confidence)

    def crop(self, path, kept):
        if self.sentence is None:  # the first pass, on BOS alone
            self.sentence, self.length = torch.arange(kept.size(0)), torch.zeros_like(kept)
        assert (path[:, 0] == 0).all() and path.size(0) == kept.size(0) == self.sentence.numel()
        self.length = self.length + kept

    def reorder(self, rows):
        self.reorders.append(self.sentence[rows].tolist())
        self.sentence, self.length = self.sentence[rows], self.length[rows]


@pytest.mark.parametrize("tree", [0, 8])
def test_a_stateful_proposer_is_cropped_and_reordered_as_sentences_leave(data_dir, tree):
    model, task, sample, expected, references = eos_ending(data_dir)
    proposer = RecordingProposer(model.decoder.heads, references)
    generator = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20, tree=tree),
                                   proposer=proposer)
    assert_same(expected, generator.generate([model], sample))
    # Sentences left at several blocks; each reorder kept the sentences still decoding, in order.
    assert len(proposer.reorders) > 2 and proposer.blocks > len(proposer.reorders)
    previous = list(range(len(expected)))
    for rows in proposer.reorders:
        assert set(rows) < set(previous) and rows == sorted(rows)
        previous = rows


@pytest.mark.parametrize("confidence", [0.0, 0.2])
def test_the_proposer_is_asked_for_log_probs_only_where_confidence_reads_them(data_dir, confidence):
    model, task, sample, expected, references = eos_ending(data_dir)
    proposer = RecordingProposer(model.decoder.heads, references)
    options = BlockwiseOptions(max_len_b=20, confidence=confidence)
    generator = BlockwiseGenerator(model, task.target_dictionary, options, proposer=proposer)
    assert_same(expected, generator.generate([model], sample))
    assert proposer.log_probs and set(proposer.log_probs) == {confidence > 0}


class ProposerWithoutConfidence(RecordingProposer):
    """A proposer of the protocol before propose() took a confidence."""

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True):
        return super().propose(features, token, width, vocab, topn, encoder_out, log_probs)


def test_a_proposer_that_takes_no_confidence_still_serves_without_one(data_dir):
    model, task, sample, expected, references = eos_ending(data_dir)
    proposer = ProposerWithoutConfidence(model.decoder.heads, references)
    generator = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20), proposer=proposer)
    assert_same(expected, generator.generate([model], sample))
    assert proposer.blocks > 0
