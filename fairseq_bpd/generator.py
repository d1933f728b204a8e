"""Blockwise parallel decoding (Stern, Shazeer & Uszkoreit, NeurIPS 2018, sections 3-5).

Each decoder invocation feeds a block: the last committed token and the k-1 tokens the
proposal heads predicted after it. Head 1's outputs over the block verify the
proposals; the longest verified prefix is accepted, the rejected suffix is cropped
from the cache, and the heads at the last accepted position propose the next block
(combined scoring and proposal: m/k + 1 invocations for m tokens, not 2m/k).
Under --blockwise-tree the block is a tree of candidates (tree.py) rather than a chain:
the same steps, with an ancestor mask, positions by depth and the deepest verified path.
One invocation: forward_block -> verify -> accept -> commit -> crop -> retire -> propose.
The loop asks three objects and never which kind each is: its acceptance rule which
proposals pass (acceptance.py), its proposer for the next block (heads.py's protocol),
its width policy how wide that block is (FixedWidth, or adaptive.py's AdaptiveWidth).
A block of one token (the first pass, and width 1 under --blockwise-adaptive) has
nothing to verify or crop: greedy_step, at the cost of fairseq's own greedy step. A
chain under greedy's own rule, the common case, is verified, accepted and committed by
one fused function (acceptance.exact_chain), which asks the host once a block.
"""
import logging
import math
from collections import Counter

import torch
from torch import nn
from fairseq.models.fairseq_decoder import FairseqDecoder
from fairseq.models.fairseq_model import BaseFairseqModel
from fairseq.models.transformer import TransformerModelBase
from fairseq.ngram_repeat_block import NGramRepeatBlock

from . import kernels
from .acceptance import TopK, accepted, along, commit, confident_width, exact_chain, greedy_step, rule_for, verify
from .encoder_pass import encode
from .options import BlockwiseOptions
from .refusals import refuse_for_model, refuse_prefix
from .tree import Tree, default_rates, warn_if_measured_otherwise

logger = logging.getLogger(__name__)


class BlockwiseStats:
    """Sentences, tokens, decoder invocations and accepted block sizes over a run."""

    def __init__(self):
        self.sentences = self.tokens = self.invocations = 0
        self.accepted = Counter()
        self.widths = Counter()  # block widths chosen (--blockwise-adaptive)

    def mean_accepted_block(self):
        iterations = sum(self.accepted.values())
        return sum(size * count for size, count in self.accepted.items()) / max(iterations, 1)

    def log(self):
        """Log the summary, if anything was decoded."""
        if self.sentences:
            logger.info(self.summary())

    def summary(self):
        summary = (
            f"blockwise: {self.sentences} sentences, {self.tokens} tokens, "
            f"{self.invocations} decoder invocations, mean accepted block size "
            f"{self.mean_accepted_block():.3f}, accepted block sizes {histogram(self.accepted)}"
        )
        if self.widths:
            summary += f", block widths chosen {histogram(self.widths)}"
        return summary


def histogram(counts):
    """A Counter of sizes as `{1:12 2:5}`."""
    return "{" + " ".join(f"{size}:{counts[size]}" for size in sorted(counts)) + "}"


