"""Blockwise parallel decoding (Stern, Shazeer & Uszkoreit, NeurIPS 2018, sections 3-5).

Each decoder invocation feeds a block: the last committed token and the k-1 tokens the
proposal heads predicted after it. Head 1's outputs over the block verify the
proposals; the longest verified prefix is accepted, the rejected suffix is cropped
from the cache, and the heads at the last accepted position propose the next block
(combined scoring and proposal: m/k + 1 invocations for m tokens, not 2m/k).
One invocation: forward_block -> verify -> accept -> commit -> crop -> retire -> propose.
"""
import logging
import math
from collections import Counter

import torch
from torch import nn
from fairseq.ngram_repeat_block import NGramRepeatBlock

logger = logging.getLogger(__name__)


def verify(lprobs, block, score, topk):
    """Head 1's verdict on a block, ranked as fairseq's greedy ranks: log-prob + running score.

    lprobs: b x n x V, head 1 after each block token (fairseq's constraints applied);
    block: b x n, the last committed token then n-1 proposals; score: b, the float32
    running score of the committed prefix.
    Returns candidates b x n x max(2, topk) (token ids, best first), their ranked
    values b x n x max(2, topk), the running score before each output b x n, and
    each proposal's log-prob b x n-1.
    """
    proposal_lprobs = lprobs[:, :-1].gather(2, block[:, 1:, None]).squeeze(2)  # b x n-1
    running = [score]
    for j in range(block.size(1) - 1):  # sequential float32 sums, as fairseq's loop adds
        running.append(running[-1] + proposal_lprobs[:, j])
    running = torch.stack(running, dim=1)  # b x n
    values, candidates = torch.topk(lprobs + running.unsqueeze(2), k=max(2, topk), dim=2)
    return candidates, values, running, proposal_lprobs


def accept(candidates, values, block, proposal_lprobs, limit, topk, min_block):
    """How many block tokens each sentence keeps: b, in [1, limit].

    Proposal j passes when it is among head 1's top `topk` after the tokens before
    it (topk 1: exactly greedy) with a finite score; the first min_block - 1 proposals
    pass unverified unless forbidden (log-prob -inf). The block keeps its first token
    and the longest run of passing proposals.
    """
    proposals = block[:, 1:, None]  # b x n-1 x 1
    ranked = (candidates[:, :-1, :topk] == proposals) & (values[:, :-1, :topk] > -math.inf)
    passes = ranked.any(dim=2)  # b x n-1
    forced = torch.arange(passes.size(1), device=block.device) < min_block - 1
    passes = passes | (forced & (proposal_lprobs > -math.inf))
    run = passes.long().cumprod(dim=1).sum(dim=1)
    return torch.minimum(1 + run, limit)


def confident_width(best, log_confidence):
    """How many proposals the next block keeps under --blockwise-confidence: an int.

    best: b x k-1, each head's top log-prob (over the vocabulary it proposes from).
    A sentence keeps proposals while the product of their top probabilities stays
    at or above the confidence; the batch shares one block, so the widest sentence
    sets it (the others' extra proposals are verified like any other).
    """
    confident = best.cumsum(dim=1) >= log_confidence  # a prefix: the sums only fall
    return int(confident.sum(dim=1).max())


def commit(block, candidates, values, running, kept, eos):
    """What a verified block adds to each sentence (pure: reads its inputs only).

    block: b x n, the last committed token then the proposals along the accepted
    path; candidates, values: b x n x K and running: b x n from verify; kept: b, the
    accepted count from accept. The block's outputs are its kept proposals followed
    by head 1's choice after the last of them. Returns the output tokens b x n (after
    the kept ones: anything), their running scores b x n, how many of them the
    sentence keeps b (up to and with the first EOS) and whether it ended b.
    """
    offsets = torch.arange(block.size(1), device=block.device)
    last = (kept - 1)[:, None]  # b x 1
    outputs = torch.cat([block[:, 1:], block[:, :1]], dim=1)  # proposal j+1 at j
    outputs.scatter_(1, last, candidates[:, :, 0].gather(1, last))
    output_scores = torch.cat([running[:, 1:], running[:, :1]], dim=1)
    output_scores.scatter_(1, last, values[:, :, 0].gather(1, last))
    is_eos = outputs.eq(eos) & (offsets < kept[:, None])
    finished = is_eos.any(dim=1)
    added = torch.where(finished, is_eos.long().argmax(dim=1) + 1, kept)
    return outputs, output_scores, added, finished


