"""Every request blockwise decoding refuses, each made once, here, naming the flag.

Three moments: fairseq's generation options, when the task builds a generator
(refuse_generation: what changes fairseq's search or reads what greedy verification
cannot reproduce); the options alone, when they are built (refuse_options); the
options against a model and its dictionary, when a generator is built for them
(refuse_for_model). Every refusal raises BlockwiseRequestError (errors.py).
"""
import dataclasses
import numbers
import os
from typing import Optional

from fairseq.dataclass.configs import GenerationConfig

from .acceptance import symbol_numbers
from .errors import BlockwiseRequestError
from .heads import HEAD_TYPES, shortlist_problem
from .decoder import BlockwiseDecoder
from .tree import MAX_TREE

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


def refuse(message):
    raise BlockwiseRequestError(f"--blockwise: {message}")


def refuse_generation(args, models, prefix_allowed_tokens_fn=None, extra_gen_cls_kwargs=None):
    """Refuse fairseq's generation options (args: a Namespace, perhaps of only some of
    GenerationConfig's fields) and build_generator's arguments that blockwise decoding
    cannot honour exactly."""

    def given(name):
        return getattr(args, name, GENERATION_DEFAULTS[name]) != GENERATION_DEFAULTS[name]

    beam = getattr(args, "beam", 1)  # --eval-bleu-args gives only the JSON's keys
    if beam != 1:  # any beam given, fairseq's default 5 included
        decoding = "speculative sampling draws one sample" if getattr(args, "sampling", False) else "decoding is greedy"
        # fairseq's hub translate() passes beam=5 unless told: say how to ask for 1 there too
        refuse(f"{decoding}, but --beam {beam} was given; use --beam 1 (from the hub: translate(..., beam=1)) "
               f"or drop --blockwise")
    if getattr(args, "nbest", 1) > 1:
        refuse("gives one hypothesis; --nbest must be 1")
    for name in REFUSED:
        if given(name):
            refuse(REFUSED[name])
    if (extra_gen_cls_kwargs or {}).get("lm_model") is not None:  # fairseq-generate's loaded --lm-path
        refuse(REFUSED["lm_path"])
    if prefix_allowed_tokens_fn is not None:
        refuse("cannot be combined with prefix_allowed_tokens_fn")
    if len(models) != 1:
        refuse(f"decodes with one model, but {len(models)} were given in --path")


def refuse_task_options_in_generation(args, cfg, names):
    """Refuse a task option (one of `names`) set differently among the generation options
    (--eval-bleu-args' JSON, the hub's translate() keywords), which fairseq would hand over
    and forget."""
    for name in sorted(names):
        value = getattr(args, name, None)
        if value is not None and value != getattr(cfg, name, None):
            raise BlockwiseRequestError(
                f"{name} is an option of the task, not of generation (--eval-bleu-args, the hub's "
                f"translate()): give it as --{name.replace('_', '-')}, or to from_pretrained()"
            )


# Acceptance rules that change the distribution of speculative sampling's outputs, or
# the greedy chain the adaptive width is chosen for: (flag, field, its default).
RULE_FLAGS = (("--blockwise-topk", "topk", 1), ("--blockwise-min-block", "min_block", 1),
              ("--blockwise-tree", "tree", 0), ("--blockwise-distance", "distance", 0))


