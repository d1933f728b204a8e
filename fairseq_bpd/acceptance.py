"""Verification and acceptance of a block, pure functions on tensors, and the acceptance rules.

verify ranks head 1's outputs as fairseq's greedy ranks them (log-prob + running score,
summed in float32 in fairseq's order): a Verdict. A rule says which proposals pass
(the rule protocol: `ranks`, how many of head 1's choices it reads, and
`passes(verdict, block, tree)` -> b x n-1 bool); accepted turns passes into each
sentence's deepest accepted node and its length, for chains and trees alike; commit
turns the accepted path into the sentence's new outputs. The rules here are top-k (top-1
is exact, greedy's own), min-block and distance; speculative sampling's is in
sampling.py. A new rule is a class with the same two members.
"""
import math
from typing import NamedTuple

import torch

from . import kernels


class Verdict(NamedTuple):
    """Head 1's verdict on a block (verify): candidates and values b x n x K (head 1's
    best K tokens after each node, best first, and their running scores), running b x n
    (the running score before each node's output), proposal_lprobs b x n-1 (each
    proposal's log-prob after its parent)."""

    candidates: torch.Tensor
    values: torch.Tensor
    running: torch.Tensor
    proposal_lprobs: torch.Tensor


def verify(lprobs, block, score, ranks, tree):
    """Head 1's verdict on a block, ranked as fairseq's greedy ranks: log-prob + running score.

    lprobs: b x n x V, head 1 after each block token (fairseq's constraints applied);
    block: b x n, the last committed token then the candidates laid out as `tree`
    (a chain: each after the one before); score: b, the float32 running score of the
    committed prefix; ranks: how many of head 1's choices to rank (a rule's `ranks`).
    Returns a Verdict, K = ranks.
    """
    b, n, V = lprobs.shape
    flat = tree.parents[1:] * V + block[:, 1:]  # b x n-1: a candidate in its parent's row
    proposal_lprobs = lprobs.reshape(b, n * V).gather(1, flat)  # b x n-1
    running = running_scores(score, proposal_lprobs, tree)
    values, candidates = greedy_choice(lprobs + running.unsqueeze(2), ranks)
    return Verdict(candidates, values, running, proposal_lprobs)


# greedy_choice finds a single best token by reductions from this many rows on: below it
# their extra operations cost more than topk's sort of a few rows.
CHOICE_BY_MAXIMUM = 4


def greedy_choice(scores, ranks):
    """The best `ranks` tokens of each row of `scores` (... x V, log-prob + running score),
    best first, as fairseq's beam 1 picks them (torch.topk, k=2): values and tokens, ... x ranks.

    For one rank (every exact rule's) over CHOICE_BY_MAXIMUM rows or more, the row's
    maximum where it is the only one, found by vectorised reductions: topk sorts each row
    on the CPU, about twice as slow over a wide block or batch. A tie at the top, or a row all -inf or NaN, anywhere in the block falls
    back to topk, whose choice among ties is fairseq's.
    """
    if ranks == 1:
        found = maximum_by_reductions(scores, keepdim=True)
        if found is not None and not bool(found[2]):
            return found[:2]
    values, tokens = torch.topk(scores, k=max(2, ranks), dim=-1)
    return values[..., :ranks], tokens[..., :ranks]


def best_choice(scores, speculate=False):
    """greedy_choice(scores, 1) without its last dimension: values and tokens, ... (one
    operation fewer per result than selecting them out of it).

    speculate: ask nothing on the host, and return also doubt, a 0-dim bool tensor: True
    where they may not be greedy_choice's (a tie at the top by reductions) or a score is
    NaN (its caller then fixes the NaNs and chooses again).
    """
    found = maximum_by_reductions(scores, keepdim=False)
    if found is not None and (speculate or not bool(found[2])):
        return found if speculate else found[:2]
    values, tokens = torch.topk(scores, k=2, dim=-1)
    values, tokens = values[..., 0], tokens[..., 0]
    return (values, tokens, values.isnan().any()) if speculate else (values, tokens)


