"""blockwise_cross_entropy: head i learns token t+i-1, and k=1 is fairseq's own loss."""
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq import metrics
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.data import LanguagePairDataset

from conftest import build

from fairseq_bpd.criterion import BlockwiseCrossEntropyCriterion, shift_target, teacher_forced_block

SMOOTHING = 0.1


def translation_batch(task, bsz, seed, min_len=1, max_len=7):
    """A batch of random pairs as fairseq collates them (left-padded source, prev_output_tokens)."""
    rng = random.Random(seed)
    d = task.target_dictionary

    def sentence():
        words = [rng.randrange(d.nspecial, len(d)) for _ in range(rng.randint(min_len, max_len))]
        return torch.tensor(words + [d.eos()])

    src, tgt = [sentence() for _ in range(bsz)], [sentence() for _ in range(bsz)]
    dataset = LanguagePairDataset(
        src, [len(s) for s in src], task.source_dictionary, tgt, [len(t) for t in tgt], d
    )
    return dataset.collater([dataset[i] for i in range(bsz)])


def criterion(task, **kwargs):
    kwargs.setdefault("report_accuracy", True)
    return BlockwiseCrossEntropyCriterion(task, False, SMOOTHING, **kwargs)


class OracleHeads(torch.nn.Module):
    """Head i's logits pick `answers[i]` (B x T): a model right exactly where it is told to be."""

    def __init__(self, answers, vocab, margin=40.0):
        super().__init__()
        self.features = torch.stack([F.one_hot(a, vocab).double() * margin for a in answers], dim=2)
        self.decoder = SimpleNamespace(output_layer=lambda x: x)  # features are logits

    def forward(self, **net_input):
        return self.features[:, :, 0], {"block_features": self.features}  # B x T x V, B x T x k x V

    def get_targets(self, sample, net_output):
        return sample["target"]

    def get_normalized_probs(self, net_output, log_probs):
        return F.log_softmax(net_output[0], dim=-1)


@pytest.mark.parametrize("layout", ["base", "paper"])
def test_one_head_is_label_smoothed_cross_entropy(data_dir, layout):
    task, model, _ = build(data_dir, "--block-size", "1", "--head-layout", layout)
    sample = translation_batch(task, 6, seed=3)
    expected = LabelSmoothedCrossEntropyCriterion(task, False, SMOOTHING, report_accuracy=True)
    loss, sample_size, log = criterion(task)(model, sample)
    loss_ls, sample_size_ls, log_ls = expected(model, sample)
    assert sample_size == sample_size_ls == sample["ntokens"]
    assert torch.equal(loss, loss_ls)
    for key in ("loss", "nll_loss", "ntokens", "nsentences", "n_correct", "total"):
        assert log[key] == log_ls[key], key


def test_shift_target():
    target = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]])  # pad 1, eos 2
    assert shift_target(target, 0, pad=1) is target
    assert shift_target(target, 1, pad=1).tolist() == [[6, 7, 2, 1], [9, 2, 1, 1]]
    assert shift_target(target, 2, pad=1).tolist() == [[7, 2, 1, 1], [2, 1, 1, 1]]


def test_head_i_is_trained_on_token_t_plus_i_minus_1(data_dir):
    task, _, _ = build(data_dir, "--block-size", "3")
    sample = translation_batch(task, 5, seed=4)
    target, pad, vocab = sample["target"], task.target_dictionary.pad(), len(task.target_dictionary)
    no_smoothing = BlockwiseCrossEntropyCriterion(task, False, 0.0)  # loss_h* is then the nll
    right = OracleHeads([shift_target(target, i, pad) for i in range(3)], vocab)
    _, _, log = no_smoothing(right, sample)
    for h in (1, 2, 3):
        assert log[f"loss_h{h}"] < 1e-6
        ntokens = int(shift_target(target, h - 1, pad).ne(pad).sum())
        assert log[f"n_correct_h{h}"] == log[f"ntokens_h{h}"] == ntokens
    # Head 3 answering head 2's token (t+1, not t+2) is wrong almost everywhere.
    off_by_one = OracleHeads([shift_target(target, i, pad) for i in (0, 1, 1)], vocab)
    _, _, log = no_smoothing(off_by_one, sample)
    assert log["loss_h2"] < 1e-6
    assert log["n_correct_h3"] < log["ntokens_h3"] / 2
    assert log["loss_h3"] > 10 * log["ntokens_h3"]


