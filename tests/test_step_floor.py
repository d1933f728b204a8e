"""scripts/step_floor.py: the least greedy step is fairseq's greedy step (float64), and refuses
decoders it does not compute."""
import os
import sys

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import build, random_sample

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import step_floor  # noqa: E402


@pytest.mark.parametrize("extra", [(), ("--decoder-normalize-before",), ("--decoder-learned-pos",),
                                   ("--activation-fn", "gelu")])
@pytest.mark.parametrize("max_len", [200, 3])
def test_the_floor_step_decodes_as_fairseqs_greedy(data_dir, extra, max_len):
    task, model, _ = build(data_dir, *extra, seed=3)
    tgt = task.target_dictionary
    sample = random_sample(task, bsz=6, seed=5)
    greedy = SequenceGenerator([model], tgt, beam_size=1, max_len_a=0, max_len_b=max_len)
    with torch.inference_mode():
        expected = [hypos[0]["tokens"].tolist() for hypos in greedy.generate([model], sample)]
        outputs, seconds = step_floor.floor_greedy(model, sample, tgt, max_len)
    assert outputs == expected
    assert len(seconds) == 6 and all(s > 0 for s in seconds)
    if max_len == 3:  # random weights: some sentence runs to the forced EOS
        assert max(map(len, outputs)) == 4


def test_a_decoder_it_does_not_compute_is_refused(data_dir):
    task, model, _ = build(data_dir, "--layernorm-embedding")
    sample = random_sample(task, bsz=1, seed=1)
    with pytest.raises(ValueError, match="layernorm_embedding"):
        step_floor.floor_greedy(model, sample, task.target_dictionary, 5)
