"""What fairseq_bpd changes outside itself when it is imported, all in one place.

- torch's weights-only loading (torch >= 2.6 loads with weights_only=True, and fairseq
  0.12 does not say otherwise) may build exactly the globals a fairseq checkpoint holds,
  found with torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints of this
  plugin and of plain --arch transformer; nothing more.
- fairseq's checkpoint loader: a file that is no loadable checkpoint (a packed one among
  them) raises CheckpointError naming it and why, not a pickle traceback; a checkpoint's model may
  upgrade the options it was saved with (upgrade_saved_options) before load-time
  overrides are applied; the decoding flags saved in its task options are the training
  run's, not a request: a task built from them (the hub) decodes as the load's overrides
  ask, each flag not given at its default; its --stored-features, a training run's
  directory, is forgotten.
- fairseq's checkpoint copies are atomic, so a killed job leaves a whole
  checkpoint_last.pt to resume from.
- fairseq's commands (fairseq-generate, fairseq-train, python -m fairseq_cli.generate,
  ...) print an uncaught BlockwiseRequestError as `error: <message>` on one line; other
  programs keep Python's traceback.
"""
import argparse
import collections
import os
import pickle
import re
import sys
import typing

import numpy as np
import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import overwrite_args_by_name
from fairseq.distributed.utils import _TensorPlaceholder
from fairseq.file_io import PathManager
from fairseq.models import ARCH_MODEL_REGISTRY
from omegaconf import DictConfig, ListConfig, open_dict
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct
except ImportError:
    from numpy.core.multiarray import _reconstruct

from .errors import BlockwiseRequestError, CheckpointError

CHECKPOINT_GLOBALS = [
    # --arch (legacy) models keep their flags as a Namespace in cfg.model (old ones in "args").
    argparse.Namespace,
    # --eval-bleu logs n-gram counts as int64 arrays; they stay in the saved meters.
    _reconstruct,
    np.ndarray,
    np.dtype,
    type(np.dtype("int64")),
]
# Multi-process resume: rank 0 torch.save's the loaded state, its cfg an omegaconf
# DictConfig and its tensors swapped for placeholders, and the other ranks torch.load it
# (fairseq.distributed.utils.broadcast_object).
BROADCAST_GLOBALS = [
    DictConfig,
    ListConfig,
    ContainerMetadata,
    Metadata,
    AnyNode,
    typing.Any,  # omegaconf's ref, key and element types
    dict,
    list,
    int,
    collections.defaultdict,  # omegaconf's resolver cache
    _TensorPlaceholder,
]
torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS + BROADCAST_GLOBALS)
# Modules whose globals torch's weights-only unpickler refuses even when allow-listed.
BLOCKED_MODULES = getattr(
    torch._weights_only_unpickler, "_blocklisted_modules", ["sys", "os", "posix", "nt"]
)


