"""What each head is trained to predict: the reference shifted, as fairseq lays targets out.

Both the loss (criterion.py) and the heads that read reference tokens (heads.py) need it,
so it belongs to neither.
"""


def shift_target(target, offset, pad):
    """The target head `offset` is trained on: B x T, token t+offset at t.

    Pad past the end, and wherever the target itself is pad: with left padding
    (--left-pad-target) a padding position is followed by real tokens.
    """
    if offset == 0:
        return target
    shifted = target.new_full(target.shape, pad)
    shifted[:, :-offset] = target[:, offset:]
    return shifted.masked_fill_(target.eq(pad), pad)
