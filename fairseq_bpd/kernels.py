"""The lean pass's compiled kernels (csrc/lean.cpp): attention for a block's few queries and
a residual add with its layer norm, each one call where torch takes several.

Built with torch's C++ extension tools on first use (scripts/setup.sh builds it once, so
that decoding never waits for a compiler) into torch's extension cache, for this machine's
CPU (-march=native: the name carries the CPU's features, so a cache shared between machines
keeps one build per CPU). Where it cannot be built (no compiler) the log says so once and the
lean pass runs torch's operations: the same function, more operations.
$FAIRSEQ_BPD_KERNELS=0 runs torch's operations (before-and-after measurements; read on
every pass).

  .venv/bin/python -c 'from fairseq_bpd import kernels; print(kernels.build().__file__)'
"""
import hashlib
import logging
import os
import platform

import torch

logger = logging.getLogger(__name__)

VARIABLE = "FAIRSEQ_BPD_KERNELS"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "lean.cpp")
DTYPES = (torch.float32, torch.float64)

_loaded = {}  # "module": the extension, or None where it could not be built


def cpu_features():
    """What the compiler's -march=native sees of this CPU, as a short hash (for the build's name)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build(verbose=False):
    """The compiled module (building it if torch's cache has no build of this source for this CPU)."""
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-fopenmp-simd"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
    return load(name=f"fairseq_bpd_lean_{cpu_features()}", sources=[SOURCE], extra_cflags=flags, verbose=verbose)


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
    """A build failure in one line: the compiler's first error where it gave one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(error).__name__])[0 if errors else -1]


def serve(x):
    """The kernels where they serve a pass over x: on a CPU, float32 or float64, no autograd
    through x; else None."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return module()

