"""What a blockwise decoder is asked to do: one validated value, built once.

BlockwiseDecodingConfig holds the task's decoding flags and their defaults; fairseq's
GenerationConfig holds its own. BlockwiseOptions reads its defaults from both (each
default is written once, in its flag's dataclass) and is built from them once
(from_configs: fairseq-generate, -interactive, --eval-bleu, the hub) or by keyword
(scripts, tests: BlockwiseOptions(block_size=3, tree=16)). Every refusal is made in
refusals.py: of the options alone when they are built, of the options against a model
when a generator is built for it (generator()).
"""
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.configs import GenerationConfig

from .lexicon import ProposalLexicon
from .refusals import refuse, refuse_options
from .tree import is_rate_table, load_rates_file


@dataclass
class BlockwiseDecodingConfig(FairseqDataclass):
    """translation_blockwise's decoding flags (TranslationBlockwiseConfig inherits them)."""

    block_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "training: the number of proposal heads k (default 4); decoding: "
            "the block size, at most the checkpoint's k (default: each block's width chosen for "
            "the batch size, up to k, from --blockwise-widths)"
        },
    )
    blockwise: bool = field(
        default=False,
        metadata={
            "help": "decode with blockwise parallel decoding: exactly --beam 1 (see --blockwise-topk; "
            "with --sampling: speculative sampling, exactly fairseq's sampling distribution). "
            "A --beam given is a request, fairseq's default 5 included: only --beam 1 is accepted. "
            "Not given, this task decodes greedily under --blockwise and with beam 5 without it"
        },
    )
    blockwise_topk: int = field(
        default=1,
        metadata={
            "help": "accept a proposal when it is among head 1's top N (1: exactly "
            "greedy; the paper's top-2 lifts the mean block from 4.69 to 5.67 at k=10 "
            "for a small BLEU cost)"
        },
    )
    blockwise_min_block: int = field(
        default=1,
        metadata={
            "help": "always accept the first L proposals of a block, verified or not "
            "(1: exactly greedy; larger trades quality for fewer decoder invocations; "
            "at most the block size)"
        },
    )
    blockwise_confidence: float = field(
        default=0.0,
        metadata={
            "help": "end a block before the first proposal at which the product of the "
            "heads' top probabilities (over the vocabulary they propose from) falls "
            "below P; in a batch the most confident sentence sets the width. Fewer "
            "positions to verify when the heads are unsure; output stays exactly "
            "greedy (0: always k)"
        },
    )
    blockwise_distance: float = field(
        default=0.0,
        metadata={
            "help": "accept a proposal whose value differs from head 1's choice by at "
            "most E, for target dictionaries of numbers such as pixel intensities "
            "(the paper's image super-resolution used 2; 0: exactly greedy)"
        },
    )
    blockwise_adaptive: bool = field(
        default=False,
        metadata={
            "help": "choose each block's width (1 to --block-size) for the most accepted "
            "tokens per second, from this run's acceptance rate of each head and the "
            "measured time of invocations by width and batch size; width 1 runs no "
            "proposal heads, as fast as greedy. Output stays exactly greedy"
        },
    )
    blockwise_widths: str = field(
        default="",
        metadata={
            "help": "the width table that --blockwise without --block-size chooses each block's "
            "width from (scripts/calibrate_widths.py measures one: tokens and seconds per "
            "invocation by width and batch size). Default: the table measured for this model "
            "on this machine, kept in the user's cache; without one, width 1 (greedy's step "
            "without proposals). Output stays exactly greedy"
        },
    )
    blockwise_threads: int = field(
        default=0,
        metadata={
            "help": "torch threads while decoding a batch, the caller's restored after (0: under "
            "--blockwise alone, the count the width table measured fastest at the batch's size, "
            "never more than torch's threads when decoding starts; else torch's). Output stays "
            "exactly greedy"
        },
    )
    blockwise_proposal_vocab: int = field(
        default=0,
        metadata={
            "help": "heads 2..k propose only among the first N entries of the target "
            "dictionary (fairseq-preprocess sorts it by frequency): their projection "
            "costs N/V of the full one; output stays exactly greedy, rare tokens are "
            "just never proposed (0: the checkpoint's --head-vocab, else the whole dictionary)"
        },
    )
    blockwise_proposal_lexicon: str = field(
        default="",
        metadata={
            "help": "the draft decoder (--head-type draft) also proposes the rarer target tokens "
            "that the batch's source words bring past the proposal vocabulary's first N "
            "entries, from this lexicon (scripts/proposal_lexicon.py counts one in training "
            "pairs): most of what the whole dictionary accepts, at the cost of a few "
            "hundred more entries; output stays exactly greedy"
        },
    )
    blockwise_tree: int = field(
        default=0,
        metadata={
            "help": "verify a tree of N candidate nodes per block in one decoder pass instead "
            "of the chain of the heads' top choices: each node a path of (head, rank) "
            "choices, the N of highest expected acceptance (fairseq_bpd/tree.py); output "
            "stays exactly greedy (0: the chain)"
        },
    )
    blockwise_tree_rates: str = field(
        default="",
        metadata={
            "help": "the heads' top-r acceptance rates that shape --blockwise-tree, as "
            "scripts/tree_rates.py writes them beside a checkpoint (default: a built-in "
            "table, fairseq_bpd/tree.py default_rates)"
        },
    )


