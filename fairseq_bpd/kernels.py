"""The decoding loop's compiled kernels (csrc/): attention for a block's few queries, a
residual add with its layer norm, and an exact chain's verification (lean.cpp), each one call
where torch takes several; products of a few rows by packed float32 or int8 weights
(few_rows.cpp); the decoder's layers over a block at batch 1 in one call (block_pass.cpp);
the draft decoder's batch-1 step and chain in one call (draft_step.cpp); and head training's
dropout (dropout.cpp) and label-smoothed loss (smoothed_loss.cpp).

Built with torch's C++ extension tools on first use (scripts/setup.sh builds it once, so
that decoding never waits for a compiler) into torch's extension cache, for this machine's
CPU (-march=native), with OpenMP (few_rows.cpp's products and lean.cpp's attention split
their work between torch's threads, whose OpenMP runtime they share). The build's name
carries a hash of the sources and their header, the flags, torch's version and the CPU's
features, so checkouts and machines that share a cache keep a build each, and none loads
another's. A build lock left by a build that was killed (torch waits on it forever) is
removed once it is STALE_LOCK_SECONDS old. Where the kernels cannot be
built (no compiler) the log says why once a process and decoding runs torch's operations:
the same function, more operations. $FAIRSEQ_BPD_KERNELS=0 runs torch's operations
(before-and-after measurements; read on every pass).

  .venv/bin/python -c 'from fairseq_bpd import kernels; print(kernels.build().__file__)'
"""
import hashlib
import logging
import os
import platform
import time

import torch

logger = logging.getLogger(__name__)

VARIABLE = "FAIRSEQ_BPD_KERNELS"
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("lean.cpp", "few_rows.cpp", "draft_step.cpp", "block_pass.cpp",
                                                  "dropout.cpp", "smoothed_loss.cpp")]
HEADERS = [os.path.join(CSRC, "lean.h")]
DTYPES = (torch.float32, torch.float64)

_loaded = {}  # "module": the extension, or None where it could not be built


STALE_LOCK_SECONDS = 600  # a build takes under a minute; a lock this old is a killed build's
FLAGS = ["-O3", "-fopenmp"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])


def cpu_features():
    """What the compiler's -march=native sees of this CPU (its flags line)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return text


def build_name():
    """The build's name: a hash of what makes one build differ from another."""
    sources = []
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            sources.append(f.read())
    key = b"\0".join([*sources, " ".join(FLAGS).encode(), torch.__version__.encode(), cpu_features().encode()])
    return f"fairseq_bpd_lean_{hashlib.sha256(key).hexdigest()[:12]}"


def build(verbose=False):
    """The compiled module (building it where torch's cache has no build of this name)."""
    from torch.utils import cpp_extension

    name = build_name()
    directory = cpp_extension._get_build_directory(name, verbose)  # made where missing
    lock = os.path.join(directory, "lock")
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_SECONDS:
        logger.warning("fairseq_bpd: removing a stale build lock (%s), left by a build that was stopped", lock)
        try:
            os.remove(lock)
        except FileNotFoundError:  # another process removed it first
            pass
    if not any(f.endswith(".so") for f in os.listdir(directory)):
        logger.warning("fairseq_bpd: building the decoding kernels, once, into %s (about a minute)", directory)
    return cpp_extension.load(name=name, sources=SOURCES, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=directory, verbose=verbose)


def module():
    """The compiled kernels, or None: turned off by $FAIRSEQ_BPD_KERNELS=0, or not buildable here."""
    if os.environ.get(VARIABLE, "1") == "0":
        return None
    if "module" not in _loaded:
        try:
            _loaded["module"] = build()
        except Exception as error:  # no compiler, no headers: torch's operations serve
            logger.warning("fairseq_bpd: the lean pass's compiled kernels could not be built (%s); "
                           "decoding runs torch's operations instead (the same output, slower)", reason(error))
            _loaded["module"] = None
    return _loaded["module"]


def reason(error):
    """A build failure in one line: the compiler's first error, or what was not found, where
    the output says; else its last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if "error:" in line.lower() or "not found" in line.lower()]
    return (telling or lines or [type(error).__name__])[0 if telling else -1]


def serve(x):
    """The kernels where they serve a pass over x: on a CPU, float32 or float64, no autograd
    through x; else None."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return module()