def test_teacher_forced_block():
    valid = torch.tensor([[True] * 5 + [False]])
    # Head 1's predictions are the reference r0..r4; every head right: decoding's blocks
    # start at 0 (3 tokens) and 3 (the 2 left).
    reference = torch.tensor([[10, 11, 12, 13, 14, 0]])
    perfect = torch.stack([shift_target(reference, i, 0) for i in range(3)], dim=-1)  # 1 x 6 x 3
    assert [int(v) for v in teacher_forced_block(perfect, valid)] == [3 + 2, 2]
    # Head 2 wrong at t=1, where no block starts: nothing changes.
    skipped = perfect.clone()
    skipped[0, 1, 1] = 99
    assert [int(v) for v in teacher_forced_block(skipped, valid)] == [3 + 2, 2]
    # Head 2 wrong at t=0: that block stops at 1 (head 3 right after it does not count),
    # the next starts at 1 (3 tokens), the last at 4.
    wrong = perfect.clone()
    wrong[0, 0, 1] = 99
    assert [int(v) for v in teacher_forced_block(wrong, valid)] == [1 + 3 + 1, 3]


def test_teacher_forced_block_is_decodings_mean_block():
    """Blocks where decoding makes them, not at every position: random heads, and the walk
    by hand (a block of `a` tokens at t, the next at t + a)."""
    torch.manual_seed(0)
    # Right and left padding, and a pad inside a sentence (the text's own "<pad>").
    valid = torch.tensor([[True] * 9 + [False] * 3, [False] * 2 + [True] * 10, [True] * 4 + [False] + [True] * 7])
    predictions = torch.randint(5, 8, (3, 12, 4))
    total, blocks = teacher_forced_block(predictions, valid)
    expected_total = expected_blocks = 0
    for b in range(3):
        t = 0
        while t < 12:
            if not valid[b, t]:
                t += 1
                continue
            a = 1
            while a < 4 and t + a < 12 and valid[b, t + a] and predictions[b, t, a] == predictions[b, t + a, 0]:
                a += 1
            expected_total, expected_blocks, t = expected_total + a, expected_blocks + 1, t + a
    assert (int(total), int(blocks)) == (expected_total, expected_blocks)
    assert expected_total == int(valid.sum())  # every token in one block
    assert expected_blocks < expected_total  # some block held more than one token


