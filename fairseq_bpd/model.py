"""transformer_blockwise: a Transformer whose decoder carries k proposal heads.

Stern, Shazeer & Uszkoreit, "Blockwise Parallel Decoding for Deep Autoregressive
Models", NeurIPS 2018. This file registers the model and its architectures and holds
their options; the decoder and its block pass are in decoder.py, the heads in heads.py.
"""
from dataclasses import dataclass, field
from typing import Optional

from fairseq import hub_utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de_big,
)

from .decoder import BlockwiseDecoder
from .errors import BlockwiseRequestError
from .hub import BlockwiseHubInterface
from .heads import HEAD_TYPES, shortlist_problem
from .stored_features import stored_encoder_out

# The number of heads a model gets when training gives neither --proposal-heads nor
# --block-size.
DEFAULT_PROPOSAL_HEADS = 4


@dataclass
class BlockwiseHeadsConfig(FairseqDataclass):
    proposal_heads: Optional[int] = field(
        default=None,
        metadata={
            "help": "the number of heads k, head 1 (the next token) included; the checkpoint "
            f"keeps it (default: training's --block-size, else {DEFAULT_PROPOSAL_HEADS})"
        },
    )
    head_layout: ChoiceEnum(["base", "paper"]) = field(
        default="base",
        metadata={
            "help": "base: head 1 is the decoder's own output and the extra "
            "feed-forward layer serves heads 2..k, so a frozen base decodes exactly "
            "as the original model; paper: all k heads pass through the layer"
        },
    )
    freeze_base: bool = field(
        default=False,
        metadata={"help": "train the proposal heads only (the paper's 'frozen')"},
    )
    head_ffn_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "hidden size per head of the proposal layer (the paper: the "
            "decoder's ffn size, so k*d_ffn in all); smaller keeps large k cheap"
        },
    )
    head_type: ChoiceEnum(list(HEAD_TYPES)) = field(
        default="independent",
        metadata={
            "help": "independent: the paper's heads, each guessing its token alone; "
            "chained: head i also reads the embedding of the token head i-1 predicts "
            "(Hydra; needs --head-layout base); draft: one decoder layer that reads the "
            "base's features, the next token and the encoder output, run step by step "
            "(EAGLE for encoder-decoders; needs --head-layout base)"
        },
    )
    head_vocab: int = field(
        default=0,
        metadata={
            "help": "heads 2..k predict only among the first N entries of the target "
            "dictionary (fairseq-preprocess sorts it by frequency): their training "
            "loss and their proposals cost N/V of the full softmax (0: all)"
        },
    )
    heads_bf16: bool = field(
        default=False,
        metadata={
            "help": "train the heads' own products (their layers' matrices) in bfloat16 "
            "under torch.autocast, several times faster than float32 on CPUs with AMX and "
            "on GPUs; their weights, attention, norms and residual sums stay float32, and "
            "the base and decoding are untouched"
        },
    )
    draft_train_heads: int = field(
        default=0,
        metadata={
            "help": "--head-type draft: train its first N heads only, unrolling N-1 draft "
            "steps instead of k-1 (0: all k). Every step is the same layer, so decoding's "
            "later heads run what the first steps learned; a step's self-attention reads "
            "every step before it, so training's cost grows faster than the steps"
        },
    )


