"""The blockwise decoder: fairseq's TransformerDecoder with k proposal heads and a block pass.

Stern, Shazeer & Uszkoreit, "Blockwise Parallel Decoding for Deep Autoregressive
Models", NeurIPS 2018. forward is fairseq's (training, and fairseq's own step: head 1
only); forward_block feeds a block of tokens after the cached prefix in one invocation,
and crop_cache keeps only its accepted entries, both through the cache's room
(cache.py): a StaticCache and the lean pass (static_pass.py) where block_layer
understands every layer, else fairseq's incremental state, with block_layer for the
layers it understands and fairseq's own for the others. What decoding keeps of the
weights (a transposed projection, a position table, the lean pass's arranged weights,
which layers block_layer runs) is made again whenever the weights change.
"""
import logging
import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from fairseq.models.transformer import TransformerDecoderBase

from .block_layer import block_layer, unsupported
from .cache import IncrementalCache, StaticCache
from .heads import HEAD_TYPES
from .product import Product
from .static_pass import LeanWeights, static_pass

logger = logging.getLogger(__name__)


def weights_key(*weights):
    """What tells that weights changed (storage, version counter, dtype, device), and whether
    what is made from them is made under inference_mode (whose tensors autograd refuses);
    None for inference_mode's own tensors, which keep no version counter: then nothing does."""
    key = [torch.is_inference_mode_enabled()]  # a loop, not generators: this runs a few times an invocation
    for w in weights:
        if w.is_inference():
            return None
        key += (w.data_ptr(), w._version, w.dtype, w.device)
    return tuple(key)


def own_tensors(modules):
    """The parameters and buffers of `modules` (a list the caller keeps), read from each one's
    own dicts: nn.Module.parameters() walks and deduplicates the module tree, which at batch 1
    costs more than the weights_key it feeds."""
    return [t for m in modules for kind in (m._parameters, m._buffers) for t in kind.values() if t is not None]


STATIC = "blockwise_static_cache"  # the incremental-state key of a StaticCache