def refuse_options(options):
    """Refuse what BlockwiseOptions mean nothing with, whatever the model (see refuse_for_model)."""
    refuse_kinds(options)
    refuse_sampling(options)
    if not options.temperature > 0:
        refuse(f"--temperature must be greater than 0 (got {options.temperature})")
    if options.min_block < 1:
        refuse(f"--blockwise-min-block must be at least 1 (got {options.min_block})")
    if options.threads < 0:
        refuse(f"--blockwise-threads must be at least 0 (0: chosen for each batch; got {options.threads})")
    if not 0 <= options.confidence <= 1:
        refuse(f"--blockwise-confidence must be between 0 and 1 (got {options.confidence})")
    refuse_distance(options)
    if options.adaptive:
        for flag, name, off in RULE_FLAGS[2:]:
            if getattr(options, name) != off:
                refuse(f"--blockwise-adaptive chooses the width of a greedy chain; drop {flag}")
    if options.widths and not options.chooses_width:
        refuse("--blockwise-widths chooses each block's width of an exact chain; drop it, or drop "
               "--block-size, --blockwise-adaptive, --blockwise-tree, --blockwise-distance, "
               "--blockwise-topk, --blockwise-min-block and --sampling")
    if not 0 <= options.tree <= MAX_TREE:
        refuse(f"--blockwise-tree must be between 0 (the chain) and {MAX_TREE} nodes (got {options.tree})")
    if isinstance(options.tree_rates, (str, os.PathLike)) and not options.tree:
        refuse("--blockwise-tree-rates shapes a tree; give --blockwise-tree N too")


# What each annotated kind of BlockwiseOptions field takes. A bool is no count or number here:
# Python's True == 1 would pass as a block size of one.
KINDS = {
    bool: ("True or False", lambda value: isinstance(value, bool)),
    int: ("an integer", lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool)),
    float: ("a number", lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool)),
    # a path: open() would take an integer as a file descriptor of this process
    str: ("a path (a string)", lambda value: isinstance(value, (str, os.PathLike))),
}


def refuse_kinds(options):
    """Refuse a field of the wrong kind by name: from Python ('3', 2.5 or True for a count), where
    a later comparison would raise a bare TypeError or take the value silently. fairseq's parser
    hands over typed values."""
    for option in dataclasses.fields(options):
        value, kind = getattr(options, option.name), option.type
        if kind == Optional[int]:
            if value is None:
                continue
            kind = int
        if kind not in KINDS:  # tree_rates: a table or a path, read by load_rates
            continue
        what, fits = KINDS[kind]
        if not fits(value):
            refuse(f"BlockwiseOptions.{option.name} must be {what} (got {value!r})")


def refuse_sampling(options):
    """--sampling: speculative sampling draws exactly from fairseq's sampling distribution."""
    for flag, value, off in (("--sampling-topk", options.sampling_topk, GENERATION_DEFAULTS["sampling_topk"]),
                             ("--sampling-topp", options.sampling_topp, GENERATION_DEFAULTS["sampling_topp"])):
        if value != off and not options.sampling:
            refuse(f"{flag} requires --sampling")
    if not options.sampling:
        return
    topp = options.sampling_topp
    if topp > 1 or topp == 0:
        refuse(f"--sampling-topp must be in (0, 1] (got {topp})")
    if options.match_source_len:  # fairseq: "search parameters are mutually exclusive"
        refuse("--match-source-len cannot be combined with --sampling (fairseq refuses the pair too)")
    for flag, name, off in (*RULE_FLAGS, ("--blockwise-adaptive", "adaptive", False)):
        if getattr(options, name) != off:
            refuse(f"{flag} must be {off} with --sampling: speculative sampling is lossless, drawing exactly "
                   f"from fairseq's distribution (got {getattr(options, name)})")


def refuse_distance(options):
    """--blockwise-distance E: a rule of its own, judging proposals by their numbers."""
    distance = options.distance
    if distance == 0:
        return
    if not distance >= 0:  # NaN too: it would compare as exact decoding
        refuse(f"--blockwise-distance must be at least 0 (got {distance})")
    if options.topk != 1 or options.min_block != 1 or options.tree:
        refuse("--blockwise-distance cannot be combined with another acceptance rule: it replaces the rule; "
               "drop --blockwise-topk, --blockwise-min-block and --blockwise-tree")