class BlockwiseStats:
    """Sentences, tokens, decoder invocations and accepted block sizes over a run."""

    def __init__(self):
        self.sentences = self.tokens = self.invocations = 0
        self.accepted = Counter()

    def mean_accepted_block(self):
        iterations = sum(self.accepted.values())
        return sum(size * count for size, count in self.accepted.items()) / max(iterations, 1)

    def log(self):
        """Log the summary, if anything was decoded."""
        if self.sentences:
            logger.info(self.summary())

    def summary(self):
        histogram = " ".join(f"{size}:{self.accepted[size]}" for size in sorted(self.accepted))
        return (
            f"blockwise: {self.sentences} sentences, {self.tokens} tokens, "
            f"{self.invocations} decoder invocations, mean accepted block size "
            f"{self.mean_accepted_block():.3f}, accepted block sizes {{{histogram}}}"
        )


class Batch:
    """The sentences still decoding and what each has so far; finished ones leave.

    sentence: b, ids in the input batch; tokens: b x L, BOS then the output; scores:
    b x L, the running score after each output; attn: b x S x L or None; length: b,
    outputs so far; cached: b, decoder inputs in the cache; invocations: b.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def select(self, rows):
        """Keep the sentences at `rows` (b')."""
        for name, value in vars(self).items():
            if value is not None:
                setattr(self, name, value[rows])

    def store(self, outputs, output_scores, added, block_attn, pad):
        """Write a block's outputs b x n after each sentence's; outputs past `added` read pad."""
        columns = self.length[:, None] + 1 + torch.arange(outputs.size(1), device=outputs.device)
        is_added = columns <= self.length[:, None] + added[:, None]
        self.tokens.scatter_(1, columns, torch.where(is_added, outputs, pad))
        self.scores.scatter_(1, columns - 1, output_scores.to(self.scores))
        if block_attn is not None:
            if self.attn is None:
                self.attn = self.scores.new_zeros(*block_attn.shape[::2], self.scores.size(1))
            index = columns[:, None, :].expand(-1, block_attn.size(2), -1)
            self.attn.scatter_(2, index, block_attn.transpose(1, 2).to(self.attn))
        self.length = self.length + added


class BlockwiseGenerator(nn.Module):
    """Greedy decoding, k tokens at a time: fairseq's SequenceGenerator(beam_size=1) output."""

    def __init__(
        self,
        model,
        tgt_dict,
        block_size,
        topk=1,
        min_block=1,
        proposal_vocab=0,
        confidence=0.0,
        max_len_a=0,
        max_len_b=200,
        max_len=0,
        min_len=1,
        normalize_scores=True,
        len_penalty=1.0,
        unk_penalty=0.0,
        temperature=1.0,
        match_source_len=False,
        no_repeat_ngram_size=0,
        stats=None,
    ):
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.topk, self.min_block = topk, min_block
        self.log_confidence = math.log(confidence) if confidence > 0 else -math.inf
        # 0: what the heads were trained on (--head-vocab), else the whole dictionary.
        self.proposal_vocab = proposal_vocab or getattr(model.decoder, "head_vocab", 0)
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.max_len = max_len or model.max_decoder_positions()
        self.min_len = min_len
        self.normalize_scores, self.len_penalty = normalize_scores, len_penalty
        self.unk_penalty, self.temperature = unk_penalty, temperature
        self.match_source_len = match_source_len
        self.repeat_ngram_blocker = (
            NGramRepeatBlock(no_repeat_ngram_size) if no_repeat_ngram_size > 0 else None
        )
        if temperature <= 0:
            raise ValueError("--temperature must be greater than 0")
        # The task passes one for a whole run, and logs it (task.py).
        self.stats = BlockwiseStats() if stats is None else stats

    def cuda(self):
        self.model.cuda()
        return self

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        if prefix_tokens is not None or constraints is not None:
            raise ValueError("--blockwise cannot decode with a prefix or constraints")
        return self._generate(sample, bos_token)

    def _generate(self, sample, bos_token=None):
        model, decoder = self.model, self.model.decoder
        net_input = sample["net_input"]
        src_tokens, src_lengths = net_input["src_tokens"], net_input["src_lengths"]
        max_len = self.max_length(src_tokens, src_lengths)
        encoder_out = model.encoder.forward_torchscript(net_input)
        batch = self.start(src_tokens, max_len, bos_token)
        proposals = src_tokens.new_empty(batch.length.size(0), 0)
        incremental_state = {}
        finalized = [[] for _ in range(src_tokens.size(0))]

        first_pass = True  # on BOS alone: it verifies nothing, so it is no accepted block
        while True:
            # 1. One decoder pass over the block: the last committed token, then the proposals.
            block = torch.cat([batch.tokens.gather(1, batch.length[:, None]), proposals], dim=1)  # b x n
            n = block.size(1)
            steps = batch.length[:, None] + torch.arange(n, device=block.device)  # b x n: the step each output predicts
            features, block_attn = decoder.forward_block(
                block, steps.clamp(max=max_len), encoder_out, incremental_state
            )
            batch.invocations += 1
            lprobs = self.head1_lprobs(features, steps, batch.tokens, block, max_len)

            # 2. Verify the proposals with head 1, 3. accept the longest agreeing prefix.
            candidates, values, running, proposal_lprobs = verify(lprobs, block, self.score(batch), self.topk)
            limit = (max_len + 1 - batch.length).clamp(max=n)  # no output past step max_len
            kept = accept(candidates, values, block, proposal_lprobs, limit, self.topk, self.min_block)

            # 4. Commit the kept proposals and head 1's choice after them.
            outputs, output_scores, added, finished = commit(block, candidates, values, running, kept, self.eos)
            if not first_pass or self.block_size == 1:
                self.stats.accepted.update(added.tolist())
            first_pass = False
            batch.store(outputs, output_scores, added, block_attn, self.pad)

            # 5. Crop the rejected proposals out of the cache.
            keep = torch.arange(n, device=block.device).expand(block.size(0), -1)
            batch.cached = decoder.crop_cache(incremental_state, batch.cached, n, keep, kept)
            last = features.gather(1, (kept - 1)[:, None, None].expand(-1, -1, features.size(2)))[:, 0]  # b x C

            # 6. Finished sentences leave the batch.
            if finished.any():
                self.retire(batch, finished, finalized, src_lengths)
                active = (~finished).nonzero()[:, 0]
                if active.numel() == 0:
                    return finalized
                batch.select(active)
                last = last[active]
                decoder.reorder_incremental_state_scripting(incremental_state, active)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, active)

            # 7. The heads at the last accepted position propose the next block.
            proposals = self.propose(last, batch.sentence, batch.tokens, batch.length)

    def max_length(self, src_tokens, src_lengths):
        """The longest output allowed, EOS excluded: an int (fairseq's rule)."""
        if self.match_source_len:
            max_len = int(src_lengths.max())
        else:
            max_len = min(int(self.max_len_a * src_tokens.size(1) + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        return max_len

    def start(self, src_tokens, max_len, bos_token):
        """A Batch of BOS alone. The k extra columns absorb writes past a sentence's end."""
        bsz, device = src_tokens.size(0), src_tokens.device
        width = max_len + 2 + self.block_size
        tokens = src_tokens.new_full((bsz, width), self.pad)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        length = torch.zeros(bsz, dtype=torch.long, device=device)
        return Batch(
            sentence=torch.arange(bsz, device=device), tokens=tokens,
            scores=torch.zeros(bsz, width, device=device), attn=None, length=length,
            cached=torch.zeros_like(length), invocations=torch.zeros_like(length),
        )

    @staticmethod
    def score(batch):
        """The float32 running score of each committed prefix: b."""
        previous = batch.scores.gather(1, (batch.length - 1).clamp(min=0)[:, None])[:, 0]
        return torch.where(batch.length > 0, previous, 0.0)

    def retire(self, batch, finished, finalized, src_lengths):
        """Hypotheses of the sentences that `finished` (b) marks, into `finalized`."""
        for row in finished.nonzero()[:, 0].tolist():
            sentence = int(batch.sentence[row])
            finalized[sentence] = [
                self.hypothesis(batch.tokens[row], batch.scores[row], batch.attn, row, int(batch.length[row]),
                                int(batch.invocations[row]), src_lengths[sentence])
            ]

    def head1_lprobs(self, features, steps, tokens, block, max_len):
        """Head 1's log-probs after each block token, constrained as fairseq's greedy: b x n x V."""
        decoder = self.model.decoder
        logits = decoder.project(decoder.heads.head1_features(features))
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        lprobs = self.model.get_normalized_probs((logits, None), log_probs=True)
        lprobs.masked_fill_(lprobs.isnan(), -math.inf)
        lprobs[..., self.pad] = -math.inf
        lprobs[..., self.unk] -= self.unk_penalty
        at_max_len = steps >= max_len
        if at_max_len.any():  # skipped when it cannot bite: this runs once per invocation
            not_eos = torch.arange(lprobs.size(2), device=lprobs.device) != self.eos
            lprobs.masked_fill_(at_max_len[..., None] & not_eos, -math.inf)
        below_min_len = steps < self.min_len
        if below_min_len.any():
            lprobs[..., self.eos].masked_fill_(below_min_len, -math.inf)
        if self.repeat_ngram_blocker is not None:
            self.block_repeated_ngrams(lprobs, steps, tokens, block, max_len)
        return lprobs

    def block_repeated_ngrams(self, lprobs, steps, tokens, block, max_len):
        """fairseq's NGramRepeatBlock, called per sentence and position with what it sees there."""
        for row in range(block.size(0)):
            prefix = tokens[row : row + 1, : max_len + 2].clone()
            start = int(steps[row, 0])
            for j in range(min(block.size(1), max_len + 1 - start)):  # later outputs are unused
                prefix[0, start + 1 : start + 1 + j] = block[row, 1 : 1 + j]
                lprobs[row, j] = self.repeat_ngram_blocker(
                    prefix, lprobs[row, j : j + 1], 1, 1, start + j
                )[0]

    def propose(self, features, sentence, tokens, length):
        """Heads 2..k at the last accepted position: features b x C -> b x n-1 tokens.

        n is k, or less under --blockwise-confidence (confident_width), since every
        block position costs decoder and projection work whether or not it is accepted.
        Chained heads also read the last committed token (head 1's choice after
        `features`); the batch's sentence ids, tokens (b x L) and lengths (b) are there
        for proposal models that read the prefix (the tests' oracles).
        """
        heads = self.model.decoder.heads
        first = tokens.gather(1, length[:, None])[:, 0]  # b: head 1's choice after `features`
        proposals, lprobs = heads.propose(features, self.block_size, self.proposal_vocab, token=first)  # b x k-1 x 1
        proposals = proposals[..., 0]
        if self.log_confidence == -math.inf:
            return proposals
        return proposals[:, : confident_width(lprobs[..., 0], self.log_confidence)]

    def hypothesis(self, tokens, scores, attn, row, length, invocations, src_length):
        """fairseq's hypothesis dict for one finished sentence of `length` tokens (EOS last)."""
        positional_scores = scores[:length].clone()
        positional_scores[1:] = scores[1:length] - scores[: length - 1]
        score = scores[length - 1].clone()
        if self.normalize_scores:
            score /= length ** self.len_penalty
        if self.match_source_len and length - 1 > src_length:
            score = torch.tensor(-math.inf)
        self.stats.sentences += 1
        self.stats.tokens += length
        self.stats.invocations += invocations
        return {
            "tokens": tokens[1 : length + 1].clone(),
            "score": score,
            "attention": attn[row, :, 1 : length + 1].clone() if attn is not None else torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": positional_scores,
            "steps": invocations,
        }
