"""--blockwise --sampling draws sentences from exactly fairseq's --sampling --beam 1 distribution.

A tiny model with 8 dictionary entries and outputs of at most 3 tokens (EOS included):
every output's probability is enumerated from fairseq's model forward in float64, and a
G test compares 20,000 samples with it. The same test passes fairseq's own sampling
(the enumeration is fairseq's distribution) and rejects deliberately wrong acceptance
rules (the test has power).
"""
import math
from collections import Counter

import pytest
import torch
from fairseq.search import Sampling
from fairseq.sequence_generator import SequenceGenerator
from scipy.stats import chi2

from conftest import build, random_sample, write_dicts
from cli_support import hypotheses, trained
from test_refusals import PrefixBlocker, generation_args

from fairseq_bpd.errors import BlockwiseRequestError
from fairseq_bpd.sampling import SpeculativeSampler, residual, sampling_probs

MAX_LEN_B = 2  # outputs of at most 3 tokens, EOS included
SAMPLES = 20_000
SOURCES = 2  # the batch alternates two sources: per-sentence acceptance, two distributions
# (name, sampling options, other generation options)
REQUESTS = {
    "plain": ({}, {}),
    "temperature 0.7": ({}, {"temperature": 0.7}),
    "top-k 3": ({"sampling_topk": 3}, {}),
    "top-p 0.8": ({"sampling_topp": 0.8}, {}),
    "unk penalty, min len 2": ({}, {"unk_penalty": 1.0, "min_len": 2}),
    # Up to 4 tokens: blocks of 3 outputs, a rejection after an accepted proposal.
    "4 tokens": ({}, {"max_len_b": 3}),
    "4 tokens, top-k 4": ({"sampling_topk": 4}, {"max_len_b": 3}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = write_dicts(str(tmp_path_factory.mktemp("data")), vocab=4)
    task, model, _ = build(data, "--block-size", "4", seed=1)
    sources = random_sample(task, SOURCES, seed=0)
    return task, model, sources


def copies(sources, n):
    """A batch of n rows cycling through the source sentences."""
    rows = torch.arange(n) % sources["net_input"]["src_tokens"].size(0)
    net_input = {key: value[rows] for key, value in sources["net_input"].items()}
    return {"id": torch.arange(n), "net_input": net_input}


def next_token_lprobs(model, task, source, prefix, temperature=1.0, unk_penalty=0.0, min_len=1,
                      max_len_b=MAX_LEN_B, no_repeat_ngram_size=0):
    """fairseq's constrained log-probs of the next output after `prefix` (float64): V.

    n-grams are blocked as fairseq's CUDA kernel blocks them (its CPU blocker never bites).
    """
    d = task.target_dictionary
    src = source[source.ne(d.pad())][None]
    encoder_out = model.encoder(src, src_lengths=torch.tensor([src.size(1)]))
    prev = torch.tensor([[d.eos(), *prefix]])
    logits = model.decoder(prev, encoder_out=encoder_out)[0][0, -1].double()
    lprobs = (logits / temperature).log_softmax(dim=-1)
    lprobs[d.pad()] = -math.inf
    lprobs[d.unk()] -= unk_penalty
    if len(prefix) >= max_len_b:
        lprobs[torch.arange(len(d)) != d.eos()] = -math.inf
    if len(prefix) < min_len:
        lprobs[d.eos()] = -math.inf
    if no_repeat_ngram_size:
        lprobs = PrefixBlocker(no_repeat_ngram_size)(prev, lprobs[None], 1, 1, len(prefix))[0]
    return lprobs


def target(lprobs, dictionary, sampling_topk=-1, sampling_topp=-1.0):
    """The distribution fairseq's Sampling draws from, written out again (top-p: its own code)."""
    if sampling_topp > 0:
        search = Sampling(dictionary, sampling_topp=sampling_topp)
        weights, indices = search._sample_topp(lprobs.clone()[None, None])
        weights = torch.zeros_like(lprobs).scatter_(0, indices[0, 0], weights[0, 0])
    elif sampling_topk > 0:
        order = lprobs.argsort(descending=True)
        weights = torch.zeros_like(lprobs)
        weights[order[:sampling_topk]] = lprobs[order[:sampling_topk]].exp()
    else:
        weights = lprobs.exp()
    return weights / weights.sum()


@torch.no_grad()
def enumerate_outputs(model, task, source, sampling, options, distributions=None):
    """{output tokens (EOS last): (probability, fairseq's positional scores)} for one source.

    distributions, a dict if given, gets each prefix's next-output distribution (V).
    """
    eos, found = task.target_dictionary.eos(), {}

    def extend(prefix, probability, scores):
        lprobs = next_token_lprobs(model, task, source, prefix, **options)
        p = target(lprobs, task.target_dictionary, **sampling)
        if distributions is not None:
            distributions[tuple(prefix)] = p
        for token in p.nonzero()[:, 0].tolist():
            entry = (probability * float(p[token]), scores + [float(lprobs[token])])
            if token == eos:
                found[(*prefix, token)] = entry
            else:
                extend([*prefix, token], *entry)

    extend([], 1.0, [])
    return found


def g_test(hypos, exact, sentence_source):
    """The G test's p-value of the outputs in `hypos` against `exact` (per source; cells
    expecting fewer than 5 merged); 0 if any output is impossible."""
    statistic, df = 0.0, 0
    for s, table in enumerate(exact):
        counts = Counter(tuple(h[0]["tokens"].tolist()) for i, h in enumerate(hypos) if sentence_source(i) == s)
        if any(output not in table for output in counts):
            return 0.0
        n = sum(counts.values())
        expected = {output: n * probability for output, (probability, _) in table.items()}
        cells = [(counts[o], e) for o, e in expected.items() if e >= 5]
        rest = [(counts[o], e) for o, e in expected.items() if e < 5]
        if rest:
            cells.append((sum(c for c, _ in rest), sum(e for _, e in rest)))
        statistic += 2 * sum(c * math.log(c / e) for c, e in cells if c > 0)
        df += len(cells) - 1
    return float(chi2.sf(statistic, df))


def sample(tiny, sampling, options, bsz=SAMPLES, calls=1, seed=0, generator_class=SpeculativeSampler, block_size=4,
           **kwargs):
    """`calls` batches of bsz blockwise samples at a fixed seed; the hypotheses and the sampler."""
    task, model, sources = tiny
    generator = torch.Generator().manual_seed(seed)
    sampler = generator_class(model, task.target_dictionary, block_size=block_size, generator=generator,
                              **sampling, **{"max_len_b": MAX_LEN_B, **options}, **kwargs)
    batch = copies(sources, bsz)
    return [h for _ in range(calls) for h in sampler.generate([model], batch)], sampler


def exact_tables(tiny, sampling, options):
    task, model, sources = tiny
    return [enumerate_outputs(model, task, src, sampling, options) for src in sources["net_input"]["src_tokens"]]


@pytest.mark.parametrize("request_", REQUESTS.values(), ids=list(REQUESTS))
def test_blockwise_samples_follow_fairseqs_distribution(tiny, request_):
    sampling, options = request_
    exact = exact_tables(tiny, sampling, options)
    hypos, sampler = sample(tiny, sampling, options)
    assert g_test(hypos, exact, lambda i: i % SOURCES) > 1e-3
    # Proposals were accepted (speculation happened), and fewer invocations than tokens.
    assert sampler.stats.mean_accepted_block() > 1.05
    assert sampler.stats.invocations < sampler.stats.tokens
    # Scores as fairseq's Sampling records them: the constrained log-prob of each drawn token.
    for i, h in enumerate(hypos[:200]):
        _, scores = exact[i % SOURCES][tuple(h[0]["tokens"].tolist())]
        assert torch.allclose(h[0]["positional_scores"].double(), torch.tensor(scores, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        assert math.isclose(float(h[0]["score"]), sum(scores) / len(scores), rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("name", ["plain", "top-p 0.8", "4 tokens"])
def test_the_enumeration_is_fairseqs_sampling_distribution(tiny, name):
    sampling, options = REQUESTS[name]
    task, model, sources = tiny
    torch.manual_seed(0)
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=1,
                                  search_strategy=Sampling(task.target_dictionary, **sampling),
                                  **{"max_len_b": MAX_LEN_B, **options})
    hypos = generator.generate([model], copies(sources, SAMPLES))
    assert g_test(hypos, exact_tables(tiny, sampling, options), lambda i: i % SOURCES) > 1e-3


class EveryProposal:
    """A wrong rule: every proposal passes."""

    def passes(self, verdict, block, tree):
        return torch.ones_like(block[:, 1:], dtype=torch.bool)


class AcceptsEverything(SpeculativeSampler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rule = EveryProposal()


class DrawsFromPAfterARejection(SpeculativeSampler):
    def correction(self, p, q):
        return p


@pytest.mark.parametrize("wrong", [AcceptsEverything, DrawsFromPAfterARejection])
@pytest.mark.parametrize("name", ["plain", "4 tokens, top-k 4"])
def test_the_test_rejects_wrong_rules(tiny, name, wrong):
    sampling, options = REQUESTS[name]
    hypos, _ = sample(tiny, sampling, options, generator_class=wrong)
    assert g_test(hypos, exact_tables(tiny, sampling, options), lambda i: i % SOURCES) < 1e-6


@pytest.mark.parametrize("bsz,calls", [(1, 1500), (64, 313)])
def test_batch_size_keeps_the_distribution(tiny, bsz, calls):
    # Batch 1 decodes source 0 only; batch 64 alternates both sources.
    hypos, _ = sample(tiny, {}, {}, bsz=bsz, calls=calls)
    assert g_test(hypos, exact_tables(tiny, {}, {}), lambda i: i % bsz % SOURCES) > 1e-3


@pytest.mark.parametrize("block_size", [1, 2])
def test_small_blocks_keep_the_distribution(tiny, block_size):
    # Block size 1: no proposal head at all, each pass draws one token from p.
    hypos, sampler = sample(tiny, {}, {}, bsz=8000, block_size=block_size)
    assert g_test(hypos, exact_tables(tiny, {}, {}), lambda i: i % SOURCES) > 1e-3
    if block_size == 1:
        assert sampler.stats.invocations == sampler.stats.tokens  # one token per pass
    else:
        assert sampler.stats.invocations < sampler.stats.tokens


def test_shortlist_and_confidence_cut_keep_the_distribution(tiny):
    hypos, sampler = sample(tiny, {"sampling_topk": 5}, {}, proposal_vocab=6, confidence=0.05)
    assert g_test(hypos, exact_tables(tiny, {"sampling_topk": 5}, {}), lambda i: i % SOURCES) > 1e-3


def nearly_exact_heads(tiny, sampling, options, base=SpeculativeSampler):
    """A sampler whose heads draw from q = 0.7 p + 0.3 uniform, p the exact distribution of
    each output after the prefix and the proposals before it (uniform after an EOS)."""
    task, model, sources = tiny
    distributions = [{} for _ in range(SOURCES)]
    for source, found in zip(sources["net_input"]["src_tokens"], distributions):
        enumerate_outputs(model, task, source, sampling, options, found)
    d = task.target_dictionary
    uniform = torch.ones(len(d), dtype=torch.float64).index_fill_(0, torch.tensor([d.pad()]), 0.0)
    uniform /= uniform.sum()

    class NearlyExactHeads(base):
        def next_proposals(self, features, token, encoder_out, batch):
            q = torch.zeros(features.size(0), self.block_size - 1, len(d))  # b x k-1 x V
            proposals = torch.zeros(*q.shape[:2], 1, dtype=torch.long)
            for row, (s, n) in enumerate(zip(batch.sentence.tolist(), batch.length.tolist())):
                prefix = tuple(batch.tokens[row, 1 : n + 1].tolist())
                for j in range(q.size(1)):
                    q[row, j] = 0.7 * distributions[s % SOURCES].get(prefix, uniform) + 0.3 * uniform
                    proposals[row, j] = torch.multinomial(q[row, j], 1, generator=self.generator)
                    prefix += (int(proposals[row, j]),)
            self.draft = q
            return proposals

    return NearlyExactHeads


@pytest.mark.parametrize("sampling,options", [({}, {"max_len_b": 3}),
                                              ({"sampling_topk": 4}, {"max_len_b": 4, "min_len": 2})],
                         ids=["4 tokens", "5 tokens, top-k 4, min len 2"])
def test_heads_close_to_p_keep_the_distribution(tiny, sampling, options):
    # The random heads rarely pass a proposal; these pass most: whole blocks, EOS and
    # the length limit inside them, rejections deep in a block.
    exact = exact_tables(tiny, sampling, options)
    hypos, sampler = sample(tiny, sampling, options, bsz=8000,
                            generator_class=nearly_exact_heads(tiny, sampling, options))
    assert g_test(hypos, exact, lambda i: i % SOURCES) > 1e-3
    assert sampler.stats.mean_accepted_block() > 2.2
    wrong = nearly_exact_heads(tiny, sampling, options, base=DrawsFromPAfterARejection)
    assert g_test(sample(tiny, sampling, options, generator_class=wrong)[0], exact, lambda i: i % SOURCES) < 1e-6


class BlocksNgramsAsCuda(SpeculativeSampler):
    """The sampler with fairseq's CUDA kernel's n-gram blocking, which bites on the CPU too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.repeat_ngram_blocker = PrefixBlocker(self.repeat_ngram_blocker.no_repeat_ngram_size)


@pytest.mark.parametrize("sampling", [{}, {"sampling_topk": 4}], ids=["plain", "top-k 4"])
def test_ngram_blocking_that_bites_keeps_the_distribution(tiny, sampling):
    # Blocks of 4 outputs with EOS proposed inside: after an accepted EOS, head 1's
    # distribution can be empty (EOS and the rest blocked), and the block must end there.
    options = {"max_len_b": 4, "no_repeat_ngram_size": 2}
    exact = exact_tables(tiny, sampling, options)
    hypos, sampler = sample(tiny, sampling, options, bsz=8000, generator_class=BlocksNgramsAsCuda)
    assert g_test(hypos, exact, lambda i: i % SOURCES) > 1e-3
    assert sampler.stats.mean_accepted_block() > 1.05


def test_an_accepted_eos_ends_the_block(tiny):
    # Proposals EOS then w: EOS passes surely (p = q = 1 there); after it head 1 has nothing
    # left (all -inf, as when n-gram blocking bans EOS past the maximum length).
    task, model, _ = tiny
    d = task.target_dictionary
    sampler = SpeculativeSampler(model, d, block_size=3, generator=torch.Generator().manual_seed(0))
    w = d.nspecial
    eos_only = torch.full((len(d),), -math.inf).index_fill_(0, torch.tensor([d.eos()]), 0.0)
    lprobs = torch.stack([eos_only, torch.full((len(d),), -math.inf), eos_only])[None]  # 1 x 3 x V
    sampler.draft = torch.stack([eos_only.exp(), torch.eye(len(d))[w]])[None]  # 1 x 2 x V
    block = torch.tensor([[w, d.eos(), w]])
    node, kept, outputs, scores, added, finished = sampler.verify_block(
        lprobs, block, torch.tensor([-1.5]), torch.tensor([10]), sampler.layout)
    assert finished.tolist() == [True] and added.tolist() == [1]
    assert outputs[0, 0] == d.eos() and scores[0, 0] == -1.5


def test_sampling_refuses_match_source_len_as_fairseq_does(tiny):
    # fairseq's build_generator: "Provided Search parameters are mutually exclusive."
    task, model, _ = tiny
    task.cfg.blockwise = True
    try:
        with pytest.raises(BlockwiseRequestError, match="--match-source-len.*--sampling"):
            task.build_generator([model], generation_args(sampling=True, match_source_len=True))
    finally:
        task.cfg.blockwise = False


def test_a_seed_reproduces_a_run(tiny):
    def outputs(seed):
        return [h[0]["tokens"].tolist() for h in sample(tiny, {}, {}, bsz=200, seed=seed)[0]]

    assert outputs(3) == outputs(3)
    assert outputs(3) != outputs(4)
    # Without a generator: torch's global one, which fairseq-generate seeds with --seed.
    task, model, sources = tiny
    sampler = SpeculativeSampler(model, task.target_dictionary, block_size=4, max_len_b=MAX_LEN_B)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([h[0]["tokens"].tolist() for h in sampler.generate([model], copies(sources, 200))])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("rule", [{"topk": 2}, {"min_block": 2}, {"tree": 4}])
def test_the_sampler_refuses_rules_that_change_the_distribution(tiny, rule):
    task, model, _ = tiny
    with pytest.raises(BlockwiseRequestError, match="--sampling: .*lossless"):
        SpeculativeSampler(model, task.target_dictionary, block_size=4, **rule)


def test_residual_is_the_positive_part_of_p_minus_q():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.2, 0.5, 0.1, 0.2]])
    assert torch.equal(residual(p, q), torch.tensor([[0.3, 0.0, 0.1, 0.0]]))
    assert torch.equal(residual(p, p), p)  # nothing is rejected then; p stands in


def test_sampling_probs_is_fairseqs_support(tiny):
    d = tiny[0].target_dictionary
    lprobs = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()[None, None]
    two = torch.tensor([[[0.5, 0.25, 0, 0]]])
    assert torch.allclose(sampling_probs(lprobs, Sampling(d, sampling_topk=2)), two)
    assert torch.allclose(sampling_probs(lprobs, Sampling(d, sampling_topp=0.6)), two)
    assert torch.allclose(sampling_probs(lprobs, Sampling(d, sampling_topp=0.45)), torch.tensor([[[0.5, 0, 0, 0]]]))
    assert torch.allclose(sampling_probs(lprobs, Sampling(d)), lprobs.exp())


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    return trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))


def test_generate_samples_through_the_cli(trained_tiny):
    from test_reliability import generate

    def run(seed, *extra):
        return generate(trained_tiny, "--blockwise", "--sampling", "--beam", 1, "--seed", seed,
                        "--batch-size", 8, *extra)

    first, again, other = run(1, "--sampling-topk", 5), run(1, "--sampling-topk", 5), run(2, "--sampling-topk", 5)
    assert len(hypotheses(first)) == 20
    assert hypotheses(first) == hypotheses(again)
    assert hypotheses(first) != hypotheses(other)
    assert len(hypotheses(run(1, "--sampling-topp", 0.9, "--temperature", 0.7))) == 20


def test_interactive_samples_through_the_cli(trained_tiny):
    from test_reliability import interactive

    with open(f"{trained_tiny.raw}/test.de") as f:
        lines = "".join(f.readlines()[:6])

    def run(seed):
        return hypotheses(interactive(trained_tiny, "--blockwise", "--sampling", "--beam", 1, "--seed", seed,
                                      "--sampling-topp", 0.9, "--buffer-size", 4, "--batch-size", 4, stdin=lines))

    first = run(1)
    assert sorted(first) == list(range(6))
    assert run(1) == first
    assert run(2) != first


def test_masked_holes_sample_as_gathering_every_block(data_dir, monkeypatch):
    """Longer outputs whose sentences accept different lengths: rejected entries left in the
    cache as masked holes draw the same sentences, at one seed, as gathering them out every block."""
    import fairseq_bpd.cache
    from test_generator import CacheWatch, assert_identical, ending_model

    task, model = ending_model(data_dir, 5)
    batch = random_sample(task, bsz=16, seed=1, max_len=20)

    def draw_all():
        sampler = SpeculativeSampler(model, task.target_dictionary, block_size=5, max_len_b=40,
                                     generator=torch.Generator().manual_seed(0))
        return sampler.generate([model], batch), sampler

    watch = CacheWatch(model.decoder)
    held, sampler = draw_all()
    assert watch.holes > 0 and len(sampler.stats.accepted) > 2
    monkeypatch.setattr(fairseq_bpd.cache, "COMPACT_AT", -1.0)  # no hole survives a block
    watch.holes = 0
    gathered, _ = draw_all()
    assert watch.holes == 0
    assert_identical(held, gathered)


@pytest.mark.parametrize("head_type", ["chained", "draft"])
def test_sampling_with_heads_that_read_tokens_is_refused_naming_their_type(data_dir, head_type):
    task, model, _ = build(data_dir, "--block-size", "4", "--head-type", head_type)
    with pytest.raises(BlockwiseRequestError, match=f"heads are --head-type {head_type}$"):
        SpeculativeSampler(model, task.target_dictionary, block_size=4)
