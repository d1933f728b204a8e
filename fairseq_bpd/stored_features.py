"""Frozen-base training on stored base features (--stored-features).

Under --freeze-base a training pair's encoder output and top-layer decoder features never
change, yet every step computes them again with a forward through the whole base.
scripts/store_features.py computes them once (store_subset); under --stored-features the
task hands each batch its sentences' rows (StoredFeaturesDataset) and the model gives them
to the heads in place of the base's forward (BlockwiseTransformerModel.forward).

A directory holds, per subset, float32 .npy files of concatenated rows (memory-mapped
when read): {subset}.encoder.npy (source tokens x encoder width) and {subset}.decoder.npy
(target positions x decoder width), each sentence's rows in dataset index order, with
{subset}.offsets.npy (sentences + 1 x 2: where each sentence's source and target rows
start); and meta.json, which says what they were made from and lists a subset only once its
files are whole.
"""
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from fairseq import utils
from fairseq.data import BaseWrapperDataset
from fairseq.dataclass import FairseqDataclass

from .errors import BlockwiseRequestError

logger = logging.getLogger(__name__)

META = "meta.json"
SCRIPT = "scripts/store_features.py DATA BASE_CHECKPOINT DIR"


@dataclass
class StoredFeaturesConfig(FairseqDataclass):
    stored_features: Optional[str] = field(
        default=None,
        metadata={
            "help": "training under --freeze-base: read the base's encoder output and decoder "
            "features from this directory (scripts/store_features.py) instead of computing "
            "them every step"
        },
    )


def widths(model):
    """The widths of the encoder output and of the decoder's top-layer features: (int, int)."""
    return model.encoder.embed_tokens.embedding_dim, model.decoder.output_embed_dim


def sha256(path):
    """A file's sha256 (hex), read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def data_files(data_path, split, src, tgt, combined):
    """{name: sha256} of the binarised files fairseq reads for `split` of the pair src-tgt
    (with split1, split2, ... where `combined`, as fairseq-train reads its training subset):
    by content, since a file edited in place keeps its size."""
    pair = rf"({re.escape(src)}-{re.escape(tgt)}|{re.escape(tgt)}-{re.escape(src)})"
    pattern = re.compile(rf"{re.escape(split)}(\d*)\.{pair}\.({re.escape(src)}|{re.escape(tgt)})\.(bin|idx)")
    return {name: sha256(os.path.join(data_path, name)) for name in sorted(os.listdir(data_path))
            if (m := pattern.fullmatch(name)) and (combined or not m.group(1))}


def offsets_of(dataset):
    """Where each sentence's source and target rows start: sentences + 1 x 2 (int64)."""
    offsets = np.zeros((len(dataset) + 1, 2), dtype=np.int64)
    offsets[1:, 0] = np.cumsum(dataset.src_sizes)
    offsets[1:, 1] = np.cumsum(dataset.tgt_sizes)
    return offsets


def base_features(model, net_input):
    """The base's encoder output (fairseq's dict) and top-layer decoder features B x T x C of
    a batch's net_input: what is stored, and what the first batch is checked against."""
    encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    x, _ = model.decoder.extract_features(net_input["prev_output_tokens"], encoder_out=encoder_out)
    return encoder_out, x


def write_rows(array, starts, ids, features, real):
    """Each sentence's features at its real tokens into its rows of `array`: features
    B x L x C, real B x L (the tokens not padding), ids B, starts: each sentence's first row."""
    counts = real.sum(dim=1).cpu().numpy()
    expected = starts[ids + 1] - starts[ids]
    differ = np.flatnonzero(counts != expected)
    if len(differ):  # a sentence holding the padding symbol itself
        j = differ[0]
        raise BlockwiseRequestError(f"sentence {ids[j]} has {expected[j]} tokens, of which only {counts[j]} "
                                    f"are not the padding symbol: its features cannot be told from padding")
    rows = np.concatenate([np.arange(starts[i], starts[i] + n) for i, n in zip(ids, counts)])
    array[rows] = features[real].float().cpu().numpy()


