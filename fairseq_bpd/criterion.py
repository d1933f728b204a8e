"""Multi-position loss for the k proposal heads (Stern et al. 2018, section 6)."""
import logging
import math
import re
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)

from .smoothed_loss import smoothed_nll
from .targets import shift_target

logger = logging.getLogger(__name__)


@dataclass
class BlockwiseCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    head1_weight: float = field(
        default=1.0,
        metadata={
            "help": "weight of head 1's loss against each other head's (1: the paper's "
            "plain mean). Fine-tuning a pretrained base with 1 lets the k-1 proposal "
            "losses pull the shared decoder and embeddings away from next-token "
            "prediction; k-1 gives head 1 half of the loss"
        },
    )
    head_loss_bf16: bool = field(
        default=False,
        metadata={
            "help": "project heads 2..k's training features onto their vocabulary in "
            "bfloat16 (torch.autocast; the log-softmax stays float32): the largest product "
            "in head training, about 3 times faster in bfloat16 on CPUs with AVX512-BF16 "
            "and on GPUs. Head 1 and the base are computed as before"
        },
    )
    random_head: bool = field(
        default=False,
        metadata={
            "help": "train one head drawn at random per batch (the paper's variant, "
            "to save memory; drawn in proportion to --head1-weight) instead of the "
            "weighted mean over all heads"
        },
    )


def teacher_forced_block(predictions, valid):
    """Sum and count of the blocks decoding would accept along the reference prefix.

    predictions: B x T x k argmax of each head; valid: B x T non-pad mask. At t the
    block holds head 1's token and head i's while it equals head 1's own prediction at
    t+i-1 (what verification compares it to) and every head before it passed. Blocks
    are counted where decoding makes them: from each sentence's first position, each
    block starting where the one before it ended. A mean over every position would
    count the positions after a rejection (the hard ones, where decoding's next block
    starts) as rarely as any other, and overstate what decoding accepts.
    """
    k = predictions.size(-1)
    accepted = valid.long()
    run = valid.clone()
    for i in range(1, k):
        agree = torch.zeros_like(valid)
        agree[:, :-i] = predictions[:, :-i, i].eq(predictions[:, i:, 0]) & valid[:, i:]
        run = run & agree
        accepted += run.long()
    total = blocks = 0
    for row in accepted.tolist():  # 0 exactly at padding
        t = 0
        while t < len(row):
            if row[t] == 0:  # padding (left-padded targets, a <pad> token in the text): skipped
                t += 1
                continue
            total, blocks, t = total + row[t], blocks + 1, t + row[t]
    return torch.tensor(total), torch.tensor(blocks)


def best_token(lprobs):
    """Each row's best token, the first on a tie, as argmax gives it: ... x V -> ... (max's
    index: torch's argmax took about twice as long on a CPU, for every head of every batch)."""
    return lprobs.max(dim=-1).indices