def _refusal(path, error):
    """The message for a checkpoint whose loading failed, or None if the file is not to blame."""
    corrupt = f"cannot read checkpoint {path}: the file is truncated or corrupt"
    local_path = PathManager.get_local_path(path)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(local_path)
    except ValueError:  # not a zip: a legacy (torch < 1.6) file, or not a checkpoint at all
        # torch's weights-only unpickler stops at the first global it refuses, and names it.
        unsafe = re.findall(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", str(error))
        if not unsafe:
            return _not_a_checkpoint(path, local_path, corrupt)
    except Exception as reason:  # torch's zip reader raises RuntimeError, the pickle EOFError, ...
        return f"{corrupt} ({reason})"
    if unsafe:
        names = ", ".join(sorted(unsafe))
        refused = (
            f"refusing to load checkpoint {path}: it holds {names}, which fairseq "
            "checkpoints do not hold, and torch.load (weights_only=True) will not build "
            "objects it does not know, since unpickling them can run arbitrary code."
        )
        blocked = [name for name in unsafe if name.rpartition(".")[0] in BLOCKED_MODULES]
        if blocked:  # add_safe_globals cannot let these through: no advice to try it
            return (
                f"{refused} torch refuses {', '.join(sorted(blocked))} whatever the "
                f"allow-list (it blocks the modules {', '.join(BLOCKED_MODULES)}): no "
                "checkpoint needs them, and a file holding them is most likely made to "
                "run code when loaded"
            )
        return (
            f"{refused} If you trust this file, allow them in your own code before "
            f"loading it: torch.serialization.add_safe_globals([{names}])"
        )
    if isinstance(error, (pickle.UnpicklingError, EOFError)):
        return f"{corrupt} ({error})"
    return _not_a_checkpoint(path, local_path, corrupt)


def _not_a_checkpoint(path, local_path, corrupt):
    """Why the file torch.save wrote (or not) is no fairseq checkpoint; None if it is one.

    A tensor, a list or a bare state dict saved with torch.save loads, and fairseq then
    fails on it with a TypeError or KeyError that names neither the file nor the cause.
    """
    try:
        state = torch.load(local_path, map_location="cpu")  # weights-only: builds nothing unsafe
    except Exception as reason:
        return f"{corrupt}, or torch.save did not write it ({type(reason).__name__}: {reason})"
    if isinstance(state, dict) and "model" in state and ("cfg" in state or "args" in state):
        return None
    if isinstance(state, dict) and "packed_model" in state:
        return packed(path)
    found = f"a {type(state).__name__}"
    if isinstance(state, dict):
        keys = sorted(map(repr, state))
        found = f"a dict of {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
    return (
        f"cannot load checkpoint {path}: it is not a fairseq checkpoint (it holds {found}; "
        "fairseq-train saves a dict of 'model', the weights, and 'cfg', the configuration "
        "the model is built from)"
    )


def packed(path):
    return (f"{path} is a packed checkpoint (scripts/pack_checkpoint.py): unpack it first, "
            f"python scripts/pack_checkpoint.py unpack {path} OUT.pt, and load OUT.pt")


_fairseq_load_checkpoint_to_cpu = checkpoint_utils.load_checkpoint_to_cpu


# Overrides that the checkpoint's model must see only after upgrade_saved_options: the
# hub's block_size sets the decoding block, while a checkpoint saved before
# --proposal-heads names its heads by block_size alone.
LATE_OVERRIDES = ("block_size",)


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """fairseq's loader, but a bad file raises CheckpointError naming it, not a pickle traceback,
    and the checkpoint's model upgrades its saved options before LATE_OVERRIDES apply.

    fairseq applies arg_overrides to the options as it reads them, before its own
    upgrade; those in LATE_OVERRIDES are held back and applied, as fairseq does, after
    upgrade_saved_options.
    """
    late = {name: arg_overrides[name] for name in LATE_OVERRIDES if name in (arg_overrides or {})}
    early = None if arg_overrides is None else {k: v for k, v in arg_overrides.items() if k not in late}
    try:
        state = _fairseq_load_checkpoint_to_cpu(path, early, load_on_all_ranks)
    # What torch.load raises on a bad file (an IndexError: an old-format file cut after a
    # byte or so), and fairseq on a file that is no checkpoint (TypeError, KeyError);
    # _refusal lets through whatever the file is not to blame for. An OSError that
    # names no file is torch's reader seeking past the end of a truncated one; one that
    # names it is open()'s (a missing file, a directory, no permission).
    except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError, ValueError, OSError,
            IndexError, TypeError) as error:
        if isinstance(error, OSError) and error.filename is not None:
            raise
        message = _refusal(path, error)
        if message is None:
            raise
        raise CheckpointError(message) from None
    if "model" not in state and "packed_model" in state:  # fairseq would end in a bare KeyError: 'model'
        raise CheckpointError(packed(path))
    upgrade_saved_options(state)
    forget_saved_decoding_flags(state, arg_overrides or {})
    forget_stored_features(state, arg_overrides or {})
    if late:
        if state.get("args") is not None:
            for name, value in late.items():
                setattr(state["args"], name, value)
        if state.get("cfg") is not None:
            overwrite_args_by_name(state["cfg"], late)
    return state


def upgrade_saved_options(state):
    """Let the model a checkpoint was saved from upgrade its options, as fairseq lets it
    upgrade its weights: the registered model class's upgrade_saved_options(model options)."""
    cfg = state.get("cfg")
    options = cfg.get("model") if cfg is not None else None
    model_class = ARCH_MODEL_REGISTRY.get(getattr(options, "arch", None))
    upgrade = getattr(model_class, "upgrade_saved_options", None)
    if upgrade is not None:
        with open_dict(cfg):
            upgrade(options)


