"""--head-type chained: head i reads the token head i-1 predicts; decoding stays exactly greedy."""
import pytest
import torch
import torch.nn.functional as F
from fairseq.data import LanguagePairDataset

from conftest import build, random_sample
from test_criterion import SMOOTHING, criterion, translation_batch
from test_generator import Oracle, assert_same, blockwise, greedy

from fairseq_bpd.generator import BlockwiseGenerator
from fairseq_bpd.heads import ChainedHeads, ProposalHeads, best_tokens, following_tokens

CHAINED = ("--head-type", "chained")


def chained(data_dir, block_size, *extra, seed=1, dtype=torch.float64):
    """A tiny model with chained heads whose output layers are random, not zero."""
    task, model, args = build(data_dir, "--block-size", str(block_size), *CHAINED, *extra, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    for fc_out in model.decoder.heads.fc_out:
        fc_out.weight.data.normal_(0, 0.5, generator=generator)
    return task, model, args


@pytest.mark.parametrize("left_pad", [False, True])
def test_following_tokens_are_the_targets(data_dir, left_pad):
    task, _, _ = build(data_dir, "--block-size", "2")
    d = task.target_dictionary
    sentences = [torch.tensor([5, 6, 7, d.eos()]), torch.tensor([8, d.eos()]), torch.tensor([9, 10, d.eos()])]
    dataset = LanguagePairDataset(sentences, [len(s) for s in sentences], d, sentences,
                                  [len(s) for s in sentences], d, left_pad_target=left_pad)
    batch = dataset.collater([dataset[i] for i in range(3)])
    following = following_tokens(batch["net_input"]["prev_output_tokens"], d.pad(), d.eos())
    assert following.tolist() == batch["target"].tolist()


def test_default_is_independent_and_chained_needs_the_base_layout(data_dir):
    _, model, args = build(data_dir, "--block-size", "3")
    assert args.head_type == "independent" and type(model.decoder.heads) is ProposalHeads
    _, model, _ = build(data_dir, "--block-size", "3", *CHAINED)
    assert type(model.decoder.heads) is ChainedHeads and len(model.decoder.heads.fc_in) == 2
    with pytest.raises(ValueError, match="--head-type chained needs --head-layout base"):
        build(data_dir, "--block-size", "3", *CHAINED, "--head-layout", "paper")


def test_loss_by_hand(data_dir):
    """Head i's features follow the reference tokens: f_i = f + W2 relu(W1 [f; scale * E y])."""
    task, model, _ = chained(data_dir, 3)
    decoder, pad = model.decoder, task.target_dictionary.pad()
    sample = translation_batch(task, bsz=4, seed=2)
    loss, _, log = criterion(task, head1_weight=2.0)(model, sample)

    target = sample["target"]
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"])
    x, _ = decoder.extract_features(sample["net_input"]["prev_output_tokens"], encoder_out)
    heads, features, total = decoder.heads, [x], 0.0
    for i in range(2):
        ahead = torch.full_like(target, pad)
        ahead[:, : target.size(1) - i] = target[:, i:]  # the token head i+1 predicts
        embedded = decoder.embed_scale * decoder.embed_tokens.weight[ahead]
        hidden = F.relu(heads.fc_in[i](torch.cat([features[-1], embedded], dim=-1)))
        features.append(features[-1] + heads.fc_out[i](hidden))
    vocab = len(task.target_dictionary)
    for i, f in enumerate(features):
        goal = torch.full_like(target, pad)
        goal[:, : target.size(1) - i] = target[:, i:]
        lprobs = F.log_softmax(f @ decoder.output_projection.weight.t(), dim=-1)
        mask = goal.ne(pad)
        nll = -lprobs.gather(2, goal[..., None])[..., 0][mask].sum()
        smooth = -lprobs.sum(-1)[mask].sum()
        eps = SMOOTHING / (vocab - 1)
        head_loss = (1 - SMOOTHING - eps) * nll + eps * smooth
        # fairseq's log-softmax runs in float32
        assert torch.allclose(log[f"loss_h{i + 1}"].double(), head_loss, rtol=1e-5)
        assert log[f"n_correct_h{i + 1}"] == int(lprobs.argmax(-1).eq(goal)[mask].sum())
        total = total + (2.0 if i == 0 else 1.0) * head_loss
    assert torch.allclose(loss.double(), total / 4, rtol=1e-5)


@pytest.mark.parametrize("vocab", [0, 9])
def test_propose_follows_the_teacher_forced_chain(data_dir, vocab):
    """Decoding's chain (each head reads its predecessor's proposal) is training's chain
    when the reference tokens are those proposals."""
    task, model, _ = chained(data_dir, 4, seed=3)
    heads, eos = model.decoder.heads, task.target_dictionary.eos()
    torch.manual_seed(0)
    x = torch.randn(5, 6, 16, dtype=torch.float64)  # any decoder features B x T x C
    first = torch.randint(4, 28, (5,))
    proposals, lprobs = heads.propose(x[:, 2], first, 4, vocab, topn=2)  # b x 3 x 2
    assert proposals.shape == lprobs.shape == (5, 3, 2)
    assert (lprobs[..., 0] >= lprobs[..., 1]).all()
    inputs = torch.randint(4, 28, (5, 6))
    inputs[:, 0] = eos
    inputs[:, 3] = first  # the token after position 2, then the chain's proposals
    inputs[:, 4:6] = proposals[:, :2, 0]
    block = heads.block_features(x, inputs=inputs)[:, 2]  # b x 4 x C
    logits = model.decoder.project(block[:, 1:], vocab)
    logits[..., task.target_dictionary.pad()] = float("-inf")
    assert logits.argmax(-1).tolist() == proposals[..., 0].tolist()
    if vocab:
        assert int(proposals.max()) < vocab


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bsz", [1, 7])
def test_random_chained_heads_give_greedy_output(data_dir, seed, bsz):
    task, model, _ = chained(data_dir, 4, seed=seed)
    sample = random_sample(task, bsz=bsz, seed=seed)
    expected = greedy(model, task, sample)

    class Recorded(BlockwiseGenerator):
        def next_proposals(self, features, token, encoder_out, batch):
            # The chain starts from head 1's greedy token after the last accepted position.
            for row, (s, t) in enumerate(zip(batch.sentence.tolist(), batch.length.tolist())):
                assert int(token[row]) == int(batch.tokens[row, t]) == int(expected[s]["tokens"][t - 1])
                checked.append(s)
            return super().next_proposals(features, token, encoder_out, batch)

    checked = []
    hypos, generator = blockwise(model, task, sample, 4, Recorded)
    assert_same(expected, hypos)
    assert set(checked) == set(range(bsz))
    assert_same(expected, blockwise(model, task, sample, 4, proposal_vocab=9)[0])
    assert_same(expected, blockwise(model, task, sample, 4, confidence=0.2)[0])
    assert_same(expected, blockwise(model, task, sample, 2)[0])


@pytest.mark.parametrize("agree", [True, False, lambda s: s % 2 == 0])
def test_oracle_and_adversarial_proposals_with_chained_heads(data_dir, agree):
    task, model, _ = chained(data_dir, 4, seed=4)
    sample = random_sample(task, bsz=6, seed=4)
    expected = greedy(model, task, sample, max_len_b=12)
    hypos, generator = blockwise(model, task, sample, 4, Oracle, max_len_b=12,
                                 references=[e["tokens"] for e in expected], agree=agree)
    assert_same(expected, hypos)
    if agree is True:
        assert generator.stats.mean_accepted_block() > 3


def test_trained_chained_heads_accept_more_than_one_token(data_dir):
    """Heads fitted to the model's own greedy output propose it: whole blocks are accepted."""
    task, model, _ = chained(data_dir, 3, "--freeze-base", seed=5, dtype=torch.float32)
    sample = random_sample(task, bsz=8, seed=5)
    expected = greedy(model.eval(), task, sample, max_len_b=10)
    src = sample["net_input"]["src_tokens"]
    d = task.target_dictionary
    targets = [e["tokens"] for e in expected]
    dataset = LanguagePairDataset([s[s.ne(d.pad())] for s in src], sample["net_input"]["src_lengths"], d,
                                  targets, [len(t) for t in targets], d)
    batch = dataset.collater([dataset[i] for i in range(8)])
    loss_fn = criterion(task)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.02)
    model.train()
    for _ in range(150):
        optimizer.zero_grad()
        loss_fn(model, batch)[0].backward()
        optimizer.step()
    model.eval()
    hypos, generator = blockwise(model.double(), task, sample, 3, max_len_b=10)
    assert_same(greedy(model, task, sample, max_len_b=10), hypos)
    assert generator.stats.mean_accepted_block() > 2.0