def maximum_by_reductions(scores, keepdim):
    """Each row's maximum and its index (... x 1 with keepdim, else ...) and a 0-dim bool, True
    where some row's maximum is not its only one (or is NaN): the index is then no choice.
    None below CHOICE_BY_MAXIMUM rows, or where indices are not exact in the scores' dtype."""
    V = scores.size(-1)
    exact = V < 2 ** 24 and scores.dtype in (torch.float32, torch.float64)  # indices exact as floats
    if scores.numel() < CHOICE_BY_MAXIMUM * V or not exact:
        return None
    best = scores.amax(dim=-1, keepdim=True)
    hits = (scores - best).eq_(0)  # 1 at each maximum (-inf - -inf is NaN: none)
    doubt = (hits.sum(dim=-1) != 1).any()
    first = V - hits.mul_(descending(V, hits)).amax(dim=-1, keepdim=keepdim)  # the maximum's index
    return (best if keepdim else best[..., 0]), first.long(), doubt


_DESCENDING = {}


def descending(V, like):
    """V, V-1, ..., 1 in `like`'s dtype and device, kept per (V, dtype, device)."""
    key = (V, like.dtype, like.device)
    if key not in _DESCENDING:
        _DESCENDING[key] = torch.arange(V, 0, -1, dtype=like.dtype, device=like.device)
    return _DESCENDING[key]


def running_scores(score, proposal_lprobs, tree):
    """The running score before each node's output: b x n, from score b and each
    candidate's log-prob after its parent, proposal_lprobs b x n-1."""
    if tree.is_chain:  # node j follows node j-1: the same sums, column by column
        return torch.stack(chain_sums(score, proposal_lprobs.unbind(1)), dim=1)
    running = proposal_lprobs.new_empty(score.size(0), proposal_lprobs.size(1) + 1,
                                        dtype=torch.promote_types(score.dtype, proposal_lprobs.dtype))
    running[:, 0] = score
    for nodes, parents in tree.levels:  # depth by depth: sequential sums, as fairseq's loop adds
        running[:, nodes] = running[:, parents] + proposal_lprobs[:, nodes - 1]
    return running


def chain_sums(score, lprobs):
    """The running score before each node of a chain, in fairseq's order (one float add a
    node): score (b, or b x 1) and each proposal's log-prob after its parent (a sequence of
    n-1 tensors of score's shape) -> a list of n. The one place a chain's sums are made, so
    that exact_chain and verify round alike."""
    columns = [score]
    for lprob in lprobs:
        columns.append(columns[-1] + lprob)
    return columns


class TopK:
    """A proposal passes when it is among head 1's top `topk` after its parent, with a finite
    score. TopK(1) is exact decoding: greedy's own choice, the paper's rule."""

    def __init__(self, topk=1):
        self.topk = self.ranks = topk

    def passes(self, verdict, block, tree):
        """b x n-1 bool, from a Verdict on `block` b x n laid out as `tree`."""
        topk = self.topk
        if tree.is_chain:  # each proposal's parent is the node before it: slices, no indexing
            candidates, values = verdict.candidates[:, :-1, :topk], verdict.values[:, :-1, :topk]
        else:
            parents = tree.parents[1:]
            candidates, values = verdict.candidates[:, parents, :topk], verdict.values[:, parents, :topk]
        return ((candidates == block[:, 1:, None]) & (values > -math.inf)).any(dim=2)


class MinBlock:
    """`rule`, except that the chain's first min_block - 1 proposals pass unverified unless
    forbidden (log-prob -inf): fewer invocations for some loss of quality."""

    def __init__(self, rule, min_block):
        self.rule, self.min_block, self.ranks = rule, min_block, rule.ranks

    def passes(self, verdict, block, tree):
        forced = tree.chain[1:] & (tree.depth[1:] < self.min_block)  # n-1
        return self.rule.passes(verdict, block, tree) | (forced & (verdict.proposal_lprobs > -math.inf))


class WithinDistance:
    """The paper's approximate acceptance for ordinal outputs (section 7.2), --blockwise-distance
    E: a proposal passes when its number (numbers: V, from symbol_numbers) differs from head
    1's choice after the tokens before it by at most E, with a finite log-prob. A chain's rule."""

    ranks = 1

    def __init__(self, numbers, distance):
        self.numbers, self.distance = numbers, distance

    def passes(self, verdict, block, tree):
        proposals, choices = block[:, 1:], verdict.candidates[:, :-1, 0]  # b x n-1
        numbers = self.numbers.to(block.device)
        proposed, chosen = numbers[proposals], numbers[choices]
        near = (proposed - chosen).abs() <= self.distance + rounding_slack(proposed, chosen, self.distance)  # NaN: False
        return ((proposals == choices) | near) & (verdict.proposal_lprobs > -math.inf)


