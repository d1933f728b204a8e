"""Blockwise parallel decoding (Stern, Shazeer & Uszkoreit, NeurIPS 2018, sections 3-5).

Each decoder invocation feeds a block: the last committed token and the k-1 tokens the
proposal heads predicted after it. Head 1's outputs over the block verify the
proposals; the longest verified prefix is accepted, the rejected suffix is rolled back
from the cache, and the heads at the last accepted position propose the next block
(combined scoring and proposal: m/k + 1 invocations for m tokens, not 2m/k).
"""
import logging
import math
import weakref
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


def symbol_numbers(dictionary):
    """Each symbol's number, for --blockwise-distance: V float64s.

    NaN for the special symbols and fairseq-preprocess's madeupword fillers (never
    within any distance: they pass only as greedy's own choice). Raises ValueError
    naming the first other symbol that is not a finite number.
    """
    numbers = torch.full((len(dictionary),), math.nan, dtype=torch.float64)
    for index in range(dictionary.nspecial, len(dictionary)):
        symbol = dictionary[index]
        if symbol.startswith("madeupword"):
            continue
        try:
            value = float(symbol)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"symbol {symbol!r} (entry {index}) is not a number")
        numbers[index] = value
    return numbers


def accept_within_distance(candidates, block, proposal_lprobs, limit, numbers, distance):
    """How many block tokens each sentence keeps under --blockwise-distance E: b, in [1, limit].

    The paper's approximate acceptance for ordinal outputs (section 7.2): proposal j
    passes when its number (numbers: V, from symbol_numbers) differs from head 1's choice
    after the tokens before it by at most E, with a finite log-prob. Shapes as accept.
    """
    proposals, choices = block[:, 1:], candidates[:, :-1, 0]  # b x n-1
    numbers = numbers.to(block.device)
    near = (numbers[proposals] - numbers[choices]).abs() <= distance  # NaN (non-numbers): False
    passes = ((proposals == choices) | near) & (proposal_lprobs > -math.inf)
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


def roll_back(decoder, incremental_state, cached, kept, block_width):
    """Drop the rejected suffix of the block just fed.

    cached, kept: b. Before the call each layer's self-attention cache holds, per
    sentence, `cached` valid entries left-aligned in a common width W, then the
    block's `block_width` entries. Afterwards it holds the cached prefix and the first
    `kept` block entries, left-aligned in a width of max(cached + kept), the rest
    hidden by the key padding mask. Returns cached + kept.
    """
    lengths = cached + kept
    width = int(lengths.max())
    total = decoder.layers[0].self_attn._get_input_buffer(incremental_state)["prev_key"].size(2)
    old_width = total - block_width
    uniform = bool((cached == old_width).all() and (lengths == width).all())
    if not uniform:
        columns = torch.arange(width, device=cached.device).unsqueeze(0)  # 1 x W'
        index = torch.where(columns < cached[:, None], columns, old_width + columns - cached[:, None])
        index = index.clamp(max=total - 1)  # b x W'; clamped columns are masked
        padding = columns >= lengths[:, None]  # b x W'
    for layer in decoder.layers:
        buffer = layer.self_attn._get_input_buffer(incremental_state)
        for key in ("prev_key", "prev_value"):
            cache = buffer[key]  # b x heads x W+n x d
            if uniform:
                buffer[key] = cache[:, :, :width]
            else:
                expanded = index[:, None, :, None].expand(-1, cache.size(1), -1, cache.size(3))
                buffer[key] = cache.gather(2, expanded)
        buffer["prev_key_padding_mask"] = None if uniform else padding
        layer.self_attn._set_input_buffer(incremental_state, buffer)
    return lengths


class BlockwiseStats:
    """Sentences, tokens, decoder invocations and accepted block sizes over a run."""

    def __init__(self):
        self.sentences = self.tokens = self.invocations = 0
        self.accepted = Counter()

    def mean_accepted_block(self):
        iterations = sum(self.accepted.values())
        return sum(size * count for size, count in self.accepted.items()) / max(iterations, 1)

    def summary(self):
        histogram = " ".join(f"{size}:{self.accepted[size]}" for size in sorted(self.accepted))
        return (
            f"blockwise: {self.sentences} sentences, {self.tokens} tokens, "
            f"{self.invocations} decoder invocations, mean accepted block size "
            f"{self.mean_accepted_block():.3f}, accepted block sizes {{{histogram}}}"
        )