@register_model("transformer_blockwise")
class BlockwiseTransformerModel(TransformerModel):
    """Transformer with k proposal heads for blockwise parallel decoding."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, BlockwiseHeadsConfig())

    @classmethod
    def build_model(cls, args, task):
        blockwise_base_architecture(args)
        if args.proposal_heads < 1:  # the flag it came from: --block-size unless the heads were given
            flag = "--block-size" if args.proposal_heads == args.block_size else "--proposal-heads"
            raise BlockwiseRequestError(f"{flag} must be at least 1 (got {args.proposal_heads})")
        problem = shortlist_problem("--head-vocab", args.head_vocab, task.target_dictionary)
        if problem:
            raise BlockwiseRequestError(problem)
        if args.adaptive_softmax_cutoff:  # at training and at loading alike
            raise BlockwiseRequestError("--adaptive-softmax-cutoff: the proposal heads need the "
                                        "decoder's plain output projection, not an adaptive softmax")
        problem = draft_train_heads_problem(args)
        if problem:
            raise BlockwiseRequestError(problem)
        if args.freeze_base and args.proposal_heads == 1 and args.head_layout == "base":
            raise BlockwiseRequestError("--freeze-base with a single head (k=1) and --head-layout base "
                                        "leaves nothing to train")
        model = super().build_model(args, task)
        if args.freeze_base:
            for name, param in model.named_parameters():
                if not name.startswith("decoder.heads."):
                    param.requires_grad_(False)
        return model

    def train(self, mode=True):
        """Under --freeze-base the base stays in eval mode while its heads train: no dropout in
        it, so the heads learn on the very features decoding gives them."""
        super().train(mode)
        if mode and not any(p.requires_grad for name, p in self.named_parameters()
                            if not name.startswith("decoder.heads.")):
            self.encoder.eval()
            for name, child in self.decoder.named_children():
                if name != "heads":
                    child.eval()
        return self

    def forward(self, src_tokens, src_lengths, prev_output_tokens, stored_features=None, **kwargs):
        """fairseq's forward. stored_features (--stored-features: the frozen base's encoder output
        S x B x C and top-layer features B x T x C of this batch, stored_features.py): the base
        is not run, and the heads read these as they read its own."""
        if stored_features is None:
            return super().forward(src_tokens, src_lengths, prev_output_tokens, **kwargs)
        encoder_out = stored_encoder_out(stored_features, src_tokens, self.encoder.padding_idx)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out, base_features=stored_features["decoder"],
                            src_lengths=src_lengths, **kwargs)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", **kwargs):
        """fairseq's loading, with a hub whose translate() under --blockwise asks for no beam."""
        loaded = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                           archive_map=cls.hub_models(), **kwargs)
        return BlockwiseHubInterface(loaded["args"], loaded["task"], loaded["models"])

    @classmethod
    def upgrade_saved_options(cls, args):
        """Upgrade a checkpoint's model options as saved, before load-time overrides apply
        (patches.py): one saved before --proposal-heads names its heads by block_size alone."""
        add_proposal_heads(args)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return BlockwiseDecoder(
            cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention
        )


def draft_train_heads_problem(args):
    """What is wrong with --draft-train-heads for these options, or None."""
    n = args.draft_train_heads
    if n == 0:
        return None
    if args.head_type != "draft":
        return (f"--draft-train-heads trains the first steps of --head-type draft, whose steps share one "
                f"layer; --head-type {args.head_type}'s heads past the first would never train")
    if not 2 <= n <= args.proposal_heads:
        return f"--draft-train-heads must be 0 (all) or from 2 to the model's k ({args.proposal_heads}), not {n}"
    return None


def add_proposal_heads(args):
    """Training's --block-size K without --proposal-heads asks for K heads, as it did before
    the field existed; a checkpoint saved then holds block_size alone, read the same way."""
    if getattr(args, "proposal_heads", None) is None:
        if getattr(args, "block_size", None) is None:  # not `or`: 0 must reach the check
            args.block_size = DEFAULT_PROPOSAL_HEADS
        args.proposal_heads = args.block_size


def _blockwise_defaults(args):
    add_proposal_heads(args)
    for name, value in vars(BlockwiseHeadsConfig()).items():
        if not name.startswith("_") and getattr(args, name, None) is None:
            setattr(args, name, value)


@register_model_architecture("transformer_blockwise", "transformer_blockwise")
def blockwise_base_architecture(args):
    """The paper's transformer_base setting."""
    base_architecture(args)
    _blockwise_defaults(args)


@register_model_architecture("transformer_blockwise", "transformer_blockwise_iwslt_de_en")
def blockwise_iwslt_de_en(args):
    transformer_iwslt_de_en(args)
    _blockwise_defaults(args)


@register_model_architecture("transformer_blockwise", "transformer_blockwise_wmt_en_de_big")
def blockwise_wmt_en_de_big(args):
    transformer_wmt_en_de_big(args)
    _blockwise_defaults(args)


@register_model_architecture("transformer_blockwise", "transformer_blockwise_small")
def blockwise_small(args):
    """3 layers of width 256: small enough to train on a CPU."""
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_embed_dim", getattr(args, f"{side}_embed_dim", 256))
        setattr(args, f"{side}_ffn_embed_dim", getattr(args, f"{side}_ffn_embed_dim", 1024))
        setattr(args, f"{side}_layers", getattr(args, f"{side}_layers", 3))
        setattr(args, f"{side}_attention_heads", getattr(args, f"{side}_attention_heads", 4))
    args.dropout = getattr(args, "dropout", 0.1)
    blockwise_base_architecture(args)