def rule_for(options, tgt_dict):
    """The acceptance rule BlockwiseOptions ask for (refusals.py refused what combines none)."""
    if options.distance > 0:
        return WithinDistance(symbol_numbers(tgt_dict), options.distance)
    rule = TopK(options.topk)
    return MinBlock(rule, options.min_block) if options.min_block > 1 else rule


def accepted(passes, limit, tree):
    """The deepest node each sentence accepts, from which proposals pass: node b (0: none) and
    the outputs kept b (its depth + 1, head 1's choice after it included).

    passes: b x n-1; limit: b, the most outputs each sentence may add (None: no limit
    within the block). A node is accepted
    when it and all its ancestors pass and its outputs fit in `limit`; the deepest wins,
    the first in node order on a tie (possible only when a rule passes more than greedy's
    own choice: top-k, min-block, distance).
    """
    if tree.is_chain:  # node j is at depth j: the longest passing run, within the limit
        kept = 1 + passes.long().cumprod(dim=1).sum(dim=1)
        kept = kept if limit is None else torch.minimum(kept, limit)
        return kept - 1, kept
    # A node is reached when no node on its path (tree.ancestors) fails: b x n.
    fails = torch.cat([passes.new_zeros(passes.size(0), 1), ~passes], dim=1)
    reached = ~(fails[:, None, :] & tree.ancestors).any(dim=2)
    if limit is not None:
        reached &= tree.depth < limit[:, None]
    n = tree.size
    order = tree.depth * n - torch.arange(n, device=passes.device)  # deeper first, then earlier
    node = torch.where(reached, order, -n).argmax(dim=1)
    return node, tree.depth[node] + 1


def along(path, *tensors):
    """Each sentence's entries at its own nodes: path b x m, tensors b x n (x ...) -> b x m (x ...)."""
    return [t.gather(1, path.view(*path.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))
            for t in tensors]


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


def rounding_slack(a, b, distance):
    """How far float64 may put |a - b| above `distance` when in decimal it is not: a's shape.

    Symbols and E are decimals, read as the nearest float64s: 1.1 - 0.9 comes out
    0.20000000000000007, past E = 0.2. Reading a, b and E and subtracting round by half
    an ulp each, of at most the largest magnitude: four ulps of it cover them all.
    (Where an ulp nears E, numbers past about 1e15 * E, float64 cannot tell E apart at all.)
    """
    return 4 * torch.finfo(torch.float64).eps * torch.maximum(a.abs(), b.abs()).clamp(min=distance)


def confident_width(best, log_confidence):
    """How many proposals the next block keeps under --blockwise-confidence: an int.

    best: b x k-1, each head's top log-prob (over the vocabulary it proposes from).
    A sentence keeps proposals while the product of their top probabilities stays
    at or above the confidence; the batch shares one block, so the widest sentence
    sets it (the others' extra proposals are verified like any other).
    """
    # Summed a proposal at a time in best's dtype (not cumsum, which on a CPU sums float32 in
    # float64): a proposer that stops proposing where every sum has fallen below (the draft)
    # makes these very sums, so it never stops before the proposal this cuts at.
    if best.size(0) == 0:
        return 0
    sums = best.clone()
    for j in range(1, sums.size(1)):
        sums[:, j] += sums[:, j - 1]
    # Up to each row's first sum below (log-probs only make the sums fall; counted as a prefix
    # all the same, so that a proposer's log-prob above 0 cannot widen the cut).
    return int((sums >= log_confidence).cumprod(dim=1).sum(dim=1).max())


def chain_kernel(lprobs, score):
    """The compiled kernels where their exact_chain takes these log-probs (b x n x V, rows
    contiguous) and running score (float32, as fairseq keeps it, or the log-probs' dtype,
    so that its sums are torch's); else None."""
    kern = kernels.serve(lprobs)
    if kern is None or lprobs.stride(-1) != 1 or score.dtype not in (torch.float32, lprobs.dtype):
        return None
    return kern