def refuse_for_model(options, model, tgt_dict, proposer):
    """Refuse options that mean nothing for this model, its target dictionary and its proposer."""
    decoder = model.decoder
    if not isinstance(decoder, BlockwiseDecoder):
        refuse("the checkpoint has no proposal heads (it was not trained with "
               "--arch transformer_blockwise*); train heads on it first, or decode without --blockwise")
    if decoder.cross_self_attention:
        refuse("cannot decode a --cross-self-attention model: its layers cache the encoder "
               "states with the decoder's keys, which a block pass does not reproduce")
    heads, k = decoder.proposal_heads, options.block_size
    if k is not None and not 1 <= k <= heads:
        refuse(f"--block-size must be between 1 and the checkpoint's {heads} heads (got {k})")
    width = heads if k is None else k
    vocab_size = len(tgt_dict)
    if not 1 <= options.topk < vocab_size:
        refuse(f"--blockwise-topk must be between 1 and {vocab_size - 1}, below the target "
               f"dictionary's {vocab_size} entries (got {options.topk})")
    where = f"--block-size {k}" if k is not None else f"the checkpoint's {heads} heads"  # what set the width
    if options.min_block > width:
        refuse(f"--blockwise-min-block {options.min_block} is larger than the block: at most the block "
               f"width in effect, {width} ({where})")
    problem = shortlist_problem("--blockwise-proposal-vocab", options.proposal_vocab, tgt_dict)
    if problem:
        refuse(problem)
    if options.distance > 0:
        problem = None
        try:
            symbol_numbers(tgt_dict)
        except ValueError as error:
            problem = str(error)
        if problem:  # refused outside the except: a chained refusal prints a traceback
            refuse(f"--blockwise-distance {options.distance} needs a target dictionary of numbers "
                   f"(such as pixel intensities), but its {problem}")
    if options.tree and width < 2:  # else the tree silently decodes greedily, one token a block
        refuse(f"--blockwise-tree {options.tree} proposes with heads 2 and after, but the block "
               f"({where}) has head 1 alone; give --block-size 2 or more")
    rates = options.tree_rates
    if options.tree and rates is not None and len(rates) < width - 1:  # else the tree silently stops short
        covered = "head 2" if len(rates) == 1 else f"heads 2..{len(rates) + 1}"
        refuse(f"--blockwise-tree-rates hold rates for {covered} only, but the block ({where}) "
               f"proposes with heads 2..{width}; measure them on this checkpoint "
               f"(scripts/tree_rates.py) or give --block-size {len(rates) + 1}")
    refuse_lexicon(options, model, tgt_dict, proposer)
    if options.sampling and not proposer.independent:
        refuse("--sampling draws from independent heads' own distributions: this checkpoint's heads "
               f"are {head_type_of(proposer)}")


def head_type_of(proposer):
    """`--head-type NAME` of a proposer, or its class's name where it is none of them."""
    return next((f"--head-type {name}" for name, kind in HEAD_TYPES.items() if type(proposer) is kind),
                f"a {type(proposer).__name__}")


def refuse_lexicon(options, model, tgt_dict, proposer):
    """--blockwise-proposal-lexicon: rarer tokens for the draft decoder's proposals, past a shortlist."""
    lexicon = options.proposal_lexicon
    if lexicon is None:
        return
    if not getattr(proposer, "reads_lexicon", False):
        refuse("--blockwise-proposal-lexicon adds to the draft decoder's proposals (--head-type draft); "
               f"this checkpoint's heads are {head_type_of(proposer)}")
    if not (options.proposal_vocab or getattr(model.decoder, "head_vocab", 0)):
        refuse("--blockwise-proposal-lexicon adds tokens past a shortlist, but the proposals range over the "
               "whole dictionary already: give --blockwise-proposal-vocab N (the checkpoint has no --head-vocab)")
    if not bool((lexicon.bind(model.encoder.dictionary, tgt_dict) >= 0).any()):
        refuse("--blockwise-proposal-lexicon: none of its words are in the model's dictionaries")


def refuse_prefix(prefix_tokens, constraints):
    """generate()'s own arguments: a prefix or constraints, which fairseq's search would honour."""
    if prefix_tokens is not None or constraints is not None:
        refuse("cannot decode with a prefix or constraints")