@register_criterion("blockwise_cross_entropy", dataclass=BlockwiseCrossEntropyConfig)
class BlockwiseCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed cross-entropy of every head against its shifted target."""

    def __init__(
        self,
        task,
        sentence_avg,
        label_smoothing,
        ignore_prefix_size=0,
        report_accuracy=False,
        random_head=False,
        head1_weight=1.0,
        head_loss_bf16=False,
    ):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.random_head = random_head
        self.head_loss_bf16 = head_loss_bf16
        if not 0 < head1_weight < math.inf:  # nan too: it would train on a nan loss
            raise ValueError(f"--head1-weight must be a number greater than 0 (got {head1_weight})")
        self.head1_weight = head1_weight

    def forward(self, model, sample, reduce=True):
        # Features only: each head's loss projects its own features (head 1's logits from
        # forward would be a second product over the whole dictionary).
        net_output = model(**sample["net_input"], features_only=True)
        if "block_features" not in net_output[1]:  # was a bare KeyError: 'block_features'
            raise ValueError(
                f"--criterion blockwise_cross_entropy trains a model with proposal heads, and "
                f"{type(model).__name__} has none: use --arch transformer_blockwise (or "
                "transformer_blockwise_small, ...), or --criterion label_smoothed_cross_entropy"
            )
        block = net_output[1]["block_features"]  # B x T x k x C
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            block = block[:, self.ignore_prefix_size :]
            target = target[:, self.ignore_prefix_size :]
        k = block.size(2)
        weights = [self.head1_weight] + [1.0] * (k - 1)
        if model.training and head1_is_constant(model):
            return self.proposal_forward(model, sample, block, target, weights, reduce)
        if self.random_head and model.training:
            # Drawn in proportion to the weights, the expected loss is the weighted mean.
            drawn = int(torch.multinomial(torch.tensor(weights), 1).item())
            weights = [float(i == drawn) for i in range(k)]

        logging_output = {
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample["target"].size(0) if self.sentence_avg else sample["ntokens"],
        }
        loss, predictions = 0.0, []
        for i, weight in enumerate(weights):
            if weight == 0:  # a head not drawn (--head1-weight is > 0)
                # Its keys all the same, as zeros: fairseq sums logging outputs
                # (micro-batches, then ranks) by the first one's keys.
                logging_output.update(self.head_log(model, i, block.new_zeros(())))
                continue
            loss_i, nll_i, lprobs, target_i = self.head_loss(model, block, target, i, reduce)
            loss = loss + weight * loss_i
            predictions.append(best_token(lprobs))  # B x T
            logging_output.update(self.head_log(model, i, loss_i, predictions[-1], target_i))
            if i == 0:
                head1 = nll_i, predictions[-1]
        if weights[0] == 0:
            # Head 1 was not drawn: still log its nll and accuracy, so that nll_loss,
            # ppl and accuracy stay the base model's, whichever head is trained.
            with torch.no_grad():
                _, nll_i, lprobs, _ = self.head_loss(model, block, target, 0, reduce)
            head1 = nll_i, best_token(lprobs)
        logging_output["nll_loss"] = head1[0].data
        if self.report_accuracy:
            logging_output["n_correct"], logging_output["total"] = self.correct(head1[1], target)
        loss = loss / sum(weights)
        logging_output["loss"] = loss.data
        if len(predictions) == k:
            accepted, positions = teacher_forced_block(
                torch.stack(predictions, dim=-1), target.ne(self.padding_idx)
            )
            logging_output["block_sum"] = utils.item(accepted)
            logging_output["block_count"] = utils.item(positions)
        return loss, logging_output["sample_size"], logging_output

    def proposal_forward(self, model, sample, block, target, weights, reduce=True):
        """Training with head 1 constant (a frozen base): heads 2..k's share of the loss alone.

        The loss is the full loss less head 1's share (the same gradients), made without
        head 1's projection over the whole dictionary, and each head's projection is
        taken only at the positions in its loss: B x T x k x C -> N x C rows. Head 1's
        nll, ppl, accuracy and the block estimate need that projection: validation logs
        them (it runs every head).
        """
        if not getattr(self, "_said_frozen", False):
            logger.info("head 1 is the frozen base: its loss is a constant, not computed in training "
                        "(train lines give loss_h2.. and acc_h2..; validation also gives nll_loss, ppl and block)")
            self._said_frozen = True
        heads = list(range(1, block.size(2)))
        if self.random_head:
            # Drawn among heads 2..k in proportion to their weights: head 1 would train nothing.
            drawn = heads[int(torch.multinomial(torch.tensor(weights[1:]), 1).item())]
            heads = [drawn]
        logging_output = {
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample["target"].size(0) if self.sentence_avg else sample["ntokens"],
        }
        k = block.size(2)
        shifted = [shift_target(target, i, self.padding_idx) for i in range(k)]
        in_loss = torch.stack([self.loss_target(model, shifted[i], i) for i in range(k)], dim=-1)  # B x T x k
        keep = in_loss.ne(self.padding_idx)
        keep[..., [i for i in range(k) if i not in heads]] = False
        # One selection for all heads (its backward fills one zero tensor, not one per head).
        logits = self.proposal_logits(model, block[keep])  # N x V'
        target_rows = in_loss[keep]  # N
        # The log-softmax and label-smoothed loss fused (smoothed_loss.py): a plain decoder's
        # normalisation, which get_normalized_probs gives in the path above.
        losses, best = smoothed_nll(logits, target_rows, self.eps, self.padding_idx)  # N, N
        head_of_row = keep.nonzero()[:, 2]  # N, 0-based head
        loss_h = losses.new_zeros(k).index_add(0, head_of_row, losses)  # k
        hits = best.eq(target_rows).long()
        n_correct = hits.new_zeros(k).index_add_(0, head_of_row, hits).tolist()
        ntokens = keep.sum(dim=(0, 1)).tolist()
        for i in range(1, k):  # a head not drawn logs zeros: every log has the same keys
            h, drawn = i + 1, i in heads
            logging_output.update({
                f"loss_h{h}": loss_h[i].data, f"ntokens_h{h}": ntokens[i],
                f"n_correct_h{h}": n_correct[i],
                f"total_h{h}": utils.item(shifted[i].ne(self.padding_idx).sum()) if drawn else 0,
            })
        # As the full loss divides: the same gradients, less head 1's constant share.
        loss = (loss_h * loss_h.new_tensor(weights)).sum() / (1.0 if self.random_head else sum(weights))
        logging_output["loss"] = loss.data
        return loss, logging_output["sample_size"], logging_output

    def proposal_logits(self, model, x):
        """Heads 2..k's shortlist logits (--head-vocab): ... x C -> ... x N, in bfloat16 under
        --head-loss-bf16."""
        if not self.head_loss_bf16:
            return model.decoder.proposal_logits(x)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return model.decoder.proposal_logits(x)

    def correct(self, prediction, target):
        """Hits and non-pad targets: prediction and target B x T."""
        mask = target.ne(self.padding_idx)
        return utils.item(prediction.eq(target).masked_select(mask).sum()), utils.item(mask.sum())

    def head_log(self, model, i, loss_i, prediction=None, target_i=None):
        """Head i's logged loss and counts (0-based i); zeros where it was not trained.

        ntokens_h counts the targets in its loss, total_h those in its accuracy. They
        differ under --head-vocab: a target outside the shortlist has no logit, so it
        is no part of the loss, but it is a miss, since the head cannot propose it.
        """
        h = i + 1
        if prediction is None:
            return {f"loss_h{h}": loss_i, f"ntokens_h{h}": 0, f"n_correct_h{h}": 0, f"total_h{h}": 0}
        n_correct, total = self.correct(prediction, target_i)
        in_loss = self.loss_target(model, target_i, i).ne(self.padding_idx)
        return {
            f"loss_h{h}": loss_i.data,
            f"ntokens_h{h}": utils.item(in_loss.sum()),
            f"n_correct_h{h}": n_correct,
            f"total_h{h}": total,
        }

    @staticmethod
    def shortlist(model, i):
        """N if head i (0-based) has a softmax over the first N entries only (--head-vocab), else 0."""
        return getattr(model.decoder, "head_vocab", 0) if i > 0 else 0

    def loss_target(self, model, target_i, i):
        """Head i's target as its loss sees it: pad where the head has no logit."""
        vocab = self.shortlist(model, i)
        return target_i.masked_fill(target_i >= vocab, self.padding_idx) if vocab else target_i

    def head_loss(self, model, block, target, i, reduce=True):
        """Label-smoothed loss and nll of head i (0-based), its log-probs and its target."""
        target_i = shift_target(target, i, self.padding_idx)
        if self.shortlist(model, i):
            logits = self.proposal_logits(model, block[:, :, i])
        else:
            logits = model.decoder.output_layer(block[:, :, i])
        lprobs = model.get_normalized_probs((logits, None), log_probs=True)
        loss_i, nll_i = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)),
            self.loss_target(model, target_i, i).reshape(-1),
            self.eps,
            ignore_index=self.padding_idx,
            reduce=reduce,
        )
        return loss_i, nll_i, lprobs, target_i

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        if any("nll_loss" in log for log in logging_outputs):
            super().reduce_metrics(logging_outputs)
        else:  # head 1 not computed (a frozen base in training): no nll_loss or ppl to give
            sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
            loss = sum(log.get("loss", 0) for log in logging_outputs)
            metrics.log_scalar("loss", loss / sample_size / math.log(2), sample_size, round=3)

        def total(key):
            return utils.item(sum(log.get(key, 0) for log in logging_outputs))

        heads = sorted(
            {int(m.group(1)) for log in logging_outputs for key in log
             if (m := re.fullmatch(r"loss_h(\d+)", key))}
        )
        for h in heads:
            ntokens = total(f"ntokens_h{h}")
            if ntokens > 0:
                metrics.log_scalar(
                    f"loss_h{h}", total(f"loss_h{h}") / ntokens / math.log(2), ntokens, round=3
                )
            targets = total(f"total_h{h}")
            if targets > 0:
                metrics.log_scalar(
                    f"acc_h{h}", 100.0 * total(f"n_correct_h{h}") / targets, targets, round=2
                )
        count = total("block_count")
        if count > 0:
            metrics.log_scalar("block", total("block_sum") / count, count, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def head1_is_constant(model):
    """Whether head 1's loss has no gradient: it is the decoder's own output (--head-layout
    base) and no parameter outside the heads is trained (--freeze-base)."""
    heads = getattr(model.decoder, "heads", None)
    if getattr(heads, "layout", None) != "base":
        return False
    return not any(p.requires_grad for name, p in model.named_parameters()
                   if not name.startswith("decoder.heads."))