def forget_saved_decoding_flags(state, overrides):
    """The checkpoint's task options with every decoding flag (the task's decoding_options)
    at its default or as `overrides` give it: a training run's --block-size (its k) fixes no
    decoding width, and a flag newer than the checkpoint, which fairseq's override merge
    drops for want of a saved key, is still applied."""
    from .options import flag  # imported when loading: the task's modules import this one's users
    from .task import TranslationBlockwiseTask

    cfg = state.get("cfg")
    task = cfg.get("task") if cfg is not None else None
    if not isinstance(task, DictConfig) or "blockwise" not in task:  # not a blockwise task's options
        return
    with open_dict(task):
        for name in TranslationBlockwiseTask.decoding_options:
            task[name] = overrides.get(name, flag(name))


def forget_stored_features(state, overrides):
    """The checkpoint's task options without the --stored-features its training read: a task
    built from them (the hub, the scripts) loads its data as any other, and runs the base."""
    cfg = state.get("cfg")
    task = cfg.get("task") if cfg is not None else None
    if isinstance(task, DictConfig) and task.get("stored_features") and "stored_features" not in overrides:
        with open_dict(task):
            task.stored_features = None


# fairseq's trainer, load_model_ensemble(_and_task) and hub_utils all reach the loader as
# checkpoint_utils.load_checkpoint_to_cpu at call time, so replacing the attribute covers
# fairseq-train, fairseq-generate, fairseq-interactive and from_pretrained.
if getattr(checkpoint_utils.load_checkpoint_to_cpu, "__module__", None) != __name__:
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


class AtomicCopyPathManager(PathManager):
    """fairseq's PathManager, but a copy lands whole or not at all.

    fairseq writes a save's first file atomically (to .tmp, then rename) and then copies
    it to checkpoint_last.pt and checkpoint_best.pt in place, so a job killed during the
    copy leaves a truncated checkpoint_last.pt and its resume fails. Copy the same way.
    """

    @staticmethod
    def copy(src_path, dst_path, overwrite=False):
        if not PathManager.supports_rename(dst_path):
            return PathManager.copy(src_path, dst_path, overwrite)
        copied = PathManager.copy(src_path, dst_path + ".tmp", overwrite=True)
        if copied:
            os.replace(dst_path + ".tmp", dst_path)  # unlike os.rename, also over a file on Windows
        return copied


# checkpoint_utils.save_checkpoint reaches the copy as its module's PathManager.copy.
if getattr(checkpoint_utils.PathManager, "__module__", None) != __name__:
    checkpoint_utils.PathManager = AtomicCopyPathManager


def running_a_fairseq_command():
    """Whether this process is one of fairseq's commands: its console scripts (fairseq-generate,
    fairseq-train, ...) run fairseq_cli's cli_main from their __main__, and `python -m
    fairseq_cli.generate` runs the module as __main__."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("fairseq_cli."):
        return True
    return (getattr(getattr(main, "cli_main", None), "__module__", None) or "").startswith("fairseq_cli.")


def print_refusals(fallback):
    """sys.excepthook for fairseq's commands: an uncaught refusal on one line, `error: <message>`."""

    def excepthook(kind, value, traceback):
        # A refusal raised while another error was being handled is not the whole story.
        chained = value.__cause__ is not None or (value.__context__ is not None and not value.__suppress_context__)
        if isinstance(value, BlockwiseRequestError) and not chained:
            print(f"error: {value}", file=sys.stderr)
            # Out now, not through the interpreter's shutdown: a refusal made mid-training
            # leaves fairseq's data thread (a daemon) inside torch, and a shutdown around it
            # aborted the process after the message (terminate called, status 134).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        else:
            fallback(kind, value, traceback)

    return excepthook


# Only uncaught exceptions reach the hook, so callers that catch the error see no change;
# a program that merely imports the plugin keeps its own hook and Python's tracebacks.
if running_a_fairseq_command() and getattr(sys.excepthook, "__module__", None) != __name__:
    sys.excepthook = print_refusals(sys.excepthook)