class BlockwiseDecoder(TransformerDecoderBase):
    """TransformerDecoder with k proposal heads; `extra["block_features"]` is B x T x k x C."""

    # False: forward_block keeps fairseq's incremental-state format even where the lean path
    # could run (for a caller that reads the state with fairseq's own step).
    static_cache = True

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        self.proposal_heads = cfg.proposal_heads
        self.head_layout = cfg.head_layout
        self.head_vocab = getattr(cfg, "head_vocab", 0) or 0
        self.heads = HEAD_TYPES[getattr(cfg, "head_type", None) or "independent"](
            self,
            self.proposal_heads,
            self.head_layout,
            getattr(cfg, "head_ffn_dim", None) or cfg.decoder.ffn_embed_dim,
            cfg.activation_fn,
            cfg.dropout,
        )
        if getattr(cfg, "draft_train_heads", 0):  # --head-type draft only (model.draft_train_heads_problem)
            self.heads.train_heads = cfg.draft_train_heads
        self.heads_bf16 = bool(getattr(cfg, "heads_bf16", False))

    @property
    def block_size(self):
        """The number of heads k, under its name from before proposal_heads (the widest block)."""
        return self.proposal_heads

    def proposal_logits(self, x):
        """Training logits of heads 2..k (the criterion's entry): ... x C -> ... x N."""
        return self.heads.proposal_logits(x)

    def project(self, x, vocab=0):
        """Logits of a few positions at a time, for decoding: ... x C -> ... x N.

        N is the first `vocab` dictionary entries, or all of them (vocab 0). Computed as
        x·(Wᵀ), Wᵀ a contiguous copy kept across calls (transposed_projection): nn.Linear's
        x·Wᵀ on the V x C weight makes MKL re-pack all of W on every call, which for a
        handful of rows costs more than the product itself. Both round differently from
        fairseq's one-row step, which is why exactness is tested in float64.
        """
        if not self.plain_projection():
            # Anything else (adaptive softmax, a wrapped or hooked projection) runs as is.
            if vocab:
                return self.output_layer(x)[..., :vocab]
            return self.output_layer(x)
        columns = self.transposed_projection()  # C x V
        if not vocab and isinstance(columns, Product):  # the whole vocabulary: head 1's scores
            return columns(x.reshape(-1, x.size(-1))).view(*x.shape[:-1], columns[0].size(1))
        columns = columns[0][:, :vocab] if vocab else columns[0]
        if x.is_contiguous() and not x.requires_grad:  # matmul folds the rows into the same mm
            return torch.matmul(x, columns)
        # One 2-D product over all rows (x may be a transposed view: matmul would batch it).
        return torch.mm(x.reshape(-1, x.size(-1)), columns).view(*x.shape[:-1], columns.size(1))

    def plain_projection(self):
        """Whether the output projection is a plain bias-free nn.Linear with no hooks, which
        decoding may compute from its weight alone."""
        projection = self.output_projection
        return (type(projection) is nn.Linear and projection.bias is None
                and not projection._forward_hooks and not projection._forward_pre_hooks)

    def proposal_projection(self, vocab=0):
        """What proposals are scored by: the projection onto the first `vocab` entries (0: all),
        a contiguous C x N copy, and a bias of N zeros with -inf at padding (never proposed),
        so that one addmm gives their logits; None where the projection is not plain.

        The copy is contiguous because a k=8 chain scores seven times an invocation, each
        time reading the slice, and made again when the weight changes (weights_key).
        """
        if not self.plain_projection():
            return None
        weight = self.output_projection.weight
        key = weights_key(weight)
        if key is None:
            columns = weight.detach().t()[:, :vocab] if vocab else weight.detach().t()
            return columns, self.padding_bias(columns)
        if getattr(self, "_proposal_key", None) != (key, vocab):
            columns = self.transposed_projection()[0]
            columns = columns[:, :vocab].contiguous() if vocab else columns
            self._proposal, self._proposal_key = Product(columns, self.padding_bias(columns)), (key, vocab)
        return self._proposal

    def padding_bias(self, columns):
        """N zeros, -inf at padding, in the dtype of `columns` (C x N)."""
        bias = columns.new_zeros(columns.size(1))
        if self.padding_idx < bias.numel():
            bias[self.padding_idx] = -math.inf
        return bias

    def transposed_projection(self):
        """The output projection's weight transposed, contiguous, C x V, with a bias of zeros, as
        a product.Product, for decoding only (a plain (C x V view, None) where nothing tells a change).

        Copied again whenever the weight changes (.to(), .double(), load_state_dict: see
        weights_key); after training (train()) it is dropped. No gradient flows through it.
        """
        weight = self.output_projection.weight
        key = weights_key(weight)
        if key is None:  # nothing would tell an in-place change: nn.Linear's product, no copy
            return weight.detach().t(), None
        if getattr(self, "_transposed_key", None) != key:
            columns = weight.detach().t().contiguous()
            self._transposed = Product(columns, columns.new_zeros(columns.size(1)))
            self._transposed_key = key
        return self._transposed

    def forget_arranged(self):
        """Drop what decoding keeps of the weights (transposed_projection, position_table) and
        of the layers (lean_layers), and the encoder's (encoder_pass.encoder_weights)."""
        self._transposed_key = self._position_key = self._lean_layers = self._lean_weights = None
        self._proposal_key = self._encoder_weights = self._encoder_decided = None  # encoder_pass's

    def train(self, mode=True):
        """forget_arranged: fairseq's optimizers update p.data in place, which moves no version
        counter, and fairseq's Trainer switches modes around every step and validation."""
        self.forget_arranged()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        """model.half(), .float(), .to(...): what decoding arranged is dropped here and in the
        heads and the draft. Module._apply assigns p.data, which keeps the version counter,
        and the new storage may sit at the address the old one had (a float32 -> half ->
        float32 round trip), so weights_key alone could not tell. Not train(): under
        --freeze-base the base's modes are not the decoder's (model.train)."""
        result = super()._apply(fn, *args, **kwargs)
        for module in self.modules():
            if hasattr(module, "forget_arranged"):
                module.forget_arranged()
        return result

    def forward(
        self,
        prev_output_tokens,
        encoder_out=None,
        incremental_state=None,
        features_only=False,
        full_context_alignment=False,
        alignment_layer=None,
        alignment_heads=None,
        src_lengths=None,
        return_all_hiddens=False,
        base_features=None,
    ):
        """fairseq's forward, with every head's features in extra["block_features"] (B x T x k x C).

        base_features: the base's top-layer features B x T x C of these inputs, computed
        before (--stored-features, stored_features.py): the layers are not run."""
        if base_features is None:
            x, extra = self.extract_features(
                prev_output_tokens,
                encoder_out=encoder_out,
                incremental_state=incremental_state,
                full_context_alignment=full_context_alignment,
                alignment_layer=alignment_layer,
                alignment_heads=alignment_heads,
            )
        else:  # no layer ran: no attention, no layer states
            x, extra = base_features, {"attn": [None], "inner_states": []}
        if incremental_state is None:
            # Computed here, not in the criterion, so DDP sees every head used in forward.
            extra["block_features"] = self.block_features(x, prev_output_tokens, encoder_out)
            x = extra["block_features"][..., 0, :]
        else:
            # fairseq's own step-by-step search only needs head 1.
            x = self.heads.head1_features(x)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def block_features(self, x, inputs, encoder_out):
        """The heads' teacher-forced features B x T x C -> B x T x k x C (float32 where x is):
        under --heads-bf16, while the heads of a float32 model train, their products run in
        bfloat16 (a float16 or float64 model trains in its own dtype)."""
        if not (self.heads_bf16 and self.heads.training and torch.is_grad_enabled() and x.dtype == torch.float32):
            return self.heads.block_features(x, inputs=inputs, encoder_out=encoder_out)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.heads.block_features(x, inputs=inputs, encoder_out=encoder_out).to(x.dtype)

    def forward_block(self, tokens, positions, encoder_out, incremental_state, self_attn_mask=None,
                      longest=None, alignment=True):
        """Feed a block of new tokens after the cached prefix (one decoder invocation).

        fairseq's incremental path feeds one token; a block needs explicit positions
        and a mask inside the block. tokens: b x n; positions: b x n (position 0 is BOS),
        or an int p where every row's block is a chain at p, p+1, ... (one slice of the
        position table, no per-row lookup).
        self_attn_mask: n x n, 0 where block token i may attend to block token j and
        -inf elsewhere, the same for every sentence (default causal: a chain; a tree
        passes its ancestor mask). Every token attends to the whole cached prefix.
        Sentences whose cached prefixes differ in length share the cache's columns, the
        entries not theirs hidden (StaticCache: each row's own length; IncrementalCache:
        the key padding mask). Returns features b x n x C and the alignment layer's
        attention b x n x S (mean over heads; None with alignment False, where no one reads
        it: every layer's attention then runs fused). longest: an int at least positions.max(),
        where the caller knows one on the host (the generator does), sparing a wait for it.
        """
        n = tokens.size(1)
        cache = self.cache(incremental_state)
        # The lookup scaled, not a table scaled once and kept: a table kept across decodings
        # would miss a change made through .data (no version counter moves), and saves one
        # small operation an invocation.
        x = self.embed_scale * self.embed(tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if self.embed_positions is not None:
            if isinstance(positions, int):  # a chain after equal prefixes: rows p..p+n-1 for all
                x += self.positions_for(cache, positions + n)[positions : positions + n]
            else:
                longest = int(positions.max()) if longest is None else longest
                x += self.positions_for(cache, longest + 1)[positions]
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        dropout = self.dropout_module
        if dropout.training or dropout.apply_during_inference:
            x = dropout(x)
        if n > 1 and self_attn_mask is None:
            self_attn_mask = self.buffered_future_mask(x.transpose(0, 1))
        enc = encoder_out["encoder_out"][0] if encoder_out["encoder_out"] else None
        padding_mask = (
            encoder_out["encoder_padding_mask"][0] if encoder_out["encoder_padding_mask"] else None
        )
        alignment_layer = self.num_layers - 1 if alignment else None
        if type(cache) is StaticCache:
            x, attn = static_pass(self._lean_weights, cache, x, enc, padding_mask, self_attn_mask, alignment_layer)
        else:
            x, attn = self.incremental_pass(x.transpose(0, 1), enc, padding_mask, incremental_state, cache,
                                            self_attn_mask, alignment_layer)
            x = x.transpose(0, 1)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, attn

    def embed(self, tokens):
        """The tokens' embeddings (unscaled): ... -> ... x E; torch's own lookup where the module
        is a plain nn.Embedding with no hooks (the module's call, and F.embedding's checks of
        options decoding does not use, cost more than the lookup of a block)."""
        module = self.embed_tokens
        if (type(module) is nn.Embedding and module.max_norm is None and not module._forward_hooks
                and not module._forward_pre_hooks):
            return torch.embedding(module.weight, tokens)
        return module(tokens)

    def positions_for(self, cache, size):
        """position_table(size) or longer, kept by a StaticCache for its batch: the weights do
        not change while a batch decodes, and checking them costs more than the lookup."""
        table = getattr(cache, "position_rows", None)
        if table is None or table.size(0) < size:
            table = self.position_table(size)
            if type(cache) is StaticCache:
                cache.position_rows = self._position_table
        return table

    def incremental_pass(self, x, enc, padding_mask, incremental_state, cache, self_attn_mask, alignment_layer):
        """The layers over a block on fairseq's incremental state: x n x b x C -> n x b x C, and
        the attention of layer `alignment_layer` (None: none)."""
        n = x.size(0)
        full_mask = None  # a single token sees the whole prefix and itself, as in fairseq's step
        if n > 1:
            full_mask = x.new_zeros(n, cache.width() + n)
            full_mask[:, -n:] = self_attn_mask
        attn = None
        for idx, (layer, lean) in enumerate(zip(self.layers, self.lean_layers())):
            alignment = idx == alignment_layer
            if lean:  # the same function in fewer operations (block_layer.py)
                x, layer_attn = block_layer(layer, x, enc, padding_mask, cache, full_mask, alignment)
                if alignment:
                    attn = layer_attn
                continue
            x, layer_attn, _ = layer(
                x,
                enc,
                padding_mask,
                incremental_state,
                self_attn_mask=full_mask,
                need_attn=alignment,
                need_head_weights=alignment,
            )
            if alignment and layer_attn is not None:
                attn = layer_attn.float().to(x).mean(dim=0)
        return x, attn

    def lean_layers(self):
        """Which layers block_layer runs: a list of bools, decided again after train() or eval()
        (which is when a layer's dropout or modules change for decoding) and after any hook
        is registered anywhere (torch numbers every hook handle: one integer to compare),
        since block_layer does not call the modules a hook may sit on."""
        hooks = RemovableHandle.next_id
        if getattr(self, "_lean_layers", None) is None or getattr(self, "_lean_hooks", None) != hooks:
            self._lean_reasons = [unsupported(layer) for layer in self.layers]
            self._lean_modules = [m for layer in self.layers for m in layer.modules()]  # lean_weights' key
            self._lean_layers, self._lean_hooks = [reason is None for reason in self._lean_reasons], hooks
        return self._lean_layers

    def cache(self, incremental_state):
        """The block pass's cache in `incremental_state`: its StaticCache (cache.py), made on
        the first block where block_layer understands every layer (the lean path), else
        IncrementalCache, fairseq's format. Says once in the log why the lean path is off."""
        static = incremental_state.get(STATIC)
        if static is not None:
            return static
        if not incremental_state:
            lean = self.lean_layers()
            if all(lean) and self.static_cache:
                self._lean_weights = self.lean_weights()
                static = incremental_state[STATIC] = StaticCache(self.layers)
                return static
            if not all(lean):
                self.say_why_not_lean(lean)
        return IncrementalCache(self.layers, incremental_state)

    def say_why_not_lean(self, lean):
        reasons = getattr(self, "_lean_reasons", [None] * len(lean))
        why = "; ".join(f"layer {i}: {reason or 'not understood'}" for i, (ok, reason)
                        in enumerate(zip(lean, reasons)) if not ok)
        if why != getattr(self, "_said_why", None):
            self._said_why = why
            logger.info(f"blockwise: no static cache nor lean pass, fairseq's incremental state and layers "
                        f"where block_layer does not reproduce them ({why})")

    def lean_weights(self):
        """The layers' weights as the lean pass reads them (static_pass.LeanWeights), arranged
        again when any of them changes (weights_key)."""
        self.lean_layers()  # its module list, kept while the modules cannot have changed
        key = weights_key(*own_tensors(self._lean_modules))
        if key is None or getattr(self, "_lean_weights", None) is None or self._lean_weights_key != key:
            self._lean_weights, self._lean_weights_key = LeanWeights(self.layers), key
        return self._lean_weights

    def reorder_incremental_state_scripting(self, incremental_state, new_order):
        """Keep the sentences at new_order: the StaticCache's reorder, or fairseq's."""
        static = incremental_state.get(STATIC)
        if static is not None:
            return static.reorder(new_order)
        return super().reorder_incremental_state_scripting(incremental_state, new_order)

    def cache_width(self, incremental_state):
        """Columns of the self-attention cache before the next block: an int."""
        return self.cache(incremental_state).width()

    def cached_length(self, incremental_state):
        """Every sentence's cached entries where all have as many and the cache knows it on
        the host (an int: the static cache at batch 1 always), else None."""
        return self.cache(incremental_state).uniform_length()

    def crop_cache(self, incremental_state, cached, block_width, keep, kept, counts=None):
        """Keep only the accepted entries of the last block (the cache's crop): cached + kept, b.
        counts: kept as a host list, where the caller has read it (spares the cache a read)."""
        return self.cache(incremental_state).crop(cached, block_width, keep, kept, counts)

    def position_table(self, size):
        """Positional embeddings of positions 0..size-1: size x C (learned or sinusoidal).

        Kept across calls (each decoder invocation reads it) in a power-of-two size, and
        made again when the embeddings' weights, dtype or device change, or after train().
        """
        weight = self.embed_tokens.weight
        key = weights_key(weight, *self.embed_positions.parameters(recurse=False))
        table = getattr(self, "_position_table", None)
        if key is None or table is None or table.size(0) < size or self._position_key != key:
            rows = min(1 << max(size - 1, 63).bit_length(), max(size, self.max_positions()))  # 64 at least
            dummy = torch.full((1, rows), self.padding_idx + 1, dtype=torch.long, device=weight.device)
            self._position_table, self._position_key = self.embed_positions(dummy)[0].detach(), key
        return self._position_table[:size]

    def upgrade_state_dict_named(self, state_dict, name):
        """Give a plain transformer checkpoint (or one with heads of another type) fresh heads."""
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        prefix = f"{name}.heads." if name else "heads."
        own = {prefix + key for key in self.heads.state_dict()}
        foreign = [key for key in state_dict if key.startswith(prefix) and key not in own]
        for key in foreign:  # another --head-type's weights: nothing of them fits these heads
            del state_dict[key]
        if foreign:
            logger.info(f"dropped {len(foreign)} proposal-head tensors of another head type ({prefix}*)")
        added = 0
        for key, value in self.heads.state_dict().items():
            if prefix + key not in state_dict:
                state_dict[prefix + key] = value.clone()
                added += 1
        if added:
            logger.info(f"initialised {self.proposal_heads}-head proposal layer ({prefix}*)")
        return state_dict