class Batch:
    """The sentences still decoding and what each has so far; finished ones leave.

    sentence: b, ids in the input batch; tokens: b x L, BOS then the output; scores:
    b x L, the running score after each output (float32, as fairseq keeps it, whatever
    torch's default dtype); score: b, the last of them (0 before any output); attn:
    b x S x L or None; length: b, outputs so far; cached: b, decoder inputs in the cache;
    offsets: 1..L, the columns after a sentence's last output (kept, not made per block);
    vocab: what the proposals range over (BlockwiseGenerator.vocabulary), the same for the
    whole batch.
    Every sentence takes part in every invocation until it finishes, so the loop counts
    invocations once, not per sentence.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def select(self, rows):
        """Keep the sentences at `rows` (b')."""
        for name, value in vars(self).items():
            if value is not None and name not in ("offsets", "vocab"):
                setattr(self, name, value[rows])

    def store(self, outputs, output_scores, added, block_attn, pad):
        """Write a block's outputs b x n after each sentence's; outputs past `added` read pad."""
        offsets = self.offsets[: outputs.size(1)]  # n: 1, 2, ...
        columns = self.length[:, None] + offsets  # b x n
        output_scores = output_scores if output_scores.dtype == self.scores.dtype else output_scores.to(self.scores)
        self.tokens.scatter_(1, columns, torch.where(offsets <= added[:, None], outputs, pad))
        self.scores.scatter_(1, columns - 1, output_scores)
        self.score = output_scores.gather(1, added[:, None] - 1)[:, 0]
        if block_attn is not None:
            if self.attn is None:
                self.attn = self.scores.new_zeros(*block_attn.shape[::2], self.scores.size(1))
            index = columns[:, None, :].expand(-1, block_attn.size(2), -1)
            block_attn = block_attn if block_attn.dtype == self.attn.dtype else block_attn.to(self.attn)
            self.attn.scatter_(2, index, block_attn.transpose(1, 2))
        self.length = self.length + added

    def store_one(self, outputs, output_scores, block_attn, length, added=1):
        """store() where one count holds for every sentence: each at `length` outputs adds
        `added` (host ints), written at the same columns (narrow copies, no per-row index).
        The columns after them are never written here, so they keep their padding."""
        if added < outputs.size(1):
            outputs, output_scores = outputs[:, :added], output_scores[:, :added]
            block_attn = block_attn[:, :added] if block_attn is not None else None
        self.tokens.narrow(1, length + 1, added).copy_(outputs)
        self.scores.narrow(1, length, added).copy_(output_scores)
        self.score = output_scores[:, added - 1]
        if self.score.dtype != self.scores.dtype:
            self.score = self.score.to(self.scores)
        if block_attn is not None:
            if self.attn is None:
                self.attn = self.scores.new_zeros(*block_attn.shape[::2], self.scores.size(1))
            self.attn.narrow(2, length + 1, added).copy_(block_attn.transpose(1, 2))
        self.length = self.length + added


class BlockwiseGenerator(nn.Module):
    """Greedy decoding, k tokens at a time: fairseq's SequenceGenerator(beam_size=1) output."""

    # Options a subclass decodes by its nature (the sampler's sampling, the adaptive width's
    # adaptive); BlockwiseOptions.generator() picks the class that decodes them.
    implies = {}

    def __init__(self, model, tgt_dict, options=None, stats=None, proposer=None, **fields):
        """options: a BlockwiseOptions, checked here against the model and dictionary
        (refusals.refuse_for_model); or, for callers that build none, its fields as keywords.
        stats: a BlockwiseStats to count into (the task passes one for a whole run, and logs
        it). proposer: what proposes the blocks (heads.py's protocol; None: the checkpoint's heads)."""
        super().__init__()
        if options is None:
            options = BlockwiseOptions(**{**fields, **self.implies})
        elif fields:
            raise TypeError(f"give the options or their fields, not both (got {sorted(fields)})")
        elif self.implies:
            options = options.replace(**self.implies)
        if (options.sampling, options.adaptive) != (self.implies.get("sampling", False),
                                                    self.implies.get("adaptive", False)):
            raise TypeError(f"{type(self).__name__} does not decode these options (sampling or adaptive): "
                            f"build the generator with options.generator(model, tgt_dict)")
        self.model, self.options = model, options
        # A plain attribute, not a submodule: the heads are the model's, and the loop reads
        # it every invocation (a submodule is found through nn.Module's __getattr__).
        proposer = getattr(model.decoder, "heads", None) if proposer is None else proposer  # None: refused next
        refuse_for_model(options, model, tgt_dict, proposer)
        self.__dict__["proposer"] = proposer
        self.block_size = block_size = options.block_size or model.decoder.proposal_heads
        self.rule = rule_for(options, tgt_dict)
        self.log_confidence = math.log(options.confidence) if options.confidence > 0 else -math.inf
        # 0: what the heads were trained on (--head-vocab), else the whole dictionary.
        self.proposal_vocab = options.proposal_vocab or getattr(model.decoder, "head_vocab", 0)
        # and past them, the rarer tokens that a batch's source words bring (vocabulary())
        self.lexicon = options.proposal_lexicon
        self.dictionaries = (getattr(getattr(model, "encoder", None), "dictionary", None), tgt_dict)
        # The candidates of a block: the chain of top choices, or the best tree of `tree`
        # nodes, ranked among the tokens the heads may propose (padding never).
        heads, ranks = block_size - 1, (self.proposal_vocab or len(tgt_dict)) - 1
        rates = [row[:ranks] for row in options.tree_rates or default_rates(heads)]
        if options.tree:
            warn_if_measured_otherwise(options.tree_rates_over, self.proposal_vocab, self.lexicon is not None,
                                       len(tgt_dict))
        self.layout = Tree.best(rates, options.tree, heads) if options.tree else Tree.chain_of(heads)
        self.policy = FixedWidth(self.layout.max_depth + 1)
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.max_len_a, self.max_len_b = options.max_len_a, options.max_len_b
        self.max_len = options.max_len or model.max_decoder_positions()
        self.min_len = options.min_len
        self.normalize_scores, self.len_penalty = options.normalize_scores, options.len_penalty
        self.unk_penalty, self.temperature = options.unk_penalty, options.temperature
        self.match_source_len = options.match_source_len
        self.repeat_ngram_blocker = (
            NGramRepeatBlock(options.no_repeat_ngram_size) if options.no_repeat_ngram_size > 0 else None
        )
        self.stats = BlockwiseStats() if stats is None else stats

    def cuda(self):
        self.model.cuda()
        return self

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        refuse_prefix(prefix_tokens, constraints)
        # inference_mode, not no_grad: no version counters or view tracking on a block's many
        # small tensors, which a loop of small operations feels. The hypotheses are copied
        # out of it: fairseq's scripts update some in place, which it forbids.
        with torch.inference_mode():
            finalized = self._generate(sample, bos_token)
        return [[{key: value.clone() if torch.is_tensor(value) else value for key, value in hypo.items()}
                 for hypo in hypos] for hypos in finalized]

    def _generate(self, sample, bos_token=None):
        model, decoder = self.model, self.model.decoder
        net_input = sample["net_input"]
        src_tokens, src_lengths = net_input["src_tokens"], net_input["src_lengths"]
        max_len = self.max_length(src_tokens, src_lengths)
        encoder_out = encode(model, net_input)  # the one encoder output every pass and proposal reads
        batch = self.start(src_tokens, max_len, bos_token)
        layout = self.layout if self.layout.depth.device == src_tokens.device else self.layout.to(src_tokens.device)
        proposals = src_tokens.new_empty(batch.length.size(0), 0, layout.topn)  # b x heads x ranks
        token = batch.tokens[:, :1]  # b x 1: the last committed token (BOS)
        incremental_state = {}
        scratch = Scratch(plain_normalizer(model))  # the batch's: no invocation keeps what it holds
        finalized = [[] for _ in range(src_tokens.size(0))]
        self.policy.start()

        invocations = 0  # every sentence still here took part in each
        while True:
            # 1. One decoder pass over the block: the last committed token, then the candidates.
            tree = layout.upto(proposals.size(1))
            if proposals.size(1) == 0:  # a block of one
                block = token
            else:
                if tree.is_chain:  # b x n-1: each head's best
                    nodes = proposals[:, :, 0]
                else:  # b x n-1: the proposer lays its candidates out as the tree, after `last` and `token`
                    nodes = self.proposer.nodes(proposals, tree, last, token[:, 0], batch.vocab, encoder_out)
                block = torch.cat([token, nodes], dim=1)  # b x n
            n = block.size(1)
            # Bounds known on the host: every length is at most the cache's width (cached ==
            # length) and at least the invocations so far (each adds one output or more).
            bounds = (invocations, decoder.cache_width(incremental_state) + tree.max_depth)
            # Every sentence's length, where the cache knows them equal (an int; batch 1 always).
            length = decoder.cached_length(incremental_state)
            steps = None  # b x n: the step each output predicts, made where something reads it
            if length is not None and tree.is_chain and bounds[1] < max_len:
                positions = length  # the chain's first position, the same for every row
                if self.step_constraints(bounds, max_len):
                    steps = batch.length[:, None] + tree.depth
            else:
                steps = batch.length[:, None] + tree.depth
                positions = steps if bounds[1] < max_len else steps.clamp(max=max_len)
            features, block_attn = decoder.forward_block(block, positions, encoder_out, incremental_state, tree.mask,
                                                         min(bounds[1], max_len),  # the longest position
                                                         self.options.attention)  # the alignment
            invocations += 1
            # Greedy's own rule on a chain asks the host nothing before its one read (take_stock).
            # So does a block of one where the compiled kernel chooses (it finds a NaN itself).
            speculate = self.fused(tree) and (n > 1 or kernels.serve(features) is not None)
            lprobs = self.head1_lprobs(features, steps, batch.tokens, block, max_len, tree,
                                       src_lengths[batch.sentence] if self.match_source_len else None, bounds,
                                       checked=not speculate, scratch=scratch)

            # 2.-4. Verify the candidates with head 1, accept the deepest passing path, commit it.
            # No limit where no sentence can reach max_len within the block (and nothing reads it).
            limit = (max_len + 1 - batch.length if bounds[1] >= max_len or getattr(self.policy, "observes", True)
                     else None)
            known_length = tree.is_chain and length is not None
            stock = None
            if speculate:
                verified = self.verify_block(lprobs, block, batch.score, limit, tree, speculate=True, scratch=scratch)
                stock = self.take_stock(n, invocations, verified, known_length)
                if stock is None:  # in doubt (a NaN, or a tie at the top): verified again as always
                    fix_nan(lprobs)
            if stock is None:
                verified = self.verify_block(lprobs, block, batch.score, limit, tree)
                stock = self.take_stock(n, invocations, verified, known_length)
            node, kept, outputs, output_scores, added, finished = verified[:6]
            ended, count, counts = stock
            self.policy.observe(n, kept, added, limit)
            # b x D+1: the accepted path's nodes, then padding (a block of one: its root for all)
            path = tree.paths.expand(node.size(0), -1) if n == 1 else tree.paths[node]
            if block_attn is not None and not tree.is_chain:  # a chain's path is the block itself
                block_attn = along(path, block_attn)[0]
            if count is not None:  # every sentence at `length` added `count`: the same columns
                batch.store_one(outputs, output_scores, block_attn, length, count)
            else:
                batch.store(outputs, output_scores, added, block_attn, self.pad)

            # 5. Crop all but the accepted path out of the cache (and out of the proposer's state).
            batch.cached = decoder.crop_cache(incremental_state, batch.cached, n, path, kept, counts)
            self.proposer.keep(path, kept, features, block)
            # b x C, b x 1: the decoder output at the last accepted node, and head 1's choice after it
            if n == 1:
                last, token = features[:, 0], outputs
            elif count is not None:
                last, token = features[:, count - 1], outputs[:, count - 1 : count]
            else:  # read below, once the batch holds only the sentences that go on
                last, token = along(node[:, None], features)[0][:, 0], None

            # 6. Finished sentences leave the batch.
            if ended is None:  # a block of one: asked here
                ended = finished.nonzero()[:, 0].tolist() if finished.any() else []
            if ended:
                self.retire(batch, ended, finalized, src_lengths, invocations)
                if len(ended) == finished.size(0):
                    return finalized
                active = (~finished).nonzero()[:, 0]
                batch.select(active)
                last = last[active]
                token = token[active] if token is not None else None
                decoder.reorder_incremental_state_scripting(incremental_state, active)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, active)
                self.proposer.reorder(active)

            # 7. The proposer at the last accepted position proposes the next block.
            if token is None:
                token = batch.tokens.gather(1, batch.length[:, None])
            proposals = self.next_proposals(last, token[:, 0], encoder_out, batch)

    def take_stock(self, n, invocations, verified, known_length):
        """Count a block of `n` in the stats, and read what the loop decides on: the rows that
        finished (a host list, or None where the loop asks itself: a block of one, whose
        count needs no read) and, where every sentence kept as many (known_length: a chain
        whose sentences are all as long) and none finished, that count (an int, else None).

        verified: verify_block's values. A wider block is read once: kept, added and
        finished b together, and a speculating verify_block's doubt, on which this counts
        nothing and returns None.
        """
        _, kept, _, _, added, finished, *doubt = verified
        if n == 1:  # every sentence added one: no need to ask
            if doubt and bool(doubt[0]):  # the compiled kernel's choice, in doubt: counted when made again
                return None
            # The first, on BOS alone, verifies nothing, unless every block is one token
            # (--block-size 1, or width 1 where no width table is found): then each counts.
            if invocations > 1 or self.block_size == 1 or getattr(self.policy, "fixed", None) == 1:
                self.stats.accepted[1] += added.size(0)
            return None, 1 if known_length else None, None
        if doubt:  # kept 0 (else at least 1): in doubt
            kept = kept.masked_fill(doubt[0], 0)
        kept, added, finished = torch.stack([kept, added, finished]).tolist()
        if not kept[0]:
            return None
        if invocations > 1:
            self.stats.accepted.update(added)
        rows = [row for row, ended in enumerate(finished) if ended]
        same = known_length and not rows and min(kept) == max(kept)
        return rows, kept[0] if same else None, kept

    def fused(self, tree):
        """Whether a block laid out as `tree` is verified by exact_chain: a chain under greedy's
        own rule (TopK(1) itself: a subclass may pass more)."""
        return tree.is_chain and type(self.rule) is TopK and self.rule.topk == 1

    def verify_block(self, lprobs, block, score, limit, tree, speculate=False, scratch=None):
        """Steps 2-4 on head 1's lprobs b x n x V over `block` b x n laid out as `tree`.

        score: b, the running score so far; limit: b, the most outputs each sentence may add
        (None: no sentence reaches its maximum length within the block). Returns the accepted
        node b, the outputs it keeps b (its depth + 1), then commit's outputs b x D+1,
        output_scores b x D+1, added b and finished b, along its path.
        speculate (greedy's own rule on a chain, lprobs from head1_lprobs(checked=False)): asks
        nothing on the host, and returns also exact_chain's doubt (True: fix_nan, verify again).
        scratch: a Scratch that exact_chain's sums are made in.
        """
        if block.size(1) == 1:  # nothing to verify (the first pass, a width of 1): fairseq's greedy step
            outputs, output_scores, added, finished, *doubt = greedy_step(lprobs, score, self.eos, speculate)
            return (torch.zeros_like(added), added, outputs, output_scores, added, finished, *doubt)
        if self.fused(tree):
            out = scratch.take("sums", lprobs) if scratch is not None else None
            kept, *committed = exact_chain(lprobs, block, score, limit, self.eos, speculate, out)
            return (kept - 1, kept, *committed)
        # 2. Verify the candidates with head 1, 3. accept the deepest path whose proposals pass.
        verdict = verify(lprobs, block, score, self.rule.ranks, tree)
        node, kept = accepted(self.rule.passes(verdict, block, tree), limit, tree)
        # 4. Commit the path and head 1's choice after it (a chain's path is the block itself).
        candidates, values, running, _ = verdict
        along_path = (lambda *t: t) if tree.is_chain else (lambda *t: along(tree.paths[node], *t))
        return (node, kept, *commit(*along_path(block, candidates, values, running), kept, self.eos))

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
            scores=torch.zeros(bsz, width, dtype=torch.float32, device=device), attn=None, length=length,
            score=torch.zeros(bsz, dtype=torch.float32, device=device), cached=torch.zeros_like(length),
            offsets=torch.arange(1, width + 1, device=device), vocab=self.vocabulary(src_tokens),
        )

    def vocabulary(self, src_tokens):
        """What the batch's proposals range over: the first proposal_vocab entries (0: all of
        them) or, under a lexicon, a ProposalVocabulary of those and the rarer target tokens
        that the batch's source tokens (B x S) bring."""
        if self.lexicon is None:
            return self.proposal_vocab
        return self.lexicon.vocabulary(src_tokens, self.proposal_vocab, *self.dictionaries)

    def retire(self, batch, rows, finalized, src_lengths, invocations):
        """Hypotheses of the sentences at `rows` (a host list of the batch's rows, those that
        finished), into `finalized`; each took part in all `invocations` so far."""
        for row in rows:
            sentence = int(batch.sentence[row])
            finalized[sentence] = [
                self.hypothesis(batch.tokens[row], batch.scores[row], batch.attn, row, int(batch.length[row]),
                                invocations, src_lengths[sentence])
            ]

    def step_constraints(self, bounds, max_len):
        """Whether head1_lprobs reads the steps of a block whose steps lie within `bounds`
        (host ints: at most the least step, at least the greatest)."""
        return (bounds[1] >= max_len or bounds[0] < self.min_len or self.repeat_ngram_blocker is not None
                or self.match_source_len)

    def head1_lprobs(self, features, steps, tokens, block, max_len, tree, src_lengths, bounds=(0, math.inf),
                     checked=True, scratch=None):
        """Head 1's log-probs after each block token, constrained as fairseq's greedy: b x n x V.

        steps: b x n, the step each output predicts (None where step_constraints says none
        is read); src_lengths: b (under match_source_len); bounds: host ints at most the
        least step and at least the greatest, which skip the length constraints where they
        cannot bite without asking the device; checked False: NaNs are left in, for a caller
        that finds them itself (verify_block(speculate=True)) and then calls fix_nan (every
        change made after it leaves a NaN where fix_nan puts -inf, or overwrites it). scratch:
        a Scratch the log-probs are made in, where its plain_normalizer says fairseq's are a
        log_softmax (the caller reads them before the next call).
        """
        model = self.model  # a submodule: each read is nn.Module's attribute search
        decoder = model.decoder
        logits = decoder.project(decoder.heads.head1_features(features))
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        if scratch is not None and scratch.plain_normalizer:  # fairseq's own, into the kept memory
            lprobs = torch.log_softmax(logits, -1, dtype=torch.float32, out=scratch.take("lprobs", logits, torch.float32))
        else:
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)
        # fairseq turns NaN log-probs into -inf. A finite sum (one vectorised reduction) says
        # there are none, far cheaper than the fix, which then runs only where one may be.
        if checked and not math.isfinite(lprobs.sum().item()):
            fix_nan(lprobs)
        lprobs.select(-1, self.pad).fill_(-math.inf)
        if self.unk_penalty:
            lprobs[..., self.unk] -= self.unk_penalty
        if bounds[1] >= max_len:  # skipped when it cannot bite: this runs once per invocation
            at_max_len = steps >= max_len
            not_eos = torch.arange(lprobs.size(2), device=lprobs.device) != self.eos
            lprobs.masked_fill_(at_max_len[..., None] & not_eos, -math.inf)
        if bounds[0] < self.min_len:
            lprobs[..., self.eos].masked_fill_(steps < self.min_len, -math.inf)
        if self.repeat_ngram_blocker is not None:
            self.block_repeated_ngrams(lprobs, steps, tokens, block, max_len, tree)
        if self.match_source_len:  # fairseq's LengthConstrainedBeamSearch, after all the above
            at_length = steps >= src_lengths[:, None]
            lprobs[..., self.eos].masked_fill_(~at_length, -math.inf).masked_fill_(at_length, 0.0)
        return lprobs

    def block_repeated_ngrams(self, lprobs, steps, tokens, block, max_len, tree):
        """fairseq's NGramRepeatBlock, called per sentence and node with the path it sees there."""
        for row in range(block.size(0)):
            start = int(steps[row, 0])
            for j in range(block.size(1)):
                depth = int(tree.depth[j])
                if start + depth > max_len:  # its output would be past the end: unused
                    continue
                prefix = tokens[row : row + 1, : max_len + 2].clone()
                prefix[0, start + 1 : start + 1 + depth] = block[row, tree.paths[j, 1 : depth + 1]]
                lprobs[row, j] = self.repeat_ngram_blocker(prefix, lprobs[row, j : j + 1], 1, 1, start + depth)[0]

    def next_proposals(self, features, token, encoder_out, batch):
        """Step 7: the proposer's next block after the last accepted position: tokens b x w x topn.

        features: b x C, the decoder output there; token: b, head 1's choice after it (the
        next block's first token). Each proposal's `topn` best tokens, best first, topn
        being what the block's tree uses (1 for the chain). w is the width policy's width
        - 1, or less under --blockwise-confidence (confident_width), since every block
        position costs decoder and projection work whether or not it is accepted. `batch`
        (its sentence ids, tokens b x L and lengths b) is there for proposals that read
        the prefix (the tests' oracles).
        """
        width = self.policy.width(features.size(0))
        if (not self.layout.is_chain and self.log_confidence == -math.inf
                and not getattr(self.proposer, "nodes_read_proposals", True)):
            # A proposer whose nodes() proposes each node after its own parent (Hydra) reads
            # nothing of propose()'s chain: the tree needs only the width, not the chain's cost.
            return token.new_zeros(features.size(0), width - 1, self.layout.topn)
        confident = self.log_confidence > -math.inf  # the log-probs are read only to cut the width
        # confidence= only where it is set: a proposer of the protocol before it takes none
        cut = {"confidence": self.log_confidence} if confident else {}
        proposals, lprobs = self.proposer.propose(features, token, width, batch.vocab, self.layout.topn,
                                                  encoder_out, log_probs=confident, **cut)
        if not confident:
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


