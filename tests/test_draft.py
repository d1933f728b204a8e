"""--head-type draft: one decoder layer drafts heads 2..k step by step; decoding stays exactly greedy."""
import pytest
import torch

from conftest import build, random_sample
from test_generator import assert_same, blockwise, eos_ending, greedy

from fairseq_bpd.draft import DraftDecoder
from fairseq_bpd.heads import following_tokens

DRAFT = ("--head-type", "draft")


def draft(data_dir, block_size, *extra, seed=1, dtype=torch.float64):
    """A tiny model with a draft decoder whose output layer is random, not zero."""
    task, model, args = build(data_dir, "--block-size", str(block_size), *DRAFT, *extra, seed=seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    model.decoder.heads.fc_out.weight.data.normal_(0, 0.5, generator=generator)
    return task, model, args


def teacher_forced(model, sample, inputs):
    """The base's features B x T x C on decoder inputs B x T, the encoder output, and the
    draft's teacher-forced block features B x T x k x C."""
    encoder_out = model.encoder.forward_torchscript(sample["net_input"])
    x, _ = model.decoder.extract_features(inputs, encoder_out=encoder_out)
    return x, encoder_out, model.decoder.heads.block_features(x, inputs=inputs, encoder_out=encoder_out)


def random_inputs(task, bsz, length, seed):
    """Decoder inputs B x T: BOS (EOS) then random words, right-padded at random lengths."""
    d = task.target_dictionary
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(d.nspecial, len(d), (bsz, length), generator=g)
    inputs[:, 0] = d.eos()
    for row, n in enumerate(torch.randint(2, length + 1, (bsz,), generator=g).tolist()):
        inputs[row, n:] = d.pad()
    return inputs


def test_the_draft_builds_and_needs_the_base_layout(data_dir):
    _, model, _ = build(data_dir, "--block-size", "3", *DRAFT)
    heads = model.decoder.heads
    assert type(heads) is DraftDecoder and not heads.independent
    assert heads.fc_out.weight.abs().sum() == 0  # every head starts as head 1
    with pytest.raises(ValueError, match="--head-type draft needs --head-layout base"):
        build(data_dir, "--block-size", "3", *DRAFT, "--head-layout", "paper")


@pytest.mark.parametrize("seed", range(2))
def test_decoding_steps_are_the_teacher_forced_steps(data_dir, seed):
    """Fed an accepted prefix in uneven chunks through its cache (rows at different
    lengths), then stepped on the reference tokens, the draft gives training's features."""
    k = 4
    task, model, _ = draft(data_dir, k, seed=seed)
    heads, d = model.decoder.heads, task.target_dictionary
    sample = random_sample(task, bsz=3, seed=seed)
    inputs = random_inputs(task, 3, 7, seed)
    x, encoder_out, block = teacher_forced(model, sample, inputs)  # block: B x T x k x C
    following = following_tokens(inputs, d.pad(), d.eos())
    lengths = inputs.ne(d.pad()).sum(1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.state = None
        heads.sync(x[:, 0], encoder_out)
        state, done = heads.state, torch.zeros(3, dtype=torch.long)
        while (done < lengths).any():
            # each row accepts 1..3 positions this block; the last of them comes with propose()
            count = torch.minimum(torch.randint(1, 4, (3,), generator=g), (lengths - done).clamp(min=1))
            m = int(count.max())
            index = (done[:, None] + torch.arange(m)).clamp(max=inputs.size(1) - 1)  # b x m
            take = lambda t: t.gather(1, index if t.dim() == 2 else index[..., None].expand(-1, -1, t.size(-1)))
            state.pending = (take(x), take(following), count - 1)
            last = (done + count - 1)[:, None]
            features = x.gather(1, last[..., None].expand(-1, -1, x.size(-1)))[:, 0]
            drafted = heads.feed_accepted(state, features, following.gather(1, last)[:, 0])
            for row in range(3):
                j = int(last[row])
                if j < int(lengths[row]):
                    assert torch.allclose(drafted[row], block[row, j, 1], atol=1e-10)
            # later steps, in the columns past the prefix, read the reference tokens
            step = drafted
            for i in range(1, k - 1):
                ahead = following.gather(1, (last + i).clamp(max=inputs.size(1) - 1))
                step = heads.feed(state, step[:, None], ahead, state.length[:, None] + i - 1)[:, 0]
                for row in range(3):
                    j = int(last[row])
                    if j + i < int(lengths[row]):
                        assert torch.allclose(step[row], block[row, j, i + 1], atol=1e-10)
            assert state.length.tolist() == (done + count).tolist()
            done = done + count
