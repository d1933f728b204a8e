"""translation_blockwise: fairseq's translation task plus blockwise parallel decoding."""
import argparse
import dataclasses
import atexit
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .acceptance import symbol_numbers
from .adaptive import AdaptiveBlockwiseGenerator
from .errors import BlockwiseRequestError
from .generator import BlockwiseGenerator, BlockwiseStats
from .model import BlockwiseDecoder, shortlist_problem
from .tree import MAX_TREE, load_rates
from .sampling import SpeculativeSampler, sampling_problem

logger = logging.getLogger(__name__)


@dataclass
class TranslationBlockwiseConfig(TranslationConfig):
    block_size: Optional[int] = field(
        default=None,
        metadata={
            "help": "training: the number of proposal heads k (default 4); decoding: "
            "the block size, at most the checkpoint's k (default: its k)"
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
            "(1: exactly greedy; larger trades quality for fewer decoder invocations)"
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
    blockwise_proposal_vocab: int = field(
        default=0,
        metadata={
            "help": "heads 2..k propose only among the first N entries of the target "
            "dictionary (fairseq-preprocess sorts it by frequency): their projection "
            "costs N/V of the full one; output stays exactly greedy, rare tokens are "
            "just never proposed (0: the checkpoint's --head-vocab, else the whole dictionary)"
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


def log_at_exit(stats):
    """The run's blockwise summary. A host that closed its log stream first (pytest's
    capture, around the hub) loses the line: no error for a summary."""
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        stats.log()
    finally:
        logging.raiseExceptions = raise_exceptions


# fairseq's default --beam, 5, cannot be told from an explicit --beam 5, which --blockwise
# must refuse. So the parser notes a typed --beam, and under --blockwise a beam not typed
# is 1, greedy. Without --blockwise the default stays 5: fairseq-generate and -interactive
# check it (--sampling needs --nbest equal to --beam) before any task code runs.
class _TypedBeam(argparse._StoreAction):
    """fairseq's --beam, noting in the namespace that it was typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.beam_typed = True


class _Blockwise(argparse._StoreTrueAction):
    """--blockwise: a --beam not typed, before or after it, is 1."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        if not getattr(namespace, "beam_typed", False):
            namespace.beam = 1


@register_task("translation_blockwise", dataclass=TranslationBlockwiseConfig)
class TranslationBlockwiseTask(TranslationTask):
    """TranslationTask whose generator is blockwise parallel decoding under --blockwise.

    Every refusal raises BlockwiseRequestError (fairseq_bpd/errors.py).
    """

    cfg: TranslationBlockwiseConfig
    # The options this task adds to translation's: build_generator refuses them among the
    # generation options, where they would be ignored.
    decoding_options = {f.name for f in dataclasses.fields(TranslationBlockwiseConfig)} - {
        f.name for f in dataclasses.fields(TranslationConfig)
    }
    # fairseq-generate and -interactive skip a too-long input, naming it, instead of
    # ending the run; the hub turns this off (it returns one output per input).
    skip_invalid_inputs = True

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        actions = {action.dest: action for action in parser._actions}
        if "beam" in actions:  # a generation parser, not fairseq-train's
            actions["beam"].__class__ = _TypedBeam  # the parser made them: only their calls change
            actions["blockwise"].__class__ = _Blockwise

    def get_batch_iterator(self, dataset, *args, **kwargs):
        # fairseq drops a last batch whose size is not a multiple of this flag.
        kwargs["required_batch_size_multiple"] = 1
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def filter_indices_by_size(self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        if ignore_invalid_inputs or not self.skip_invalid_inputs:
            kept = super().filter_indices_by_size(indices, dataset, max_positions, ignore_invalid_inputs)
        else:
            kept, ignored = dataset.filter_indices_by_size(indices, max_positions)
            for index in ignored:
                logger.warning(skipped_input(dataset, index, max_positions, self.source_dictionary))
        split = next((name for name, loaded in self.datasets.items() if loaded is dataset), None)
        if len(kept) == 0 and len(indices) > 0 and split is not None:
            # A file with nothing left: fairseq's summaries would divide by zero. (An
            # interactive buffer of long lines is not one: the lines after it still come.)
            raise BlockwiseRequestError(
                f"--max-source-positions/--max-target-positions: every one of the {len(indices)} sentences of "
                f"'{split}' is too long for the model (see the warnings above); --truncate-source cuts "
                f"long sources instead"
            )
        return kept

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        # fairseq-interactive's lines: --truncate-source cuts them as load_dataset cuts files.
        if self.cfg.truncate_source:
            limit = self.cfg.max_source_positions
            src_tokens = [t if len(t) <= limit else torch.cat([t[: limit - 1], t[-1:]]) for t in src_tokens]
            src_lengths = [min(int(n), limit) for n in src_lengths]
        return super().build_dataset_for_inference(src_tokens, src_lengths, constraints)

    def build_generator(
        self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None
    ):
        self.check_generation_options(args)
        if not self.cfg.blockwise:
            if self.cfg.blockwise_adaptive:
                raise BlockwiseRequestError("--blockwise-adaptive chooses blockwise block widths: it needs --blockwise")
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        self.check_blockwise_request(models, args, prefix_allowed_tokens_fn, extra_gen_cls_kwargs)
        # fairseq-generate prints this beam with its BLEU score: say that greedy ran.
        args.beam = 1
        if not hasattr(self, "blockwise_stats"):
            # fairseq's CLIs have no end-of-run hook for a task; one summary per run, at exit.
            self.blockwise_stats = BlockwiseStats()
            atexit.register(log_at_exit, self.blockwise_stats)
        decoder = models[0].decoder
        sampling = {}
        if getattr(args, "sampling", False):
            sampling = {"sampling_topk": getattr(args, "sampling_topk", -1),
                        "sampling_topp": getattr(args, "sampling_topp", -1.0)}
        generator_class = (SpeculativeSampler if sampling
                           else AdaptiveBlockwiseGenerator if self.cfg.blockwise_adaptive else BlockwiseGenerator)
        return generator_class(
            models[0],
            self.target_dictionary,
            block_size=self.cfg.block_size or decoder.block_size,
            topk=self.cfg.blockwise_topk,
            min_block=self.cfg.blockwise_min_block,
            proposal_vocab=self.cfg.blockwise_proposal_vocab,
            confidence=self.cfg.blockwise_confidence,
            distance=self.cfg.blockwise_distance,
            max_len_a=getattr(args, "max_len_a", 0),
            max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1),
            normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1),
            unk_penalty=getattr(args, "unkpen", 0),
            temperature=getattr(args, "temperature", 1.0),
            match_source_len=getattr(args, "match_source_len", False),
            no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0),
            stats=self.blockwise_stats,
            **sampling,
            **self.tree_request(),
        )

    def tree_request(self):
        """--blockwise-tree and its rates, checked: the generator's tree arguments."""
        size, path = self.cfg.blockwise_tree, self.cfg.blockwise_tree_rates
        if not 0 <= size <= MAX_TREE:
            raise BlockwiseRequestError(f"--blockwise: --blockwise-tree must be between 0 (the chain) and {MAX_TREE} "
                             f"nodes (got {size})")
        if path and not size:
            raise BlockwiseRequestError("--blockwise: --blockwise-tree-rates shapes a tree; give --blockwise-tree N too")
        try:
            return {"tree": size, "tree_rates": load_rates(path) if path else None}
        except ValueError as error:
            raise BlockwiseRequestError(f"--blockwise: {error}") from None
    def check_generation_options(self, args):
        """Refuse a task option set differently among the generation options (--eval-bleu-args'
        JSON, the hub's translate() keywords), which fairseq would hand over and forget."""
        for name in sorted(self.decoding_options):
            value = getattr(args, name, None)
            if value is not None and value != getattr(self.cfg, name, None):
                raise BlockwiseRequestError(
                    f"{name} is an option of the task, not of generation (--eval-bleu-args, the hub's "
                    f"translate()): give it as --{name.replace('_', '-')}, or to from_pretrained()"
                )

    def check_blockwise_request(self, models, args, prefix_allowed_tokens_fn=None, extra_gen_cls_kwargs=None):
        """Refuse, naming the flag, what blockwise (greedy) decoding cannot honour exactly."""

        def refuse(message):
            raise BlockwiseRequestError(f"--blockwise: {message}")

        def given(name):
            return getattr(args, name, GENERATION_DEFAULTS[name]) != GENERATION_DEFAULTS[name]

        beam = getattr(args, "beam", 1)  # --eval-bleu-args gives only the JSON's keys
        if beam != 1:  # any beam given, fairseq's default 5 included
            decoding = "speculative sampling draws one sample" if getattr(args, "sampling", False) else "decoding is greedy"
            refuse(f"{decoding}, but --beam {beam} was given; use --beam 1 or drop --blockwise")
        if getattr(args, "nbest", 1) > 1:
            refuse("gives one hypothesis; --nbest must be 1")
        for name in REFUSED:
            if given(name):
                refuse(REFUSED[name])
        problem = sampling_problem(args, self.cfg)  # --sampling: speculative sampling (sampling.py)
        if problem:
            refuse(problem)
        if getattr(args, "temperature", 1.0) <= 0:
            refuse(f"--temperature must be greater than 0 (got {args.temperature})")
        if (extra_gen_cls_kwargs or {}).get("lm_model") is not None:  # fairseq-generate's loaded --lm-path
            refuse(REFUSED["lm_path"])
        if prefix_allowed_tokens_fn is not None:
            refuse("cannot be combined with prefix_allowed_tokens_fn")
        if len(models) != 1:
            refuse(f"decodes with one model, but {len(models)} were given in --path")
        self.check_blockwise_model(models[0].decoder, refuse)
        self.check_blockwise_flags(models[0].decoder, refuse)

    def check_blockwise_model(self, decoder, refuse):
        """Refuse checkpoints whose decoding a block pass does not reproduce."""
        if not isinstance(decoder, BlockwiseDecoder):
            refuse(
                "the checkpoint has no proposal heads (it was not trained with "
                "--arch transformer_blockwise*); train heads on it first, or decode without --blockwise"
            )
        if decoder.cross_self_attention:
            refuse("cannot decode a --cross-self-attention model: its layers cache the encoder "
                   "states with the decoder's keys, which a block pass does not reproduce")

    def check_blockwise_flags(self, decoder, refuse):
        """Refuse values of the task's own decoding flags that mean nothing."""
        k = self.cfg.block_size
        if k is not None and not 1 <= k <= decoder.block_size:
            refuse(f"--block-size must be between 1 and the checkpoint's {decoder.block_size} heads (got {k})")
        vocab_size = len(self.target_dictionary)
        if not 1 <= self.cfg.blockwise_topk < vocab_size:
            refuse(f"--blockwise-topk must be between 1 and {vocab_size - 1}, below the target "
                   f"dictionary's {vocab_size} entries (got {self.cfg.blockwise_topk})")
        if self.cfg.blockwise_min_block < 1:
            refuse(f"--blockwise-min-block must be at least 1 (got {self.cfg.blockwise_min_block})")
        if not 0 <= self.cfg.blockwise_confidence <= 1:
            refuse(f"--blockwise-confidence must be between 0 and 1 (got {self.cfg.blockwise_confidence})")
        self.check_distance(refuse)
        if self.cfg.blockwise_adaptive:
            for flag, given_value in (("--blockwise-tree", self.cfg.blockwise_tree),
                                      ("--blockwise-distance", self.cfg.blockwise_distance)):
                if given_value:  # --sampling: sampling_problem
                    refuse(f"--blockwise-adaptive chooses the width of a greedy chain; drop {flag}")
        problem = shortlist_problem("--blockwise-proposal-vocab", self.cfg.blockwise_proposal_vocab,
                                    self.target_dictionary)
        if problem:
            refuse(problem)

    def check_distance(self, refuse):
        """--blockwise-distance needs numbers to measure and is a rule of its own."""
        distance = self.cfg.blockwise_distance
        if distance == 0:
            return
        if not distance >= 0:  # NaN too
            refuse(f"--blockwise-distance must be at least 0 (got {distance})")
        if self.cfg.blockwise_topk != 1 or self.cfg.blockwise_min_block != 1 or self.cfg.blockwise_tree:
            refuse("--blockwise-distance replaces the acceptance rule; drop --blockwise-topk, "
                   "--blockwise-min-block and --blockwise-tree")
        try:
            symbol_numbers(self.target_dictionary)
        except ValueError as error:
            refuse(f"--blockwise-distance {distance} needs a target dictionary of numbers "
                   f"(such as pixel intensities), but its {error}")


GENERATION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}

# GenerationConfig fields whose non-default value blockwise decoding refuses: each
# changes fairseq's search (or reads what greedy verification cannot reproduce).
REFUSED = {
    "prefix_size": "cannot be combined with --prefix-size",
    "constraints": "cannot be combined with --constraints",
    "score_reference": "cannot be combined with --score-reference, which decodes nothing; drop --blockwise",
    "print_alignment": "gives no alignments; drop --print-alignment",
    "lm_path": "cannot be combined with --lm-path",
    "diverse_beam_groups": "cannot be combined with --diverse-beam-groups (diverse beam search)",
    "diversity_rate": "cannot be combined with --diversity-rate: any value but its default -1 "
                      "switches fairseq to diverse siblings search",
    "retain_dropout": "cannot be combined with --retain-dropout: with dropout every decoder pass "
                      "is random, so no output can equal greedy's",
}


def skipped_input(dataset, index, max_positions, dictionary, words=10):
    """The warning for an input too long for the model, naming it by its first words."""
    (source, target), limits = dataset.size(index), max_positions
    source_limit, target_limit = limits if isinstance(limits, tuple) else (limits, limits)
    if source > source_limit:
        why = (f"an input of {source} tokens, more than the model's {source_limit} source positions "
               f"(--truncate-source cuts it instead)")
    else:
        why = f"an input whose reference has {target} tokens, more than the model's {target_limit} target positions"
    tokens = dataset.src[index]
    more = " ..." if len(tokens) > words else ""
    return f"skipped {why}: {dictionary.string(tokens[:words])}{more}"
