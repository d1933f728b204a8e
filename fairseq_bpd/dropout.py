"""Dropout for the proposal heads' training, with a mask each element's index decides.

torch's CPU dropout draws its mask from one Mersenne twister, element after element on one
thread: in a draft decoder's training step its masks took about as long as the layer's
products. HashDropout keeps or drops element i by a hash of i and a seed drawn from torch's
generator (csrc/dropout.cpp): the same law (kept with probability 1 - p, scaled by
1 / (1 - p)), split between threads, with no mask kept for backward, which applies the same
function of the same seed to the gradient. Runs follow torch.manual_seed as before, with
other masks than nn.Dropout's. Where the kernels are not built, off the CPU, or past their
limits, it is nn.Dropout.
"""
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import kernels

MOST_ELEMENTS = 1 << 32  # the kernel hashes 32-bit element indices
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _HashDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, module):
        ctx.p, ctx.seed, ctx.module = p, seed, module
        return module.hash_dropout(x.contiguous(), p, seed)

    @staticmethod
    @once_differentiable  # its backward is the kernel, which autograd cannot differentiate again
    def backward(ctx, grad):
        return ctx.module.hash_dropout(grad.contiguous(), ctx.p, ctx.seed), None, None, None


def hash_dropout(x, p, seed, module=None):
    """x with each element kept with probability 1 - p (scaled by 1 / (1 - p)), else times 0, by the
    kept mask that `seed` and the element's index in x (made contiguous) decide: ... -> ..."""
    return _HashDropout.apply(x, p, seed, module or kernels.module())


def draw_seed():
    """A 63-bit seed from torch's default generator (so torch.manual_seed repeats a run)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


class HashDropout(nn.Dropout):
    """nn.Dropout whose mask is hashed from a seed (hash_dropout) where the kernels serve."""

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        module = kernels.module() if x.device.type == "cpu" and x.dtype in DTYPES else None
        if module is None or self.p >= 1 or self.inplace or x.numel() >= MOST_ELEMENTS:
            return super().forward(x)
        return hash_dropout(x, self.p, draw_seed(), module)