@torch.no_grad()
def store_subset(model, task, subset, directory, max_tokens, combined=False):
    """Write the base's features of every sentence of `subset` to `directory`, in batches of
    up to `max_tokens` sorted by length, as fairseq batches; returns its entry of meta.json.

    model: the base, in eval mode, float32, on the device to run on. Sentences too long for
    its positions get no features (rows of zeros) and are named in the entry's "unstored".
    """
    task.load_dataset(subset, combine=combined)
    dataset = task.dataset(subset)
    offsets = offsets_of(dataset)
    arrays = {side: np.lib.format.open_memmap(os.path.join(directory, f"{subset}.{side}.npy"), mode="w+",
                                              dtype=np.float32, shape=(int(offsets[-1, column]), width))
              for side, column, width in zip(("encoder", "decoder"), (0, 1), widths(model))}
    batches = task.get_batch_iterator(
        dataset, max_tokens=max_tokens, ignore_invalid_inputs=True, required_batch_size_multiple=1,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=False)
    device = next(model.parameters()).device
    stored = np.zeros(len(dataset), dtype=bool)
    for sample in batches:
        net_input = utils.move_to_cuda(sample["net_input"], device) if device.type == "cuda" else sample["net_input"]
        encoder_out, x = base_features(model, net_input)
        ids = sample["id"].numpy()
        write_rows(arrays["encoder"], offsets[:, 0], ids, encoder_out["encoder_out"][0].transpose(0, 1),
                   net_input["src_tokens"].ne(model.encoder.padding_idx))
        write_rows(arrays["decoder"], offsets[:, 1], ids, x,
                   net_input["prev_output_tokens"].ne(model.decoder.padding_idx))
        stored[ids] = True
    for array in arrays.values():
        array.flush()
    np.save(os.path.join(directory, f"{subset}.offsets.npy"), offsets)
    data_path = utils.split_paths(task.cfg.data)[0]
    return {"sentences": len(dataset), "source_tokens": int(offsets[-1, 0]), "target_tokens": int(offsets[-1, 1]),
            "combined": combined, "unstored": np.flatnonzero(~stored).tolist(),
            "files": data_files(data_path, subset, task.cfg.source_lang, task.cfg.target_lang, combined)}


def rows_problem(directory, subset, meta, source_tokens, target_tokens):
    """Why `subset`'s stored rows in `directory` are not whole (float32 arrays of
    source_tokens and target_tokens rows at meta's widths), or None."""
    for side, rows in (("encoder", source_tokens), ("decoder", target_tokens)):
        name, shape = f"{subset}.{side}.npy", (int(rows), meta[f"{side}_dim"])
        try:
            array = np.load(os.path.join(directory, name), mmap_mode="r")
        except (OSError, ValueError) as error:  # missing, a header cut short, data shorter than the header says
            return f"cannot read {name} ({error})"
        if array.shape != shape or array.dtype != np.float32:
            return f"{name} holds {array.dtype} rows {array.shape}, not float32 {shape}"
    return None


# Task options under which fairseq's batches are not the sentences as the data holds them
# (their tokens, or the lengths it reports), each with its value that leaves them so:
# training refuses the others, and store_features.py stores with these.
SENTENCES_AS_HELD = {"truncate_source": False, "num_batch_buckets": 0}


def data_directory(task_cfg):
    """The one data directory a --stored-features training reads (task_cfg.data), its task
    options leaving the sentences as stored."""
    paths = utils.split_paths(task_cfg.data)  # the path fairseq's load_dataset read
    if len(paths) > 1:  # one directory of features stores one directory's data
        raise BlockwiseRequestError(f"--stored-features reads the features of one data directory; "
                                    f"DATA names {len(paths)} ({task_cfg.data})")
    for name, held in SENTENCES_AS_HELD.items():
        if getattr(task_cfg, name) != held:
            raise BlockwiseRequestError(f"--stored-features cannot be used with --{name.replace('_', '-')}: the "
                                        f"stored features are of the sentences as the data holds them")
    return paths[0]


