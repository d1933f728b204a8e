"""translation_blockwise: fairseq's translation task plus blockwise parallel decoding."""
import atexit
import logging
import sys
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass.configs import GenerationConfig
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .adaptive import AdaptiveBlockwiseGenerator
from .generator import BlockwiseGenerator, BlockwiseStats
from .model import BlockwiseDecoder, shortlist_problem

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
        metadata={"help": "decode with blockwise parallel decoding (greedy; see --blockwise-topk)"},
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


def log_at_exit(stats):
    """The run's blockwise summary. A host that closed its log stream first (pytest's
    capture, around the hub) loses the line: no error for a summary."""
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        stats.log()
    finally:
        logging.raiseExceptions = raise_exceptions


def _flag_given(name):
    return any(a == name or a.startswith(name + "=") for a in sys.argv)


@register_task("translation_blockwise", dataclass=TranslationBlockwiseConfig)
class TranslationBlockwiseTask(TranslationTask):
    """TranslationTask whose generator is blockwise parallel decoding under --blockwise."""

    cfg: TranslationBlockwiseConfig

    def get_batch_iterator(self, dataset, *args, **kwargs):
        # fairseq drops a last batch whose size is not a multiple of this flag.
        kwargs["required_batch_size_multiple"] = 1
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def build_generator(
        self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None
    ):
        if not self.cfg.blockwise:
            if self.cfg.blockwise_adaptive:
                raise ValueError("--blockwise-adaptive chooses blockwise block widths: it needs --blockwise")
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
        generator_class = AdaptiveBlockwiseGenerator if self.cfg.blockwise_adaptive else BlockwiseGenerator
        return generator_class(
            models[0],
            self.target_dictionary,
            block_size=self.cfg.block_size or decoder.block_size,
            topk=self.cfg.blockwise_topk,
            min_block=self.cfg.blockwise_min_block,
            proposal_vocab=self.cfg.blockwise_proposal_vocab,
            confidence=self.cfg.blockwise_confidence,
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
        )

    def check_blockwise_request(self, models, args, prefix_allowed_tokens_fn=None, extra_gen_cls_kwargs=None):
        """Refuse, naming the flag, what blockwise (greedy) decoding cannot honour."""

        def refuse(message):
            raise ValueError(f"--blockwise: {message}")

        beam = getattr(args, "beam", 1)
        # fairseq's default --beam 5 is not a request; an explicit --beam N > 1 is.
        if beam != 1 and (beam != GenerationConfig.beam or _flag_given("--beam")):
            refuse(f"decoding is greedy, but --beam {beam} was given; use --beam 1 or drop --blockwise")
        if getattr(args, "nbest", 1) > 1:
            refuse("gives one hypothesis; --nbest must be 1")
        if getattr(args, "sampling", False):
            refuse("cannot be combined with --sampling")
        if getattr(args, "prefix_size", 0) > 0:
            refuse("cannot be combined with --prefix-size")
        if getattr(args, "constraints", None):
            refuse("cannot be combined with --constraints")
        if getattr(args, "score_reference", False):
            refuse("cannot be combined with --score-reference, which decodes nothing; drop --blockwise")
        if getattr(args, "print_alignment", None):
            refuse("gives no alignments; drop --print-alignment")
        if (extra_gen_cls_kwargs or {}).get("lm_model") is not None:
            refuse("cannot be combined with --lm-path")
        if prefix_allowed_tokens_fn is not None:
            refuse("cannot be combined with prefix_allowed_tokens_fn")
        if getattr(args, "diverse_beam_groups", -1) > 0 or getattr(args, "diversity_rate", -1) > 0:
            refuse("cannot be combined with diverse beam search")
        if len(models) != 1:
            refuse(f"decodes with one model, but {len(models)} were given in --path")
        decoder = models[0].decoder
        if not isinstance(decoder, BlockwiseDecoder):
            refuse(
                "the checkpoint has no proposal heads (it was not trained with "
                "--arch transformer_blockwise*); train heads on it first, or decode without --blockwise"
            )
        k = self.cfg.block_size
        if k is not None and not 1 <= k <= decoder.block_size:
            refuse(f"--block-size must be between 1 and the checkpoint's {decoder.block_size} heads (got {k})")
        if self.cfg.blockwise_topk < 1:
            refuse(f"--blockwise-topk must be at least 1 (got {self.cfg.blockwise_topk})")
        if self.cfg.blockwise_min_block < 1:
            refuse(f"--blockwise-min-block must be at least 1 (got {self.cfg.blockwise_min_block})")
        if not 0 <= self.cfg.blockwise_confidence <= 1:
            refuse(f"--blockwise-confidence must be between 0 and 1 (got {self.cfg.blockwise_confidence})")
        vocab = self.cfg.blockwise_proposal_vocab
        problem = shortlist_problem("--blockwise-proposal-vocab", vocab, self.target_dictionary)
        if problem:
            refuse(problem)
        if vocab and getattr(decoder, "output_projection", None) is None:
            refuse("--blockwise-proposal-vocab needs the decoder's plain output projection "
                   "(this model has an adaptive softmax)")