class Scratch:
    """Tensors of one invocation that no one keeps past it (head 1's log-probs, their sums with
    the running scores: b x n x V each), made in the same memory every invocation of a batch:
    a fresh one costs the allocator each time and, at a wide block's sizes (past malloc's mmap
    threshold), a page fault on each page it first touches.

    plain_normalizer: whether the model's log-probs are fairseq's own log_softmax in float32
    (plain_normalizer()), which head1_lprobs then makes here itself.
    """

    def __init__(self, plain_normalizer):
        self.plain_normalizer, self.buffers, self.views = plain_normalizer, {}, {}

    def take(self, name, like, dtype=None):
        """A contiguous tensor of like's shape and device, in `dtype` (None: like's), its contents
        anything: the memory `name` was given before where it fits, which is overwritten (the
        same tensor as last time where the shape is the same: no view made)."""
        dtype, numel = dtype or like.dtype, like.numel()
        view = self.views.get(name)
        if view is not None and view.shape == like.shape and view.dtype == dtype and view.device == like.device:
            return view
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != like.device:
            buffer = self.buffers[name] = like.new_empty(numel, dtype=dtype)
        view = self.views[name] = buffer[:numel].view(like.shape)
        return view


# The log-probs' methods, each fairseq's own where the log-probs are its log_softmax of the logits.
NORMALIZERS = (("get_normalized_probs", TransformerModelBase), ("get_normalized_probs_scriptable", BaseFairseqModel))
DECODER_NORMALIZERS = (("get_normalized_probs", FairseqDecoder), ("get_normalized_probs_scriptable", FairseqDecoder))


