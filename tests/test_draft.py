"""--head-type draft: one decoder layer drafts heads 2..k step by step; decoding stays exactly greedy."""
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import build, random_sample
from test_criterion import SMOOTHING, criterion, translation_batch
from test_generator import assert_same, blockwise, ending_at_block_offsets, greedy

from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd.draft_step import Waiting, decode_step
from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.heads import Proposer, decoding_logits, following_tokens
from fairseq_bpd.options import BlockwiseOptions

DRAFT = ("--head-type", "draft")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fairseq's attention takes its softmax in float32 (utils.softmax) wherever it runs with an
# incremental state or static keys, so even a float64 model's base features from decoding
# and from one full-prefix pass differ by about 1e-7 (measured; how much depends on the
# CPU's kernels). A draft fed the wrong prefix or row is off by far more.
FEATURES_ATOL = 1e-6


def draft(data_dir, block_size, *extra, seed=1, dtype=torch.float64):
    """A tiny model with a draft decoder whose output layer is random, not zero."""
    task, model, args = build(data_dir, "--block-size", str(block_size), *DRAFT, *extra, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    model.decoder.heads.fc_out.weight.data.normal_(0, 0.5, generator=generator)
    return task, model, args


def teacher_forced(model, sample, inputs, sentences=None):
    """The base's features B x T x C on decoder inputs B x T, the encoder output, and the
    draft's teacher-forced block features B x T x k x C; row r reads the source of the
    sample's sentence sentences[r] (default: of its row r)."""
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    if sentences is not None:
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, sentences)
    x, _ = model.decoder.extract_features(inputs, encoder_out=encoder_out)
    return x, encoder_out, model.decoder.heads.block_features(x, inputs=inputs, encoder_out=encoder_out)


def random_inputs(task, bsz, length, seed):
    """Decoder inputs B x T: BOS (EOS) then random words, right-padded at random lengths."""
    d = task.target_dictionary
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(d.nspecial, len(d), (bsz, length), generator=g)
    inputs[:, 0] = d.eos()
    for row, n in enumerate(torch.randint(2, length + 1, (bsz,), generator=g).tolist()):
        inputs[row, n:] = d.pad()
    return inputs


def test_the_draft_builds_and_needs_the_base_layout(data_dir):
    _, model, _ = build(data_dir, "--block-size", "3", *DRAFT)
    heads = model.decoder.heads
    assert type(heads) is DraftDecoder and not heads.independent
    assert heads.fc_out.weight.abs().sum() == 0  # every head starts as head 1
    with pytest.raises(ValueError, match="--head-type draft needs --head-layout base"):
        build(data_dir, "--block-size", "3", *DRAFT, "--head-layout", "paper")