def refuse_unfrozen(model_cfg):
    if not getattr(model_cfg, "freeze_base", False):
        raise BlockwiseRequestError("--stored-features needs --freeze-base: the stored features are the "
                                    "base's as it was, and a base that trains would leave them behind")


def stored_encoder_out(stored, src_tokens, padding_idx):
    """fairseq's encoder output (TransformerEncoder's dict) around the stored encoder output
    S x B x C of a batch whose source is src_tokens B x S; what the base does not store
    (embeddings, layer states) is empty."""
    padding = src_tokens.eq(padding_idx)  # B x S
    lengths = (~padding).sum(dim=1, dtype=torch.int32).reshape(-1, 1)
    return {"encoder_out": [stored["encoder_out"]], "encoder_padding_mask": [padding], "encoder_embedding": [],
            "encoder_states": [], "fc_results": [], "src_tokens": [], "src_lengths": [lengths]}


class StoredFeatures:
    """A --stored-features directory as training reads it: its meta.json read once, each
    subset checked against the data it is loaded with, the features against the base once."""

    def __init__(self, directory):
        self.directory, self.checked = directory, False
        path = os.path.join(directory, META)
        if not os.path.isfile(path):
            raise BlockwiseRequestError(f"--stored-features {directory}: no {META} there ({SCRIPT} writes it)")
        try:
            with open(path) as f:
                self.meta = json.load(f)
            self.meta["subsets"], self.meta["encoder_dim"], self.meta["decoder_dim"]  # noqa: B018 (present)
        except (ValueError, TypeError, KeyError) as error:
            self.refuse(f"{path} is not the meta.json {SCRIPT} writes ({type(error).__name__}: {error})")

    def refuse(self, why):
        raise BlockwiseRequestError(f"--stored-features {self.directory}: {why}; remake them with {SCRIPT}")

    def wrap(self, split, dataset, data_path, langs, combined):
        """`dataset` (split `split` of the pair langs, read from data_path) with its stored
        features in each batch, once its files, direction and sentence sizes are those they
        were made from."""
        made = (self.meta.get("source_lang"), self.meta.get("target_lang"))
        if None not in made + tuple(langs) and tuple(langs) != made:  # the same files serve both directions
            raise BlockwiseRequestError(  # store_features.py takes the base's direction: not remade
                f"--stored-features {self.directory}: they were made for {made[0]}-{made[1]} (the base's "
                f"direction), and this run trains {langs[0]}-{langs[1]}: train with --source-lang {made[0]} "
                f"--target-lang {made[1]}")
        entry = self.meta["subsets"].get(split)
        if entry is None:
            self.refuse(f"no features of '{split}' there (only of {', '.join(sorted(self.meta['subsets'])) or 'none'})")
        files = data_files(data_path, split, *langs, combined)
        if files != entry["files"]:
            changed = sorted(set(files.items()) ^ set(entry["files"].items()))[0][0]
            why = "not the file they were made from" if changed in files and changed in entry["files"] else (
                "not there" if changed not in files else "not read when they were made")
            self.refuse(f"'{split}' in {data_path} is not the data they were made from ({changed}: {why})")
        offsets = np.load(os.path.join(self.directory, f"{split}.offsets.npy"))
        here = offsets_of(dataset)
        if len(offsets) != len(here):
            self.refuse(f"'{split}' has {len(dataset)} sentences here, {len(offsets) - 1} stored")
        sizes, kept = np.diff(here, axis=0), np.diff(offsets, axis=0)  # sentences x 2: source, target tokens
        differ = np.flatnonzero((sizes != kept).any(axis=1))
        if len(differ):
            i = int(differ[0])
            self.refuse(f"sentence {i} of '{split}' has {sizes[i][0]} source and {sizes[i][1]} target tokens "
                        f"here, {kept[i][0]} and {kept[i][1]} stored")
        problem = rows_problem(self.directory, split, self.meta, *offsets[-1])
        if problem:
            self.refuse(problem)
        return StoredFeaturesDataset(dataset, self.directory, split, offsets, entry["unstored"])

    def check_widths(self, model):
        """Refuse features of another width than the model's encoder output and decoder features."""
        stored = (self.meta["encoder_dim"], self.meta["decoder_dim"])
        if stored != widths(model):
            self.refuse(f"its features are {stored[0]} (encoder) and {stored[1]} (decoder) wide, this model's "
                        f"{widths(model)[0]} and {widths(model)[1]}: they were made from another base")

    def check_base(self, model, sample):
        """Once a process, on its first batch: the base's own features against the stored ones
        (one forward of the base), so that features made by another base are refused."""
        net_input = sample.get("net_input", {}) if sample else {}
        if self.checked or "stored_features" not in net_input:
            return
        while hasattr(model, "module"):  # fairseq's DDP wrappers
            model = model.module
        stored = net_input["stored_features"]
        with torch.no_grad():
            encoder_out, x = base_features(model, net_input)
        source = net_input["src_tokens"].ne(model.encoder.padding_idx).t()  # S x B
        target = net_input["prev_output_tokens"].ne(model.decoder.padding_idx)  # B x T
        pairs = [(encoder_out["encoder_out"][0][source], stored["encoder_out"][source]),
                 (x[target], stored["decoder"][target])]
        # float32 rounding (another batch's shapes, another device); 16-bit training compares its own rounding
        tolerance = 1e-4 if x.dtype in (torch.float32, torch.float64) else 5e-2
        if not all(torch.allclose(own.float(), kept.float(), rtol=tolerance, atol=tolerance) for own, kept in pairs):
            worst = max(float((own.float() - kept.float()).abs().max()) for own, kept in pairs)
            self.refuse(f"they differ from this base's own features on the first batch (by up to {worst:.3g}): "
                        f"they were made from another base ({self.meta['checkpoint']}, sha256 "
                        f"{self.meta['checkpoint_sha256']}), not the one this run loads")
        self.checked = True
        logger.info(f"--stored-features {self.directory}: the first batch's stored features are the base's own")


