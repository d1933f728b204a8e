"""translation_blockwise: fairseq's translation task plus blockwise parallel decoding."""
import argparse
import dataclasses
import atexit
import logging
from dataclasses import dataclass

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .errors import BlockwiseRequestError
from .generator import BlockwiseStats
from .options import BlockwiseDecodingConfig, BlockwiseOptions
from .refusals import refuse_generation, refuse_task_options_in_generation
from .stored_features import StoredFeatures, StoredFeaturesConfig, data_directory, refuse_unfrozen

logger = logging.getLogger(__name__)


@dataclass
class TranslationBlockwiseConfig(StoredFeaturesConfig, BlockwiseDecodingConfig, TranslationConfig):
    """TranslationConfig, then the decoding flags (options.py) and training's --stored-features
    (stored_features.py)."""


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

    Every refusal is made in refusals.py, --stored-features' in stored_features.py; they
    raise BlockwiseRequestError (errors.py).
    """

    cfg: TranslationBlockwiseConfig
    # The options this task adds to translation's: build_generator refuses them among the
    # generation options, where they would be ignored.
    decoding_options = {f.name for f in dataclasses.fields(BlockwiseDecodingConfig)} - {
        f.name for f in dataclasses.fields(FairseqDataclass)
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

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch, combine, **kwargs)
        if self.cfg.stored_features:
            path = data_directory(self.cfg)
            langs = (self.cfg.source_lang, self.cfg.target_lang)
            self.datasets[split] = self.stored_features().wrap(split, self.datasets[split], path, langs, combine)

    def stored_features(self):
        """The --stored-features directory, its meta.json read once."""
        if getattr(self, "_stored_features", None) is None:
            self._stored_features = StoredFeatures(self.cfg.stored_features)
        return self._stored_features

    def build_model(self, cfg, from_checkpoint=False):
        if self.cfg.stored_features:
            refuse_unfrozen(cfg)
        model = super().build_model(cfg, from_checkpoint)
        if self.cfg.stored_features:
            self.stored_features().check_widths(model)
        return model

    def train_step(self, sample, model, *args, **kwargs):
        if self.cfg.stored_features:
            self.stored_features().check_base(model, sample)
        return super().train_step(sample, model, *args, **kwargs)

    def valid_step(self, sample, model, criterion):
        if self.cfg.stored_features:
            self.stored_features().check_base(model, sample)
        return super().valid_step(sample, model, criterion)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        # Stored base features are for training's loss (--eval-bleu decodes batches that
        # carry them): decoding runs the base itself.
        if "stored_features" in sample.get("net_input", {}):
            net_input = {k: v for k, v in sample["net_input"].items() if k != "stored_features"}
            sample = {**sample, "net_input": net_input}
        return super().inference_step(generator, models, sample, prefix_tokens, constraints)

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
        refuse_task_options_in_generation(args, self.cfg, self.decoding_options)
        if not self.cfg.blockwise:
            if self.cfg.blockwise_adaptive:
                raise BlockwiseRequestError("--blockwise-adaptive chooses blockwise block widths: it needs --blockwise")
            self.warn_of_ignored_flags()
            return super().build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, prefix_allowed_tokens_fn
            )
        refuse_generation(args, models, prefix_allowed_tokens_fn, extra_gen_cls_kwargs)
        options = BlockwiseOptions.from_configs(self.cfg, args)
        # fairseq-generate prints this beam with its BLEU score: say that greedy ran.
        args.beam = 1
        if not hasattr(self, "blockwise_stats"):
            # fairseq's CLIs have no end-of-run hook for a task; one summary per run, at exit.
            self.blockwise_stats = BlockwiseStats()
            atexit.register(log_at_exit, self.blockwise_stats)
        return options.generator(models[0], self.target_dictionary, self.blockwise_stats)

    def warn_of_ignored_flags(self):
        """Decoding flags given without --blockwise mean nothing to fairseq's search: say so, once."""
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(BlockwiseDecodingConfig)
                 if f.name.startswith("blockwise_") and getattr(self.cfg, f.name, f.default) != f.default]
        if given and not getattr(self, "warned_of_ignored_flags", False):
            self.warned_of_ignored_flags = True
            logger.warning(f"{', '.join(given)} given without --blockwise: ignored (fairseq's own search decodes)")


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