def test_padded_batch_is_the_sum_of_its_sentences(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3")
    sample = translation_batch(task, 4, seed=5)
    assert sample["target"].eq(task.target_dictionary.pad()).any()
    crit = criterion(task)
    loss, _, log = crit(model, sample)
    parts = []
    for b in range(4):
        net_input = {key: value[b : b + 1] for key, value in sample["net_input"].items()}
        length = int(sample["target"][b].ne(task.target_dictionary.pad()).sum())
        width = int(sample["net_input"]["src_lengths"][b])
        net_input["src_tokens"] = net_input["src_tokens"][:, -width:]  # drop left padding
        net_input["prev_output_tokens"] = net_input["prev_output_tokens"][:, :length]
        target = sample["target"][b : b + 1, :length]
        parts.append(crit(model, {"net_input": net_input, "target": target, "ntokens": length}))
    # fairseq takes the log-softmax in float32, whatever the model's dtype.
    assert torch.allclose(loss, sum(p[0] for p in parts), rtol=1e-6)
    for key in log:
        total = sum(p[2][key] for p in parts)
        if torch.is_tensor(total):
            assert torch.allclose(log[key], total, rtol=1e-6), key
        else:
            assert log[key] == total, key


def test_reduced_logs_have_every_head_and_the_block_estimate(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3")
    logs = [criterion(task)(model, translation_batch(task, 3, seed))[2] for seed in (6, 7)]
    with metrics.aggregate() as aggregate:
        BlockwiseCrossEntropyCriterion.reduce_metrics(logs)
    values = aggregate.get_smoothed_values()
    for h in (1, 2, 3):
        ntokens = sum(log[f"ntokens_h{h}"] for log in logs)
        loss = sum(float(log[f"loss_h{h}"]) for log in logs) / ntokens / math.log(2)
        correct = sum(log[f"n_correct_h{h}"] for log in logs)
        assert values[f"loss_h{h}"] == pytest.approx(loss, abs=1e-3)
        assert values[f"acc_h{h}"] == pytest.approx(100 * correct / ntokens, abs=1e-2)
    assert "loss_h4" not in values
    block = sum(log["block_sum"] for log in logs) / sum(log["block_count"] for log in logs)
    assert 1 <= values["block"] <= 3
    assert values["block"] == pytest.approx(block, abs=1e-3)
    assert {"loss", "nll_loss", "ppl", "accuracy"} <= set(values)


def test_random_head_trains_one_head_per_batch(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4", "--head-layout", "paper")
    model.train()  # dropout is 0
    crit, sample = criterion(task, random_head=True), translation_batch(task, 4, seed=8)
    fc2 = model.decoder.heads.fc2
    drawn, keys = set(), set()
    torch.manual_seed(0)
    for _ in range(12):
        model.zero_grad()
        loss, _, log = crit(model, sample)
        # Every head's keys, in one order, whichever was drawn: fairseq sums by the first log's keys.
        keys.add(tuple(log))
        trained = [h for h in (1, 2, 3, 4) if log[f"ntokens_h{h}"] > 0]
        assert len(trained) == 1
        h = trained[0]
        assert torch.equal(loss, log[f"loss_h{h}"])
        for other in {1, 2, 3, 4} - {h}:
            assert [log[f"{key}_h{other}"] for key in ("loss", "ntokens", "n_correct", "total")] == [0] * 4
        full = criterion(task)(model, sample)[2]
        assert torch.allclose(log["nll_loss"], full["nll_loss"])  # head 1's nll, whichever head
        assert (log["n_correct"], log["total"]) == (full["n_correct"], full["total"])  # and accuracy
        loss.backward()
        # fc2's output rows are the heads' slices: only the drawn head's get a gradient.
        rows = fc2.weight.grad.view(4, -1).abs().sum(dim=1)
        assert [i + 1 for i in range(4) if rows[i] > 0] == [h]
        drawn.add(h)
    assert len(drawn) > 1 and len(keys) == 1
    model.eval()  # validation scores every head
    _, _, log = crit(model, sample)
    assert {f"loss_h{h}" for h in (1, 2, 3, 4)} <= set(log) and "block_sum" in log


def test_head_vocab_trains_heads_2_to_k_on_a_shortlist(data_dir):
    vocab = 12
    task, model, _ = build(data_dir, "--block-size", "3", "--head-vocab", str(vocab))
    sample = translation_batch(task, 6, seed=9)
    target, pad = sample["target"], task.target_dictionary.pad()
    assert target.ge(vocab).any() and target.lt(vocab).logical_and(target.ne(pad)).any()
    _, _, log = criterion(task)(model, sample)
    for h in (2, 3):  # rarer targets are left out of the shortlisted heads' loss
        shifted = shift_target(target, h - 1, pad)
        assert log[f"ntokens_h{h}"] == int((shifted.ne(pad) & shifted.lt(vocab)).sum())
    assert log["ntokens_h1"] == int(target.ne(pad).sum())  # head 1 keeps the whole dictionary
    # Head 2's loss is the label-smoothed loss of a softmax over the first `vocab` rows only.
    block = model(**sample["net_input"])[1]["block_features"]
    logits = F.linear(block[:, :, 1], model.decoder.output_projection.weight[:vocab])
    shifted = shift_target(target, 1, pad)
    shifted = shifted.masked_fill(shifted >= vocab, pad)
    lprobs = F.log_softmax(logits.float(), dim=-1)
    nll = -lprobs.gather(2, shifted.clamp(max=vocab - 1)[..., None])[..., 0]
    smooth = -lprobs.sum(dim=-1)
    keep = shifted.ne(pad)
    eps = SMOOTHING / (vocab - 1)
    expected = ((1 - SMOOTHING - eps) * nll + eps * smooth)[keep].sum()
    assert torch.allclose(log["loss_h2"].float(), expected, rtol=1e-5)


def test_head1_weight_weighs_head_1_against_the_others(data_dir):
    task, model, _ = build(data_dir, "--block-size", "3")
    sample = translation_batch(task, 5, seed=10)
    plain_loss, _, plain = criterion(task)(model, sample)
    loss, _, log = criterion(task, head1_weight=4.0)(model, sample)
    heads = [log[f"loss_h{h}"] for h in (1, 2, 3)]
    assert torch.allclose(plain_loss, sum(heads) / 3)
    assert torch.allclose(loss, (4.0 * heads[0] + heads[1] + heads[2]) / 6)
    assert not torch.allclose(loss, plain_loss)
    for bad in (0.0, -1.0, math.nan, math.inf):  # nan, inf: were taken, and the loss was nan
        with pytest.raises(ValueError, match=f"--head1-weight must be a number greater than 0 .got {bad}"):
            criterion(task, head1_weight=bad)


def test_random_head_draws_head_1_by_its_weight(data_dir):
    task, model, _ = build(data_dir, "--block-size", "4")
    model.train()  # dropout is 0
    sample = translation_batch(task, 3, seed=11)
    torch.manual_seed(0)
    for weight, expected in ((1e9, {1}), (1e-9, {2, 3, 4})):
        crit = criterion(task, random_head=True, head1_weight=weight)
        drawn = set()
        for _ in range(12):
            log = crit(model, sample)[2]
            drawn |= {h for h in (1, 2, 3, 4) if log[f"ntokens_h{h}"] > 0}
        assert drawn == expected


def test_left_padded_targets_are_masked_for_every_head(data_dir):
    """--left-pad-target: [[8 9 10 eos] [pad pad 11 eos]] by hand. Head 1 has 4 + 2 targets,
    head 2 (t+1) 3 + 1 (11 -> eos), head 3 (t+2) 2 + 0; a pad position trains no head."""
    task, _, _ = build(data_dir, "--block-size", "3")
    d = task.target_dictionary
    pad, eos = d.pad(), d.eos()
    target = torch.tensor([[8, 9, 10, eos], [pad, pad, 11, eos]])
    assert shift_target(target, 1, pad).tolist() == [[9, 10, eos, pad], [pad, pad, eos, pad]]
    assert shift_target(target, 2, pad).tolist() == [[10, eos, pad, pad], [pad, pad, pad, pad]]
    sample = {"net_input": {}, "target": target, "ntokens": 6}
    right = OracleHeads([shift_target(target, i, pad) for i in range(3)], len(d))
    _, _, log = BlockwiseCrossEntropyCriterion(task, False, 0.0)(right, sample)
    assert [log[f"ntokens_h{h}"] for h in (1, 2, 3)] == [6, 4, 2]
    assert [log[f"total_h{h}"] for h in (1, 2, 3)] == [6, 4, 2]
    assert all(log[f"n_correct_h{h}"] == log[f"total_h{h}"] for h in (1, 2, 3))
    assert (log["block_sum"], log["block_count"]) == ((3 + 1) + 2, 3)  # blocks at 0 and 3; at 2


def test_shortlisted_heads_count_targets_outside_it_as_misses(data_dir):
    """--head-vocab 10, heads right wherever they can be, by hand on [5 25 6 eos]: head 2's
    targets are 25 6 eos, 25 outside the shortlist: no part of its loss, a miss in its accuracy."""
    task, _, _ = build(data_dir, "--block-size", "3")
    d = task.target_dictionary
    pad, eos, vocab = d.pad(), d.eos(), 10
    target = torch.tensor([[5, 25, 6, eos]])
    oracle = OracleHeads([shift_target(target, i, pad) for i in range(3)], len(d))
    oracle.decoder.head_vocab = vocab
    oracle.decoder.proposal_logits = lambda x: x[..., :vocab]  # the first `vocab` entries
    sample = {"net_input": {}, "target": target, "ntokens": 4}
    _, _, log = criterion(task)(oracle, sample)
    assert [log[f"ntokens_h{h}"] for h in (1, 2, 3)] == [4, 2, 2]  # in the loss
    assert [log[f"total_h{h}"] for h in (1, 2, 3)] == [4, 3, 2]  # in the accuracy
    assert [log[f"n_correct_h{h}"] for h in (1, 2, 3)] == [4, 2, 2]
    # Head 2 cannot propose the out-of-shortlist token at t=0: block 1 there, then 3 from t=1.
    assert (log["block_sum"], log["block_count"]) == (1 + 3, 2)
    with metrics.aggregate() as aggregate:
        BlockwiseCrossEntropyCriterion.reduce_metrics([log])
    values = aggregate.get_smoothed_values()
    assert values["acc_h2"] == pytest.approx(100 * 2 / 3, abs=1e-2)
    assert values["acc_h3"] == 100 and values["block"] == pytest.approx(4 / 2, abs=1e-3)


def test_a_model_without_heads_is_named(data_dir):
    """Was: KeyError 'block_features' from fairseq-train --arch transformer."""
    task, model, _ = build(data_dir, task="translation", arch="transformer")
    with pytest.raises(ValueError, match=r"TransformerModel has none: use --arch transformer_blockwise"):
        criterion(task)(model, translation_batch(task, 2, seed=12))


@pytest.mark.parametrize("flags, options", [
    ((), {}),
    (("--head-vocab", "12"), {}),
    ((), {"ignore_prefix_size": 1}),
    (("--head-layout", "paper"), {"sentence_avg": True}),
])
def test_head_1_logs_what_stock_label_smoothed_cross_entropy_does(data_dir, flags, options):
    """k=3: head 1's summed loss, fairseq's nll_loss and accuracy are stock's on the same batch.
    (Reduced, loss_h1 is per target token, also under --sentence-avg, where stock's loss is
    per sentence.)"""
    task, model, _ = build(data_dir, "--block-size", "3", *flags)
    sentence_avg = options.pop("sentence_avg", False)
    sample = translation_batch(task, 6, seed=13)
    stock = LabelSmoothedCrossEntropyCriterion(task, sentence_avg, SMOOTHING, report_accuracy=True, **options)
    ours = BlockwiseCrossEntropyCriterion(task, sentence_avg, SMOOTHING, report_accuracy=True, **options)
    _, sample_size, log = ours(model, sample)
    _, stock_size, stock_log = stock(model, sample)
    assert sample_size == stock_size
    assert torch.equal(log["loss_h1"], stock_log["loss"])
    assert torch.equal(log["nll_loss"], stock_log["nll_loss"])
    assert (log["n_correct_h1"], log["total_h1"]) == (stock_log["n_correct"], stock_log["total"])
    for key in ("n_correct", "total", "ntokens", "nsentences", "sample_size"):
        assert log[key] == stock_log[key], key


def frozen(data_dir, head_type, *flags):
    """A tiny k=3 model with --freeze-base, its heads random (not zero), in train mode (dropout 0)."""
    task, model, _ = build(data_dir, "--block-size", "3", "--head-type", head_type, "--freeze-base", *flags)
    for name, param in model.decoder.heads.named_parameters():
        if "fc_out" in name or "fc2" in name:
            torch.nn.init.normal_(param, std=0.5)
    return task, model.train()


@pytest.mark.parametrize("head_type", ["independent", "chained"])
@pytest.mark.parametrize("vocab", ["0", "12"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_frozen_training_is_the_full_loss_less_head_1s_share(data_dir, head_type, vocab, dtype):
    """With a frozen base head 1's loss is a constant: training leaves it out (no projection over
    the dictionary), and the loss is the full loss less head 1's weighted share, the same gradients.
    In float32 the frozen path's loss is the compiled one (smoothed_loss.py), the full path's fairseq's."""
    task, model = frozen(data_dir, head_type, "--head-vocab", vocab)
    model = model.to(dtype)
    tolerance = {"rtol": 1e-6} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    sample = translation_batch(task, 6, seed=14)
    crit = criterion(task, head1_weight=2.0)
    heads = [p for p in model.parameters() if p.requires_grad]
    loss, size, log = crit(model, sample)  # train mode: the frozen path
    loss.backward()
    grads = [p.grad.clone() for p in heads]
    model.zero_grad()
    model.eval()  # the full path (dropout is 0: the same features)
    full_loss, full_size, full = crit(model, sample)
    full_loss.backward()
    assert size == full_size
    assert torch.allclose(loss, full_loss - 2.0 * full["loss_h1"] / (2.0 + 2), **tolerance)
    for h in (2, 3):
        assert torch.allclose(log[f"loss_h{h}"], full[f"loss_h{h}"], **tolerance)
        for key in ("ntokens", "n_correct", "total"):
            assert log[f"{key}_h{h}"] == full[f"{key}_h{h}"], (key, h)
    assert not {"loss_h1", "nll_loss", "n_correct", "block_sum"} & set(log)
    for p, grad in zip(heads, grads):
        assert torch.allclose(p.grad, grad, rtol=1e-5, atol=1e-8 if dtype == torch.float64 else 1e-6)
    with metrics.aggregate() as aggregate:
        BlockwiseCrossEntropyCriterion.reduce_metrics([log])
    values = aggregate.get_smoothed_values()
    assert {"loss", "loss_h2", "acc_h2", "loss_h3", "acc_h3"} <= set(values)
    assert not {"nll_loss", "ppl", "block", "loss_h1"} & set(values)  # not computed: not logged as 0


@pytest.mark.parametrize("head_type", ["independent", "chained"])
def test_a_frozen_base_stays_in_eval_mode_while_its_heads_train(data_dir, head_type):
    """Its features are then the ones decoding gives the heads: no dropout in the base."""
    task, model = frozen(data_dir, head_type, "--dropout", "0.3")
    sample = translation_batch(task, 4, seed=15)
    assert model.training and model.decoder.heads.training
    assert not model.encoder.training and not any(layer.training for layer in model.decoder.layers)
    block = model(**sample["net_input"], features_only=True)[1]["block_features"]
    inference = model.eval()(**sample["net_input"], features_only=True)[1]["block_features"]
    assert torch.equal(block[:, :, 0], inference[:, :, 0])
    _, trained, _ = build(data_dir, "--block-size", "3", "--dropout", "0.3")  # not frozen: fairseq's modes
    assert trained.train().encoder.training and trained.decoder.layers[0].training


def test_frozen_random_head_draws_among_heads_2_to_k(data_dir):
    task, model = frozen(data_dir, "independent")
    crit, sample = criterion(task, random_head=True), translation_batch(task, 3, seed=16)
    torch.manual_seed(0)
    drawn, keys = set(), set()
    for _ in range(12):
        loss, _, log = crit(model, sample)
        keys.add(tuple(log))
        trained = [h for h in (2, 3) if log[f"ntokens_h{h}"] > 0]
        assert len(trained) == 1 and torch.equal(loss, log[f"loss_h{trained[0]}"])
        drawn |= set(trained)
    assert drawn == {2, 3} and len(keys) == 1


@pytest.mark.parametrize("frozen_base", [False, True])
def test_head_loss_bf16_projects_heads_2_to_k_in_bfloat16(data_dir, frozen_base):
    if frozen_base:
        task, model = frozen(data_dir, "chained", "--head-vocab", "12")
    else:
        task, model, _ = build(data_dir, "--block-size", "3", "--head-vocab", "12")
    model = model.float()
    sample = translation_batch(task, 6, seed=17)
    exact = criterion(task)(model, sample)
    bf16 = criterion(task, head_loss_bf16=True)(model, sample)
    assert not torch.equal(bf16[0], exact[0])  # computed otherwise
    assert torch.allclose(bf16[0], exact[0], rtol=2e-2)
    if not frozen_base:
        assert torch.equal(bf16[2]["loss_h1"], exact[2]["loss_h1"])  # head 1 as before


def test_best_token_is_argmax_ties_included():
    """The accuracy's choice: argmax's (the first of tied maxima), NaN-free rows."""
    from fairseq_bpd.criterion import best_token

    scores = torch.tensor([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0], [-math.inf, -1.0, -1.0]])
    assert best_token(scores).tolist() == scores.argmax(-1).tolist() == [1, 0, 1]
    random_scores = torch.randn(50, 7, 33).round(decimals=1)  # many ties
    assert torch.equal(best_token(random_scores), random_scores.argmax(-1))