@pytest.mark.parametrize("seed", range(2))
def test_decoding_steps_are_the_teacher_forced_steps(data_dir, seed):
    """Fed an accepted prefix in uneven chunks through its cache (rows at different
    lengths), then stepped on the reference tokens, the draft gives training's features."""
    k = 4
    task, model, _ = draft(data_dir, k, seed=seed)
    heads, d = model.decoder.heads, task.target_dictionary
    sample = random_sample(task, bsz=3, seed=seed)
    inputs = random_inputs(task, 3, 7, seed)
    x, encoder_out, block = teacher_forced(model, sample, inputs)  # block: B x T x k x C
    following = following_tokens(inputs, d.pad(), d.eos())
    lengths = inputs.ne(d.pad()).sum(1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.state = None
        heads.sync(x[:, 0], encoder_out)
        state, done = heads.state, torch.zeros(3, dtype=torch.long)
        while (done < lengths).any():
            # each row accepts 1..3 positions this block; the last of them comes with propose()
            count = torch.minimum(torch.randint(1, 4, (3,), generator=g), (lengths - done).clamp(min=1))
            m = int(count.max())
            index = (done[:, None] + torch.arange(m)).clamp(max=inputs.size(1) - 1)  # b x m
            take = lambda t: t.gather(1, index if t.dim() == 2 else index[..., None].expand(-1, -1, t.size(-1)))
            state.pending = Waiting(take(x), take(following), count - 1, int((state.length + count).max()))
            last = (done + count - 1)[:, None]
            features = x.gather(1, last[..., None].expand(-1, -1, x.size(-1)))[:, 0]
            drafted = heads.feed_accepted(state, features, following.gather(1, last)[:, 0])
            for row in range(3):
                j = int(last[row])
                if j < int(lengths[row]):
                    assert torch.allclose(drafted[row], block[row, j, 1], atol=1e-10)
            # later steps, in the columns past the prefix, read the reference tokens
            step = drafted
            for i in range(1, k - 1):
                ahead = following.gather(1, (last + i).clamp(max=inputs.size(1) - 1))
                columns = state.length[:, None] + i - 1  # b x 1
                step = decode_step(state, step, ahead[:, 0], columns, state.mask(columns, state.longest + i))
                for row in range(3):
                    j = int(last[row])
                    if j + i < int(lengths[row]):
                        assert torch.allclose(step[row], block[row, j, i + 1], atol=1e-10)
            assert state.length.tolist() == (done + count).tolist()
            done = done + count


def random_draft(data_dir, block_size, seed):
    task, model, _ = draft(data_dir, block_size, seed=seed)
    return task, model


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("bsz", [1, 7])
def test_random_drafts_give_greedy_output(data_dir, seed, bsz):
    task, model = random_draft(data_dir, 4, seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    expected = greedy(model, task, sample)
    assert_same(expected, blockwise(model, task, sample, 4)[0])
    assert_same(expected, blockwise(model, task, sample, 4, proposal_vocab=9)[0])
    assert_same(expected, blockwise(model, task, sample, 4, confidence=0.2)[0])
    assert_same(expected, blockwise(model, task, sample, 2)[0])


@pytest.mark.parametrize("bsz", [1, 7])
@pytest.mark.parametrize("confidence", [0.05, 0.3, 0.7])
def test_a_confident_draft_stops_stepping_where_the_block_is_cut(data_dir, monkeypatch, bsz, confidence):
    """Under --blockwise-confidence the draft stops after the first step at which every
    sentence falls below it: the same blocks, accepted alike, greedy's output, fewer steps."""
    import fairseq_bpd.draft as draft_module

    task, model = random_draft(data_dir, 8, 3)
    sample = random_sample(task, bsz=bsz, seed=4)
    expected = greedy(model, task, sample)
    steps, step = [], draft_module.decode_step
    monkeypatch.setattr(draft_module, "decode_step", lambda *a, **kw: steps.append(1) or step(*a, **kw))
    runs = {}
    for stops in (True, False):
        if not stops:  # every step made, as before the draft stopped early
            propose = type(model.decoder.heads).propose
            monkeypatch.setattr(type(model.decoder.heads), "propose",
                                lambda self, *a, confidence=-math.inf, **kw: propose(self, *a, **kw))
        steps.clear()
        hypos, generator = blockwise(model, task, sample, 8, confidence=confidence)
        assert_same(expected, hypos)
        runs[stops] = len(steps), generator.stats.invocations, dict(generator.stats.accepted)
    assert runs[True][1:] == runs[False][1:]
    assert runs[True][0] < runs[False][0]


def test_the_drafts_stop_and_confident_width_cut_at_the_same_sums(data_dir):
    """Confidences at the very running sums of float32 log-probs (where float64 and float32
    sums round apart): the draft stopped early and the draft that made every step give the
    same block width."""
    from fairseq_bpd.acceptance import confident_width

    task, model, _ = build(data_dir, "--block-size", "8", *DRAFT, dtype=torch.float32)
    heads, g = model.decoder.heads, torch.Generator().manual_seed(0)
    sample = random_sample(task, bsz=1, seed=1)
    encoder_out = model.encoder(**sample["net_input"])
    features, token, calls = torch.randn(1, 16, generator=g), torch.tensor([6]), {}
    heads.logits = lambda drafted, vocab: next(calls["next"])  # each step's logits, as given
    with torch.no_grad():
        for _ in range(150):
            sharp = torch.where(torch.rand(7, 1, 1, generator=g) < 0.4, 30.0, 2.0)  # some steps sure
            logits = [torch.randn(1, 24, generator=g) * s for s in sharp]
            calls["next"] = iter(logits)
            _, every = heads.propose(features, token, 8, encoder_out=encoder_out)
            tops = every[0, :, 0]
            for confidence in tops.cumsum(0).tolist() + tops.double().cumsum(0).tolist():
                calls["next"] = iter(logits)
                _, stopped = heads.propose(features, token, 8, encoder_out=encoder_out, confidence=confidence)
                assert confident_width(stopped[..., 0], confidence) == confident_width(every[..., 0], confidence)


class WatchedDraft(Proposer):
    """The model's draft, its proposals replaced by greedy's continuation where `agree` says
    (else by wrong tokens), so that blocks are accepted at every length; records each
    block's first drafted features beside its sentence and position, and the draft's own
    proposals and log-probs before they are replaced (the draft's state is kept through
    keep and reorder as sentences leave)."""

    def __init__(self, heads, references, agree, eos):
        self.heads, self.references, self.agree, self.eos = heads, references, agree, eos
        self.sentence, self.first, self.drafts, self.widths = None, [], [], []
        feed_accepted = heads.feed_accepted

        def recorded(state, features, token):
            drafted = feed_accepted(state, features, token)
            self.first.append((self.sentence.clone(), state.length.clone() - 1, drafted.clone()))
            return drafted
        heads.feed_accepted = recorded

    def propose(self, features, token, width, vocab=0, topn=1, encoder_out=None, log_probs=True,
                confidence=-math.inf):
        if self.sentence is None:
            self.sentence = torch.arange(features.size(0))
        self.widths.append(width)  # asked for; under a confidence the draft may make fewer
        # The log-probs are recorded for the teacher-forced check whether or not the caller reads them.
        proposals, lprobs = self.heads.propose(features, token, width, vocab, topn, encoder_out,
                                               confidence=confidence)
        length = self.heads.state.length  # the prefix each row has accepted, BOS included
        self.drafts.append((self.sentence.clone(), length.clone(), proposals[..., 0].clone(), lprobs[..., 0].clone(),
                            vocab))
        for row, (s, n) in enumerate(zip(self.sentence.tolist(), length.tolist())):
            ref = self.references[s].tolist() + [self.eos] * width
            right = ref[n : n + proposals.size(1)]  # under a confidence the draft may stop before width - 1
            agree = self.agree(s, n) if callable(self.agree) else self.agree
            proposals[row, :, 0] = torch.tensor(right if agree else [4 + (x - 3) % 20 for x in right])
        return proposals, lprobs if log_probs else None

    def keep(self, path, kept, features, block):
        self.heads.keep(path, kept, features, block)

    def reorder(self, rows):
        self.sentence = self.sentence[rows]
        self.heads.reorder(rows)


def eos_draft(data_dir):
    """A k=4 draft model whose greedy output ends at several offsets of a block: model, task,
    sample and greedy's hypotheses."""
    task, model = random_draft(data_dir, 4, seed=5)
    sample, expected = ending_at_block_offsets(model, task)
    return model, task, sample, expected


def assert_first_steps_teacher_forced(model, task, sample, references, proposer):
    """Each block's first draft step, as `proposer` recorded it, equals the teacher-forced
    draft recomputed on the whole prefix (greedy's outputs as decoder inputs)."""
    d = task.target_dictionary
    inputs = torch.full((len(references), max(map(len, references)) + 1), d.pad())
    for s, tokens in enumerate(references):
        inputs[s, 0] = d.eos()
        inputs[s, 1 : len(tokens) + 1] = tokens
    _, _, block = teacher_forced(model, sample, inputs)
    checked = 0
    for sentence, position, drafted in proposer.first:
        for s, j, features in zip(sentence.tolist(), position.tolist(), drafted):
            if j < len(references[s]):
                assert torch.allclose(features, block[s, j, 1], atol=FEATURES_ATOL), (s, j)
                checked += 1
    assert checked >= 2 * len(references)


def assert_proposals_teacher_forced(model, task, sample, references, proposer):
    """Every block's proposals, as the draft made them in decoding (its cache fed the accepted
    prefix block by block, its proposal columns overwritten after each rejection), are the
    teacher-forced draft's on the accepted prefix followed by those same proposals: the
    best tokens of block_features' heads 2..w, at the same log-probs."""
    d, rows = task.target_dictionary, []
    for sentence, length, tokens, lprobs, vocab in proposer.drafts:
        for s, n, proposed, scores in zip(sentence.tolist(), length.tolist(), tokens, lprobs):
            if n <= len(references[s]) and proposed.numel():  # the last accepted token is real
                rows.append((s, n, torch.cat([references[s][:n], proposed]), scores, vocab))
    inputs = torch.full((len(rows), max(len(r[2]) for r in rows) + 1), d.pad())
    for r, (_, _, tokens, _, _) in enumerate(rows):
        inputs[r, 0] = d.eos()
        inputs[r, 1 : len(tokens) + 1] = tokens
    _, _, block = teacher_forced(model, sample, inputs, torch.tensor([r[0] for r in rows]))
    for r, (s, n, tokens, scores, vocab) in enumerate(rows):
        heads = block[r, n - 1, 1 : 1 + len(scores)]  # w-1 x C: the draft's steps after entry n-1
        lprobs = decoding_logits(model.decoder, heads, vocab).log_softmax(dim=-1)
        assert torch.equal(lprobs.argmax(-1), tokens[n:]), (s, n)
        assert torch.allclose(lprobs.gather(1, tokens[n:, None])[:, 0], scores, atol=FEATURES_ATOL), (s, n)
    assert len({s for s, _, _, _, _ in rows}) == len(references)


def watched(model, task, expected, agree):
    proposer = WatchedDraft(model.decoder.heads, [e["tokens"] for e in expected], agree,
                            task.target_dictionary.eos())
    generator = BlockwiseGenerator(model, task.target_dictionary, BlockwiseOptions(max_len_b=20),
                                   proposer=proposer)
    return proposer, generator


@pytest.mark.parametrize("agree", [True, False, lambda s, n: (s + n) % 3 != 0])
def test_the_drafts_cache_follows_the_accepted_prefix_as_sentences_leave(data_dir, agree):
    """Exact at every acceptance length, the draft's state kept through keep and reorder: its
    first steps and its proposals are the teacher-forced draft's."""
    model, task, sample, expected = eos_draft(data_dir)
    proposer, generator = watched(model, task, expected, agree)
    assert_same(expected, generator.generate([model], sample))
    accepted = generator.stats.accepted
    if agree is True:
        assert max(accepted) == 4
    elif agree is False:
        assert set(accepted) == {1}
    else:
        assert len(accepted) > 2
    assert_first_steps_teacher_forced(model, task, sample, [e["tokens"] for e in expected], proposer)
    assert_proposals_teacher_forced(model, task, sample, [e["tokens"] for e in expected], proposer)
    assert len({len(rows) for rows, _, _ in proposer.first}) > 2  # sentences left at several blocks


def test_the_drafts_cache_grows_as_the_prefix_does(data_dir, monkeypatch):
    """A cache that starts with room for one entry grows, mid-proposal too, and keeps what
    it held: decoding stays exact and every proposal the teacher-forced draft's."""
    monkeypatch.setattr(DraftDecoder, "cache_columns", 1)
    model, task, sample, expected = eos_draft(data_dir)
    proposer, generator = watched(model, task, expected, lambda s, n: (s + n) % 3 != 0)
    assert_same(expected, generator.generate([model], sample))
    assert model.decoder.heads.state.kv.size(3) >= 8
    assert_proposals_teacher_forced(model, task, sample, [e["tokens"] for e in expected], proposer)


def test_a_second_batch_starts_a_fresh_draft_state(data_dir):
    """The generator tells the proposer of no new batch: the draft sees another encoder
    output and starts afresh."""
    model, task, _, _ = eos_draft(data_dir)
    agree = lambda s, n: (s + n) % 3 != 0  # noqa: E731
    # Single sentences: the batch's size tells nothing either.
    sample = random_sample(task, bsz=1, seed=4)
    proposer, generator = watched(model, task, greedy(model, task, sample), agree)
    generator.generate([model], sample)
    other = random_sample(task, bsz=1, seed=9)
    others = greedy(model, task, other)
    proposer, generator = watched(model, task, others, agree)  # the same draft, its state from before
    assert_same(others, generator.generate([model], other))
    assert_first_steps_teacher_forced(model, task, other, [e["tokens"] for e in others], proposer)


def test_max_length_inside_a_block(data_dir):
    task, model = random_draft(data_dir, 4, seed=2)
    sample = random_sample(task, bsz=5, seed=2)
    for max_len_b in (5, 6, 7):
        expected = greedy(model, task, sample, max_len_b=max_len_b)
        assert_same(expected, blockwise(model, task, sample, 4, max_len_b=max_len_b)[0])


def test_adaptive_widths_give_greedy_output(data_dir):
    task, model = random_draft(data_dir, 4, seed=3)
    sample = random_sample(task, bsz=6, seed=3)
    expected = greedy(model, task, sample)
    options = BlockwiseOptions(max_len_b=20, adaptive=True)
    generator = options.generator(model, task.target_dictionary)
    assert_same(expected, generator.generate([model], sample))


def attention_by_hand(attention, query, context, heads):
    """Multi-head attention of one query C over context rows L x C, written out."""
    q = attention.q_proj(query).view(heads, -1)  # H x d
    k = attention.k_proj(context).view(len(context), heads, -1).transpose(0, 1)  # H x L x d
    v = attention.v_proj(context).view(len(context), heads, -1).transpose(0, 1)
    weights = torch.softmax((k @ q[:, :, None])[..., 0] / q.size(1) ** 0.5, dim=-1)  # H x L
    return attention.out_proj((weights[:, :, None] * v).sum(1).reshape(-1))


def test_loss_by_hand(data_dir):
    """Step i at position j: its own earlier steps at j and step 1 at positions 0..j in its
    self-attention, the source in its encoder attention, its loss the label-smoothed
    cross-entropy against the token i+1 steps on."""
    task, model, _ = build(data_dir, "--block-size", "3", *DRAFT, "--freeze-base", seed=6)
    heads = model.decoder.heads
    torch.nn.init.normal_(heads.fc_out.weight, std=0.5)
    model.train()
    sample = translation_batch(task, bsz=3, seed=3)
    _, _, log = criterion(task)(model, sample)

    decoder, d, h = model.decoder, task.target_dictionary, 2
    target, inputs = sample["target"], sample["net_input"]["prev_output_tokens"]
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    x, _ = decoder.extract_features(inputs, encoder_out)
    enc, padding = encoder_out["encoder_out"][0], encoder_out["encoder_padding_mask"][0]
    losses, eps = {2: 0.0, 3: 0.0}, SMOOTHING / (len(d) - 1)
    for b in range(target.size(0)):
        source = enc[:, b][~padding[b]]  # S' x C
        n = int(target[b].ne(d.pad()).sum())
        entry = lambda f, t: heads.fc_in(torch.cat([f, decoder.embed_scale * decoder.embed_tokens.weight[t]]))
        first = [entry(x[b, j], target[b, j]) for j in range(n)]  # step 1's entries
        for j in range(n):
            f, context = x[b, j], [heads.self_attn_norm(z) for z in first[: j + 1]]
            for step in (1, 2):
                if j + step >= n:
                    break
                z = first[j] if step == 1 else entry(f, target[b, j + 1])
                if step == 2:
                    context.append(heads.self_attn_norm(z))
                z = z + attention_by_hand(heads.self_attn, heads.self_attn_norm(z), torch.stack(context), h)
                z = z + attention_by_hand(heads.encoder_attn, heads.encoder_attn_norm(z), source, h)
                z = z + heads.ffn2(torch.relu(heads.ffn1(heads.ffn_norm(z))))
                f = f + heads.fc_out(heads.final_norm(z))
                lprobs = torch.log_softmax(decoder.output_projection(f), dim=-1)
                goal = int(target[b, j + step])
                losses[step + 1] += -(1 - SMOOTHING - eps) * lprobs[goal] - eps * lprobs.sum()
    for head, loss in losses.items():
        assert torch.allclose(log[f"loss_h{head}"].double(), loss, rtol=1e-5), head


def test_draft_train_heads_unrolls_the_first_steps_in_training_only(data_dir):
    """--draft-train-heads 2 on a k=4 draft: training computes and trains head 2 alone, with
    the loss the full unroll gives it (a later step changes no earlier one); validation and
    decoding run all four."""
    task, model, _ = build(data_dir, "--block-size", "4", *DRAFT, "--freeze-base", "--draft-train-heads", "2", seed=6)
    _, full, _ = build(data_dir, "--block-size", "4", *DRAFT, "--freeze-base", seed=6)
    torch.nn.init.normal_(model.decoder.heads.fc_out.weight, std=0.5)
    full.load_state_dict(model.state_dict())
    sample = translation_batch(task, bsz=3, seed=3)
    model.train(), full.train()
    loss, _, log = criterion(task)(model, sample)
    _, _, full_log = criterion(task)(full, sample)
    assert "loss_h2" in log and not any(f"loss_h{h}" in log for h in (3, 4))
    assert torch.allclose(log["loss_h2"], full_log["loss_h2"], rtol=1e-12)
    loss.backward()
    assert model.decoder.heads.fc_out.weight.grad.abs().sum() > 0
    inputs = sample["net_input"]["prev_output_tokens"]
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    x, _ = model.decoder.extract_features(inputs, encoder_out)
    assert model.decoder.heads.block_features(x, inputs=inputs, encoder_out=encoder_out).size(2) == 2
    model.eval()
    assert model.decoder.heads.block_features(x, inputs=inputs, encoder_out=encoder_out).size(2) == 4
    _, _, valid_log = criterion(task)(model, sample)
    assert all(f"loss_h{h}" in valid_log for h in (2, 3, 4)) and "block_sum" in valid_log


@pytest.mark.parametrize("extra, message", [
    (("--head-type", "chained", "--draft-train-heads", "2"), "--head-type chained's heads past the first would never"),
    ((*DRAFT, "--draft-train-heads", "1"), "--draft-train-heads must be 0 .* from 2 to the model's k \\(4\\), not 1"),
    ((*DRAFT, "--draft-train-heads", "5"), "--draft-train-heads must be 0 .* not 5"),
])
def test_bad_draft_train_heads_are_refused_by_name(data_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        build(data_dir, "--block-size", "4", *extra)


@pytest.mark.parametrize("head_type", ["independent", "chained"])
def test_a_checkpoint_of_another_head_type_loads_with_a_fresh_draft(data_dir, head_type):
    _, other, _ = build(data_dir, "--block-size", "3", "--head-type", head_type)
    _, model, _ = build(data_dir, "--block-size", "3", *DRAFT, seed=2)
    model.load_state_dict(other.state_dict())  # strict: the other heads are dropped
    for key, value in other.state_dict().items():
        if ".heads." not in key:
            assert torch.equal(model.state_dict()[key], value), key
    assert model.decoder.heads.fc_out.weight.abs().sum() == 0


def test_tree_rates_are_measured_for_the_draft(data_dir):
    """scripts/tree_rates.py hands the draft the encoder output; its counts are the draft's
    teacher-forced top-1 hits on greedy's path."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from tree_rates import count_hits

    task, model = random_draft(data_dir, 4, seed=6)
    sample = random_sample(task, bsz=5, seed=6)
    outputs = [e["tokens"] for e in greedy(model, task, sample, max_len_b=8)]
    hits, trials = count_hits(model, sample["net_input"], outputs, ranks=1)
    d = task.target_dictionary
    inputs = torch.full((5, max(map(len, outputs))), d.pad())
    for s, tokens in enumerate(outputs):
        inputs[s, 0] = d.eos()
        inputs[s, 1 : len(tokens)] = tokens[:-1]
    _, _, block = teacher_forced(model, sample, inputs)
    best = model.decoder.project(block[:, :, 1:])
    best[..., d.pad()] = float("-inf")
    best = best.argmax(-1)  # B x T x k-1
    for head in range(3):
        want = sum(int(best[s, j, head]) == int(tokens[j + head + 1])
                   for s, tokens in enumerate(outputs) for j in range(len(tokens) - head - 1))
        assert int(hits[head, 0]) == want
        assert int(trials[head]) == sum(max(len(t) - head - 1, 0) for t in outputs)


def test_a_frozen_base_translates_unchanged_through_the_clis(tmp_path_factory):
    """fairseq-train fits a draft to a tiny trained model's frozen base (unrolling its first
    two heads, --draft-train-heads); fairseq-generate and fairseq-interactive with --blockwise
    then give the base's --beam 1 translations, drafting all k."""
    from cli_support import BLOCK_SIZE, PLUGIN, TRAIN, assert_same_hypotheses, hypotheses, run, summary, trained

    tiny = trained(str(tmp_path_factory.getbasetemp() / "tiny_blockwise"))
    save = tmp_path_factory.mktemp("draft")
    run("fairseq-train", tiny.data, "--user-dir", PLUGIN, "--task", "translation_blockwise",
        "--arch", "transformer_blockwise", "--block-size", BLOCK_SIZE, "--criterion", "blockwise_cross_entropy",
        *TRAIN, *DRAFT, "--freeze-base", "--draft-train-heads", 2, "--max-update", 30, "--finetune-from-model", tiny.checkpoint,
        "--disable-validation", "--save-dir", save)
    common = ("--user-dir", PLUGIN, "--task", "translation_blockwise", "--cpu", "--batch-size", 8)
    greedy_out = run("fairseq-generate", tiny.data, "--path", tiny.checkpoint, *common, "--beam", 1)
    drafted = run("fairseq-generate", tiny.data, "--path", f"{save}/checkpoint_last.pt", *common, "--blockwise",
                  "--block-size", BLOCK_SIZE)  # all k: --blockwise alone here (no width table) is width 1
    assert_same_hypotheses(hypotheses(greedy_out), hypotheses(drafted))
    assert summary(drafted).mean > 1.0  # the draft proposes what the base accepts
    assert max(summary(drafted).histogram) == 3  # its step past the trained one proposes too
    # a lexicon counted in the training pairs adds rarer tokens past a shortlist of 10 entries
    lexicon = f"{save}/lexicon.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "proposal_lexicon.py"), tiny.data, lexicon,
                    "--first", "10", "--min-count", "1"], check=True, capture_output=True)
    lexical = run("fairseq-generate", tiny.data, "--path", f"{save}/checkpoint_last.pt", *common, "--blockwise",
                  "--block-size", BLOCK_SIZE, "--blockwise-proposal-vocab", 10, "--blockwise-proposal-lexicon", lexicon)
    assert_same_hypotheses(hypotheses(greedy_out), hypotheses(lexical))
    with open(f"{tiny.raw}/test.de") as f:
        source = "".join(f.readlines()[:5])
    interactive = ("fairseq-interactive", tiny.data, *common, "--buffer-size", 8, "--source-lang", "de",
                   "--target-lang", "en")
    assert_same_hypotheses(hypotheses(run(*interactive, "--path", tiny.checkpoint, "--beam", 1, stdin=source)),
                           hypotheses(run(*interactive, "--path", f"{save}/checkpoint_last.pt", "--blockwise",
                                          stdin=source)))