def plain_normalizer(model):
    """Whether model.get_normalized_probs((logits, None), log_probs=True) is fairseq's
    log_softmax(logits, dtype=float32): its model's and decoder's methods fairseq's own (no
    class nor instance of its own), no adaptive softmax, no ONNX tracing."""
    decoder = getattr(model, "decoder", None)
    if decoder is None or getattr(decoder, "adaptive_softmax", None) is not None or getattr(decoder, "onnx_trace", True):
        return False
    return all(getattr(type(owner), name, None) is getattr(base, name) and name not in vars(owner)
               for owner, methods in ((model, NORMALIZERS), (decoder, DECODER_NORMALIZERS)) for name, base in methods)


def fix_nan(lprobs):
    """fairseq's NaN log-probs made -inf, in place."""
    torch.nan_to_num_(lprobs, nan=-math.inf, posinf=math.inf, neginf=-math.inf)


class FixedWidth:
    """The width policy of a fixed block: its layout's depth + 1, whatever is accepted.

    The width policy protocol (adaptive.py's AdaptiveWidth is the other): start() as a
    batch begins; width(batch_size), the next block's width, its first token included;
    observe(width, kept, added, limit) after each block of `width`, where each sentence
    (b) kept `kept` tokens, added `added` of them to its output (fewer where its EOS came
    first) and could have added `limit`; observes, False where observe() reads nothing
    (the loop then passes limit None where no limit bites; absent: True).
    """

    observes = False

    def __init__(self, width):
        self.fixed = width

    def start(self):
        pass

    def width(self, batch_size):
        return self.fixed

    def observe(self, width, kept, added, limit):
        pass