def default(config, name):
    """The default of field `name` of the dataclass `config`."""
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


def flag(name):
    """The default of one of the task's decoding flags."""
    return default(BlockwiseDecodingConfig, name)


def generation(name):
    """The default of one of fairseq's generation flags."""
    return default(GenerationConfig, name)


@dataclass(frozen=True)
class BlockwiseOptions:
    """Everything a blockwise decoder is asked to do, refused by name when it means nothing.

    block_size: the block width (None: the checkpoint's k, each block's width chosen up to it
    by the default width policy where it applies: chooses_width). widths: that policy's
    table, a path ("": this model's on this machine, widths.table_path). tree_rates: the heads'
    rates that shape the tree, a heads x ranks table or the path of a JSON file that
    scripts/tree_rates.py wrote (loaded when the options are built). proposal_lexicon: a
    ProposalLexicon or the path of its file (loaded alike). threads: torch's threads while
    decoding a batch (0: widths.batch_threads chooses). The other fields
    are the task's flags without their `blockwise_` prefix, and fairseq's generation
    flags that blockwise decoding honours (normalize_scores is `not --unnormalized`,
    len_penalty --lenpen, unk_penalty --unkpen; max_len 0 is the model's limit). attention:
    whether hypotheses carry the alignment layer's attention (below).
    """

    block_size: Optional[int] = flag("block_size")
    topk: int = flag("blockwise_topk")
    min_block: int = flag("blockwise_min_block")
    proposal_vocab: int = flag("blockwise_proposal_vocab")
    confidence: float = flag("blockwise_confidence")
    distance: float = flag("blockwise_distance")
    adaptive: bool = flag("blockwise_adaptive")
    tree: int = flag("blockwise_tree")
    widths: str = flag("blockwise_widths")
    threads: int = flag("blockwise_threads")
    tree_rates: Optional[tuple] = None
    proposal_lexicon: Optional[object] = None
    sampling: bool = generation("sampling")
    sampling_topk: int = generation("sampling_topk")
    sampling_topp: float = generation("sampling_topp")
    max_len_a: float = generation("max_len_a")
    max_len_b: int = generation("max_len_b")
    max_len: int = 0
    min_len: int = generation("min_len")
    normalize_scores: bool = not generation("unnormalized")
    len_penalty: float = generation("lenpen")
    unk_penalty: float = generation("unkpen")
    temperature: float = generation("temperature")
    match_source_len: bool = generation("match_source_len")
    no_repeat_ngram_size: int = generation("no_repeat_ngram_size")
    # Each hypothesis's hypo["attention"], as fairseq's SequenceGenerator gives it. fairseq's
    # commands and hub never read it (their alignments come from --print-alignment, which
    # blockwise decoding refuses): from_configs turns it off unless asked (the hub's
    # generate(..., attention=True)), sparing the alignment layer's attention weights, which
    # the fused attention kernel cannot give, every invocation.
    attention: bool = True
    # What a rates file was measured over (tree.load_rates_file), for the generator's warning
    # where this decoding proposes over something else; not a setting of its own (a table
    # given as such, or by replace(), says nothing of where it was measured).
    tree_rates_over: Optional[tuple] = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        refuse_options(self)
        rates = self.tree_rates
        if isinstance(rates, (str, os.PathLike)):
            (rates, over), problem = read_rates(rates)
            if problem:  # refused outside the except: a chained refusal prints a traceback
                refuse(problem)
            object.__setattr__(self, "tree_rates_over", over)
        elif rates is not None and not is_rate_table(rates):
            refuse(f"tree_rates must be a heads x ranks table of rates in [0, 1] (got {rates!r:.80})")
        if rates is not None:  # frozen all the way down: a table the generator cannot change
            object.__setattr__(self, "tree_rates", tuple(tuple(row) for row in rates))
        lexicon = self.proposal_lexicon
        if isinstance(lexicon, (str, os.PathLike)):
            lexicon, problem = read_lexicon(lexicon)
            if problem:  # refused outside the except, as the rates
                refuse(problem)
            object.__setattr__(self, "proposal_lexicon", lexicon)
        elif lexicon is not None and not isinstance(lexicon, ProposalLexicon):
            refuse(f"proposal_lexicon must be a ProposalLexicon or the path of one (got {lexicon!r:.80})")

    @classmethod
    def from_configs(cls, cfg, args):
        """The options of the task's config `cfg` (BlockwiseDecodingConfig's fields) and of
        fairseq's generation options `args`, which may hold only some of GenerationConfig's
        fields (--eval-bleu-args hands over only its JSON's keys): the others keep their defaults."""

        def given(name):
            return getattr(args, name, generation(name))

        return cls(
            block_size=cfg.block_size,
            topk=cfg.blockwise_topk,
            min_block=cfg.blockwise_min_block,
            proposal_vocab=cfg.blockwise_proposal_vocab,
            confidence=cfg.blockwise_confidence,
            distance=cfg.blockwise_distance,
            adaptive=cfg.blockwise_adaptive,
            tree=cfg.blockwise_tree,
            widths=cfg.blockwise_widths,
            threads=cfg.blockwise_threads,
            tree_rates=cfg.blockwise_tree_rates or None,
            proposal_lexicon=cfg.blockwise_proposal_lexicon or None,
            sampling=given("sampling"),
            sampling_topk=given("sampling_topk"),
            sampling_topp=given("sampling_topp"),
            max_len_a=given("max_len_a"),
            max_len_b=given("max_len_b"),
            min_len=given("min_len"),
            normalize_scores=not given("unnormalized"),
            len_penalty=given("lenpen"),
            unk_penalty=given("unkpen"),
            temperature=given("temperature"),
            match_source_len=given("match_source_len"),
            no_repeat_ngram_size=given("no_repeat_ngram_size"),
            attention=bool(getattr(args, "attention", False)),  # the hub's generate(..., attention=True)
        )

    @property
    def chooses_width(self):
        """Whether the default width policy (widths.py) chooses each block's width: no width
        asked for (--block-size, --blockwise-adaptive) and exact acceptance of a greedy chain
        (the relaxed rules' gains are not in the table; sampling and trees keep their width)."""
        return (self.block_size is None and not self.adaptive and not self.sampling and self.tree == 0
                and self.distance == 0 and self.topk == 1 and self.min_block == 1)

    def replace(self, **changes):
        """These options with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def generator(self, model, tgt_dict, stats=None, **hooks):
        """The generator these options ask for, checked against `model` and `tgt_dict`: the
        speculative sampler under `sampling`, the adaptive-width generator under `adaptive`,
        else the blockwise generator, its width policy the default (widths.default_policy)
        where chooses_width. hooks: the tests' constructor keywords (cost, clock,
        explore_every for the adaptive width; generator, a torch.Generator, for the sampler)."""
        # The generators read these options: imported here, when one is built.
        from .adaptive import AdaptiveBlockwiseGenerator
        from .generator import BlockwiseGenerator
        from .sampling import SpeculativeSampler
        from .widths import default_policy, with_batch_threads

        kind = SpeculativeSampler if self.sampling else AdaptiveBlockwiseGenerator if self.adaptive else BlockwiseGenerator
        generator = kind(model, tgt_dict, self, stats, **hooks)
        if self.chooses_width:
            generator.policy = default_policy(generator, self)
        if self.chooses_width or self.threads:  # the threads of each batch (widths.batch_threads)
            generator.generate = with_batch_threads(generator, self.threads)
        return generator


def read_lexicon(path):
    """The ProposalLexicon in `path` and None, or None and why it cannot be read."""
    try:
        return ProposalLexicon.load(path), None
    except ValueError as error:
        return None, str(error)


def read_rates(path):
    """((rates table, what it was measured over), None) of the file `path`, or (None, None)
    and why it cannot be read."""
    try:
        return load_rates_file(path), None
    except ValueError as error:
        return (None, None), str(error)
