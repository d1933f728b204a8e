"""The proposal heads' training loss over logit rows, fused where the kernels are built.

fairseq's label_smoothed_nll_loss of a log-softmax makes a float32 copy of the N x V logits,
their log-softmax, a gather and a row sum, and as many passes again backward: in frozen head
training, where the base costs nothing, those passes over every head's rows were the largest
part of a step. csrc/smoothed_loss.cpp reads each row while it is in cache, keeps only its
log-sum-exp for backward and writes the gradient in the logits' dtype. The same loss, to
float32 rounding (the sums run in another order); off the CPU, for other dtypes or without
the kernels, torch's operations give it.
"""
import torch
from fairseq import utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from torch.autograd.function import once_differentiable

from . import kernels

DTYPES = (torch.float32, torch.bfloat16)


class _SmoothedNll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, eps, ignore_index, module):
        loss, lse, best = module.smoothed_nll_forward(logits, target, eps, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.eps, ctx.ignore_index, ctx.module = eps, ignore_index, module
        ctx.mark_non_differentiable(best)
        return loss, best

    @staticmethod
    @once_differentiable  # its backward is the kernel, which autograd cannot differentiate again
    def backward(ctx, grad_loss, _grad_best):
        logits, target, lse = ctx.saved_tensors
        grad = ctx.module.smoothed_nll_backward(grad_loss.float().contiguous(), logits, target, lse, ctx.eps,
                                                ctx.ignore_index)
        return grad, None, None, None, None


def smoothed_nll(logits, target, eps, ignore_index):
    """Each row's label-smoothed loss and best token: logits N x V, target N -> N (float32), N.

    The loss is fairseq's label_smoothed_nll_loss(log_softmax(logits.float()), target, eps,
    ignore_index, reduce=False) (0 where the target is ignore_index); the best token is the
    first of a row's maxima, as max's index over its log-probs."""
    module = kernels.module() if logits.device.type == "cpu" and logits.dtype in DTYPES else None
    if module is None or logits.dim() != 2 or logits.size(1) < 2:
        lprobs = utils.log_softmax(logits, dim=-1)
        loss, _ = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=ignore_index, reduce=False)
        return loss.view(-1), lprobs.max(dim=-1).indices
    return _SmoothedNll.apply(logits.contiguous(), target.contiguous(), float(eps), int(ignore_index), module)