def exact_chain(lprobs, block, score, limit, eos, speculate=False, out=None):
    """verify, accept and commit fused, for greedy's own rule (TopK(1)) on a chain.

    lprobs: b x n x V, block: b x n, score: b, as verify takes them; limit: b, or None
    where no sentence can reach its maximum length within the block. On the accepted
    prefix each proposal is head 1's choice after the token before it, and its running
    score is that choice's value: both are the float sum running + lprob of the same
    two numbers, in fairseq's order. The outputs are then head 1's choices after every
    block token and their scores those choices' values, with nothing to concatenate or
    scatter (what lies after `kept` is never read). Returns kept b and commit's outputs
    b x n, output_scores b x n, added b and finished b; speculate: also best_choice's doubt
    (lprobs whose NaNs are not yet fixed: nothing is asked on the host). out: a b x n x V
    float32 tensor the sums are made in (scratch: nothing returned is a view of it).
    """
    kern = chain_kernel(lprobs, score)
    if kern is not None:  # all of it in one call, the same sums and choices
        *fused, doubt = kern.exact_chain(lprobs, block, score, limit, eos)
        if speculate:
            return (*fused, doubt)
        if not bool(doubt):
            return tuple(fused)
        # a tie at the top or a NaN: torch's topk below chooses, fairseq's choice among ties
    proposals = block[:, 1:]  # b x n-1
    # b x 1 columns, stacked b x n x 1: the running score before each node, broadcast over V.
    columns = chain_sums(score[:, None], lprobs.gather(2, proposals[..., None]).unbind(1))
    values, candidates, *doubt = best_choice(plus(lprobs, torch.stack(columns, dim=1), out), speculate)  # b x n
    passes = (candidates[:, :-1] == proposals) & (values[:, :-1] > -math.inf)  # b x n-1: TopK(1)
    kept = passes.cumprod(dim=1).sum(dim=1) + 1
    if limit is not None:
        kept = torch.minimum(kept, limit)
    before_eos = (candidates != eos).cumprod(dim=1).sum(dim=1)  # b: outputs before the first EOS
    added = torch.minimum(kept, before_eos + 1)
    return (kept, candidates, values, added, before_eos < kept, *doubt)


def greedy_step(lprobs, score, eos, speculate=False):
    """A block of one token (no proposals): head 1's choice, as commit gives it for n = 1.

    lprobs: b x 1 x V, score: b. Ranks as verify does (greedy_choice), with nothing to
    accept or roll back. Returns commit's outputs and output scores (b x 1), added (b,
    all 1) and finished (b). speculate (lprobs whose NaNs may not be fixed yet): nothing
    asked on the host, and also a doubt (a 0-dim bool: a NaN, or for the compiled kernel's
    choice a tie at the top; the caller fixes the NaNs and steps again).
    """
    b, _, V = lprobs.shape
    kern = chain_kernel(lprobs, score)
    if kern is not None:  # a chain of one in one call: its choice, value, EOS
        _, outputs, values, added, finished, doubt = kern.exact_chain(lprobs, lprobs.new_empty((b, 1), dtype=torch.long),
                                                                      score, None, eos)
        if speculate:
            return outputs, values, added, finished, doubt
        if not bool(doubt):
            return outputs, values, added, finished
        # a tie at the top or a NaN: topk below chooses, fairseq's choice among ties
    # As b x V rows: the choices come out b x 1, the outputs' own shape (no reshaping after).
    values, outputs = greedy_choice(lprobs.reshape(b, V) + score.view(b, 1), 1)
    stepped = outputs, values, torch.ones_like(score, dtype=torch.long), outputs.view(b) == eos
    return (*stepped, lprobs.isnan().any()) if speculate else stepped  # topk would rank a NaN first


def plus(lprobs, running, out=None):
    """lprobs + running (broadcast), made in `out` where given (lprobs' shape) and of their dtype."""
    if out is None or not lprobs.dtype == running.dtype == out.dtype:
        return lprobs + running
    return torch.add(lprobs, running, out=out)


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
