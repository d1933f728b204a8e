"""Lossless speculative sampling with the proposal heads: `--blockwise --sampling`.

Speculative sampling (Leviathan, Kalman & Matias, ICML 2023; Chen et al. 2023) on the
blockwise loop (Stern, Shazeer & Uszkoreit, NeurIPS 2018): heads 2..k draw the proposals
from their own distributions q; head 1's distribution p after each block token, shaped
exactly as fairseq's sampling search shapes it, accepts proposal x with probability
min(1, p(x)/q(x)); at the first rejection the output is drawn from norm(max(0, p - q)),
and when every proposal passes, one more token is drawn from p. Each output then follows
p given the outputs before it: the sentences are distributed exactly as fairseq's
`--sampling --beam 1`, in one decoder pass per block.
"""
import math

import torch
from fairseq.search import Sampling

from .acceptance import accepted, commit, confident_width, running_scores
from .generator import BlockwiseGenerator


def sampling_probs(lprobs, search):
    """What fairseq's Sampling `search` draws from: lprobs ... x V -> weights ... x V.

    exp(lprobs) on the support (the top-p nucleus by the search's own _sample_topp, else
    the top-k, else everything), 0 elsewhere; not renormalized, as fairseq records
    log(weight) as a drawn token's score and torch.multinomial normalizes.
    """
    shape = lprobs.shape
    lprobs = lprobs.reshape(-1, 1, shape[-1])  # fairseq's bsz x beam x V
    if search.sampling_topp > 0:
        weights, indices = search._sample_topp(lprobs.clone())
    elif search.sampling_topk > 0:
        values, indices = lprobs.topk(min(search.sampling_topk, shape[-1]), dim=-1)
        weights = values.exp()
    else:
        return lprobs.exp().view(shape)
    return torch.zeros_like(lprobs).scatter_(-1, indices, weights).view(shape)


def draw(weights, generator=None):
    """One token per row of nonnegative weights ... x V (any scale): ... long."""
    flat = weights.reshape(-1, weights.size(-1))
    return torch.multinomial(flat, 1, generator=generator).view(weights.shape[:-1])


def speculative_accept(p, q, proposals, generator=None):
    """Which proposals pass: u < p(x)/q(x), u uniform in [0, 1) (probability min(1, p/q)).

    p: b x n-1 x V, head 1's normalized distribution at each proposal's position; q: the
    same shape, the distribution each proposal was drawn from; proposals: b x n-1.
    Returns passes b x n-1 (bool).
    """
    px = p.gather(2, proposals[..., None])[..., 0]
    qx = q.gather(2, proposals[..., None])[..., 0]
    uniform = torch.rand(px.shape, generator=generator, dtype=px.dtype, device=px.device)
    return uniform * qx < px


class SpeculativeRule:
    """Speculative sampling's acceptance rule (the rule protocol, acceptance.py): a proposal x
    passes with probability min(1, p(x)/q(x)). Its verdict is (p, q), b x n-1 x V each: head
    1's normalized distribution at each proposal's position and the q it was drawn from.
    generator: a torch.Generator for the uniform draws (None: torch's global one)."""

    def __init__(self, generator=None):
        self.generator = generator

    def passes(self, verdict, block, tree):
        p, q = verdict
        return speculative_accept(p, q, block[:, 1:], self.generator)


def at(x, position):
    """Each sentence's row at `position` (b) of x b x n x V: b x V."""
    return x.gather(1, position[:, None, None].expand(-1, 1, x.size(2)))[:, 0]


def residual(p, q):
    """norm(max(0, p - q)) up to scale: b x V. It is all 0 only if p = q, when no proposal
    is rejected; p then stands in, for rounding's sake."""
    weights = (p - q).clamp(min=0)
    return torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p)