class StoredFeaturesDataset(BaseWrapperDataset):
    """A language-pair dataset whose batches also carry their sentences' stored features:
    net_input["stored_features"] = {"encoder_out": S x B x C, "decoder": B x T x C}, laid out
    as the batch's src_tokens and prev_output_tokens (zeros at padding, either side)."""

    def __init__(self, dataset, directory, split, offsets, unstored):
        super().__init__(dataset)
        self.paths = {side: os.path.join(directory, f"{split}.{side}.npy") for side in ("encoder", "decoder")}
        self.split, self.offsets, self.unstored, self.arrays = split, offsets, set(unstored), None

    def __getstate__(self):  # a data-loader worker maps the files itself, no copy of them
        return {**self.__dict__, "arrays": None}

    @property
    def src(self):  # the task names a skipped input by its first words
        return self.dataset.src

    def collater(self, samples):
        batch = super().collater(samples)
        if not batch:
            return batch
        if self.arrays is None:
            self.arrays = {side: np.load(path, mmap_mode="r") for side, path in self.paths.items()}
        ids = batch["id"].tolist()
        if not self.unstored.isdisjoint(ids):
            raise BlockwiseRequestError(
                f"--stored-features: sentence {min(self.unstored.intersection(ids))} of '{self.split}' was too long "
                f"for the base's positions, and has no stored features")
        net_input = batch["net_input"]
        source = self.rows("encoder", 0, ids, net_input["src_tokens"].ne(self.dataset.src_dict.pad()))
        target = self.rows("decoder", 1, ids, net_input["prev_output_tokens"].ne(self.dataset.tgt_dict.pad()))
        net_input["stored_features"] = {"encoder_out": source.transpose(0, 1).contiguous(), "decoder": target}
        return batch

    def rows(self, side, column, ids, real):
        """The rows of sentences `ids` laid out at the real tokens `real` (B x L): B x L x C."""
        starts = self.offsets[:, column]
        array = self.arrays[side]
        rows = torch.from_numpy(np.concatenate([array[starts[i]:starts[i + 1]] for i in ids]))
        out = rows.new_zeros(*real.shape, rows.size(-1))
        out[real] = rows
        return out