def _log_summary(stats):
    if stats.sentences:
        logger.info(stats.summary())


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
        distance=0.0,
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
    ):
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.topk, self.min_block = topk, min_block
        self.log_confidence = math.log(confidence) if confidence > 0 else -math.inf
        # --blockwise-distance: 0 is exact; otherwise proposals are judged by their numbers.
        if distance > 0 and (topk != 1 or min_block != 1):
            raise ValueError("--blockwise-distance cannot be combined with --blockwise-topk or --blockwise-min-block")
        self.distance = distance
        self.numbers = symbol_numbers(tgt_dict) if distance > 0 else None
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
        self.stats = BlockwiseStats()
        # fairseq-generate has no end-of-run hook: report when the generator goes.
        self.report_at_exit = weakref.finalize(self, _log_summary, self.stats)

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
        bsz, src_len = src_tokens.size()[:2]
        if self.match_source_len:
            max_len = int(src_lengths.max())
        else:
            max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        encoder_out = model.encoder.forward_torchscript(net_input)
        device = src_tokens.device

        # Per active sentence. The k extra columns absorb writes past a sentence's end.
        width = max_len + 2 + self.block_size
        sentence = torch.arange(bsz, device=device)
        tokens = src_tokens.new_full((bsz, width), self.pad)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        scores = torch.zeros(bsz, width, device=device)  # running score after token i+1
        attn = None
        length = torch.zeros(bsz, dtype=torch.long, device=device)  # committed tokens
        cached = torch.zeros_like(length)  # decoder inputs in the cache
        invocations = torch.zeros_like(length)
        proposals = tokens.new_empty(bsz, 0)
        incremental_state = {}
        finalized = [[] for _ in range(bsz)]

        first_pass = True  # on BOS alone: it verifies nothing, so it is no accepted block
        while sentence.numel() > 0:
            # 1. One decoder pass over the block: the last committed token, then the proposals.
            block = torch.cat([tokens.gather(1, length[:, None]), proposals], dim=1)  # b x n
            n = block.size(1)
            offsets = torch.arange(n, device=device)
            steps = length[:, None] + offsets  # b x n: the step each output predicts
            features, block_attn = decoder.forward_block(
                block, steps.clamp(max=max_len), encoder_out, incremental_state
            )
            invocations += 1
            lprobs = self.head1_lprobs(features, steps, tokens, block, max_len)

            # 2. Verify the proposals with head 1 and accept the longest agreeing prefix.
            score = torch.where(length > 0, scores.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0], 0.0)
            candidates, values, running, proposal_lprobs = verify(lprobs, block, score, self.topk)
            limit = (max_len + 1 - length).clamp(max=n)  # no output past step max_len
            if self.distance > 0:
                kept = accept_within_distance(candidates, block, proposal_lprobs, limit, self.numbers, self.distance)
            else:
                kept = accept(candidates, values, block, proposal_lprobs, limit, self.topk, self.min_block)

            # 3. Commit the kept proposals and head 1's choice after them.
            last = (kept - 1)[:, None]  # b x 1
            committed = torch.cat([block[:, 1:], block[:, :1]], dim=1)  # proposal j+1 at j
            committed.scatter_(1, last, candidates[:, :, 0].gather(1, last))
            committed_scores = torch.cat([running[:, 1:], running[:, :1]], dim=1)
            committed_scores.scatter_(1, last, values[:, :, 0].gather(1, last))
            is_committed = offsets < kept[:, None]  # b x n
            columns = length[:, None] + 1 + offsets
            tokens.scatter_(1, columns, torch.where(is_committed, committed, self.pad))
            scores.scatter_(1, columns - 1, committed_scores)
            if block_attn is not None:
                if attn is None:
                    attn = scores.new_zeros(bsz, block_attn.size(2), width)
                attn.scatter_(2, columns[:, None, :].expand(-1, block_attn.size(2), -1), block_attn.transpose(1, 2).float())
            is_eos = committed.eq(self.eos) & is_committed
            finished = is_eos.any(dim=1)
            new_tokens = torch.where(finished, is_eos.long().argmax(dim=1) + 1, kept)
            if not first_pass or self.block_size == 1:
                self.stats.accepted.update(new_tokens.tolist())
            first_pass = False
            length = length + new_tokens

            # 4. Roll the rejected suffix out of the cache.
            cached = roll_back(decoder, incremental_state, cached, kept, n)

            # 5. Finished sentences leave the batch.
            if finished.any():
                for row in finished.nonzero()[:, 0].tolist():
                    finalized[sentence[row]] = [
                        self.hypothesis(tokens[row], scores[row], attn, row, int(length[row]),
                                        int(invocations[row]), src_lengths[sentence[row]])
                    ]
                active = (~finished).nonzero()[:, 0]
                if active.numel() == 0:
                    break
                sentence, tokens, scores, length, cached, invocations = (
                    t[active] for t in (sentence, tokens, scores, length, cached, invocations)
                )
                attn = attn[active] if attn is not None else None
                features, last = features[active], last[active]
                decoder.reorder_incremental_state_scripting(incremental_state, active)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, active)

            # 6. The heads at the last accepted position propose the next block.
            at_last = features.gather(1, last[:, :, None].expand(-1, -1, features.size(2)))[:, 0]
            proposals = self.propose(at_last, sentence, tokens, length)
        return finalized

    def head1_lprobs(self, features, steps, tokens, block, max_len):
        """Head 1's log-probs after each block token, constrained as fairseq's greedy: b x n x V."""
        decoder = self.model.decoder
        logits = decoder.project(decoder.head1_features(features))
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
        The heads need only `features`; the batch's sentence ids, tokens (b x L) and
        lengths (b) are there for proposal models that read the prefix (the tests'
        oracles).
        """
        if self.block_size == 1:
            return features.new_empty(features.size(0), 0, dtype=torch.long)
        decoder = self.model.decoder
        heads = decoder.block_features(features, self.block_size)[:, 1:]  # b x k-1 x C
        logits = decoder.project(heads, self.proposal_vocab)
        logits[..., self.pad] = -math.inf  # a pad in the block would read as padding
        if self.log_confidence == -math.inf:
            return logits.argmax(dim=-1)
        best, proposals = logits.log_softmax(dim=-1).max(dim=-1)  # b x k-1
        return proposals[:, : confident_width(best, self.log_confidence)]

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