class SpeculativeSampler(BlockwiseGenerator):
    """fairseq's `--sampling --beam 1` distribution, k tokens at a time (see module docstring).

    The options' sampling_topk, sampling_topp: fairseq's --sampling-topk/--sampling-topp
    (-1: off; top-p wins when both are given, as in fairseq). The heads' q gets the same
    temperature and top-k/top-p. generator: a torch.Generator for the draws (None:
    torch's global one, which fairseq-generate seeds with --seed).
    """

    implies = {"sampling": True}

    def __init__(self, model, tgt_dict, options=None, stats=None, generator=None, **fields):
        super().__init__(model, tgt_dict, options, stats, **fields)
        self.search = Sampling(self.model.decoder.dictionary, self.options.sampling_topk, self.options.sampling_topp)
        self.generator = generator
        self.rule = SpeculativeRule(generator)
        self.draft = None  # b x n-1 x V: the q each pending proposal was drawn from (next_proposals)

    def verify_block(self, lprobs, block, score, limit, tree):
        """Speculative sampling's steps 2-4: lprobs b x n x V, block b x n (a chain: `tree`
        is one), score b, limit b.

        Returns the accepted node b, kept b (node j of a chain is at depth j: kept = j + 1),
        then commit's outputs, output_scores (fairseq's recorded scores: log of the drawn
        token's weight, summed in float32), added and finished.
        """
        weights = sampling_probs(lprobs, self.search)  # b x n x V
        p = weights / weights.sum(dim=2, keepdim=True)
        n = block.size(1)
        q = self.draft if n > 1 else p[:, :0]  # b x n-1 x V
        # 2. Verify: each proposal passes with probability min(1, p/q); 3. accept the passing run.
        passes = self.rule.passes((p[:, :-1], q), block, tree)  # b x n-1
        _, kept = accepted(passes, limit, tree)

        # 4. The output after the kept proposals: from the residual where the proposal
        # there was rejected, from p where it was not (all passed, or `limit` cut the block).
        last = kept - 1
        rejected = ~torch.cat([passes, passes.new_ones(passes.size(0), 1)], dim=1).gather(1, last[:, None])  # b x 1
        # After an accepted EOS nothing is output, and head 1 may have nothing left to draw
        # from (n-gram blocking can ban EOS there too): a uniform row stands in.
        ended = ((block[:, 1:] == self.eos) & (torch.arange(1, n, device=block.device) <= last[:, None])).any(dim=1)
        p_last = torch.where(ended[:, None], 1.0, at(p, last))
        q_last = at(torch.cat([q, p[:, -1:]], dim=1), last)  # after the last block token, no proposal: p
        final = draw(torch.where(rejected, self.correction(p_last, q_last), p_last), self.generator)  # b

        # Scores as fairseq's Sampling records them: log of the drawn token's weight.
        running = running_scores(score, weights[:, :-1].gather(2, block[:, 1:, None])[..., 0].log(), tree)  # b x n
        candidates = final[:, None, None].expand(-1, n, 1)  # b x n x 1
        values = running[..., None] + weights.gather(2, candidates).log()
        return (kept - 1, kept, *commit(block, candidates, values, running, kept, self.eos))

    def correction(self, p, q):
        """Where the output after a rejection is drawn from: b x V (a method: tests swap it)."""
        return residual(p, q)

    def next_proposals(self, features, token, encoder_out, batch):
        """Each proposal drawn from the proposer's q: features b x C -> b x n-1 x 1 tokens (a
        chain: one draw each; arguments as BlockwiseGenerator.next_proposals).

        Keeps each q, over the whole dictionary, in self.draft for verify_block.
        """
        width = self.policy.width(features.size(0))
        logits = self.proposer.logits(features, token, width, self.proposal_vocab, encoder_out)  # b x w-1 x N
        if self.temperature != 1.0:
            logits = logits / self.temperature
        weights = sampling_probs(logits.float().log_softmax(dim=-1), self.search)
        q = weights / weights.sum(dim=-1, keepdim=True)
        if self.log_confidence > -math.inf:
            q = q[:, : confident_width(q.max(dim=-1).values.log(), self.log_confidence)]
        vocab = len(self.model.decoder.dictionary)
        self.draft = torch.nn.functional.pad(q, (0, vocab - q.size(-1)))  # b x n-1 x V
        return draw(q, self.generator)[..., None]