def test_independent_checkpoint_loads_with_fresh_chained_heads(data_dir):
    _, independent, _ = build(data_dir, "--block-size", "3")
    _, model, _ = build(data_dir, "--block-size", "3", *CHAINED, seed=2)
    model.load_state_dict(independent.state_dict())  # strict: the independent heads are dropped
    for key, value in independent.state_dict().items():
        if ".heads." not in key:
            assert torch.equal(model.state_dict()[key], value), key
    assert all(fc_out.weight.abs().sum() == 0 for fc_out in model.decoder.heads.fc_out)


def test_a_config_from_before_head_type_builds_independent_heads(data_dir):
    from conftest import parse
    from fairseq import tasks

    args = parse(data_dir, "--block-size", "3")
    del args.head_type  # as in checkpoints saved before --head-type existed
    model = tasks.setup_task(args).build_model(args)
    assert args.head_type == "independent" and type(model.decoder.heads) is ProposalHeads


def test_tree_rates_are_measured_for_chained_heads(data_dir):
    """scripts/tree_rates.py counts each head's rank-r hits teacher-forced on greedy's outputs:
    chained heads read greedy's path, as a Hydra tree's node reads its accepted parent's token."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from tree_rates import count_hits

    task, model, _ = chained(data_dir, 4, seed=6)
    sample = random_sample(task, bsz=5, seed=6)
    outputs = [e["tokens"] for e in greedy(model, task, sample, max_len_b=8)]
    hits, trials = count_hits(model, sample["net_input"], outputs, ranks=3)
    # The same counts, position by position: heads 2..4 after greedy's prefix, each reading
    # greedy's token before the one it predicts.
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    expected_hits, expected_trials = torch.zeros_like(hits), torch.zeros_like(trials)
    eos = task.target_dictionary.eos()
    with torch.no_grad():
        for i, output in enumerate(outputs):
            one = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([i]))
            features, _ = model.decoder.extract_features(torch.cat([torch.tensor([eos]), output[:-1]])[None], one)
            for t in range(len(output)):
                f = features[:, t]
                for h in range(min(3, len(output) - t - 1)):
                    f = model.decoder.heads.link(h, f, output[t + h : t + h + 1])
                    proposals = best_tokens(model.decoder, f, 0, 3)[0][0]
                    expected_trials[h] += 1
                    expected_hits[h] += (proposals == output[t + h + 1]).long()
    assert trials.tolist() == expected_trials.tolist() and trials.min() > 0
    assert hits.tolist() == expected_hits.tolist() and hits.sum() > 0
