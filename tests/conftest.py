"""Tiny seeded blockwise models built through fairseq's own parser, task and builders."""
import os
import random
import tempfile

import pytest
import torch
from fairseq import options, tasks, utils

# Width tables (--blockwise alone) in a folder of the test run's own, not the user's cache: a
# table measured there for a model of the same weights would change what the tests decode.
os.environ["FAIRSEQ_BPD_WIDTHS"] = tempfile.mkdtemp(prefix="fairseq_bpd-test-widths-")
PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_bpd")
VOCAB = 24  # words w0..w23 besides fairseq's four specials


def write_dicts(directory, src="de", tgt="en", vocab=VOCAB):
    os.makedirs(directory, exist_ok=True)
    for lang in (src, tgt):
        with open(os.path.join(directory, f"dict.{lang}.txt"), "w") as f:
            for i in range(vocab):
                f.write(f"w{i} {1000 - i}\n")
    return directory


def parse(data_dir, *extra, task="translation_blockwise", arch="transformer_blockwise"):
    utils.import_user_module(type("A", (), {"user_dir": PLUGIN})())
    parser = options.get_training_parser()
    argv = [
        data_dir, "--user-dir", PLUGIN, "--task", task, "--arch", arch,
        "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
        "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--dropout", "0", "--source-lang", "de", "--target-lang", "en",
        *extra,
    ]
    return options.parse_args_and_arch(parser, argv)


def build(data_dir, *extra, seed=1, dtype=torch.float64, **kwargs):
    """A tiny model with random (not zero) head weights, in eval mode."""
    args = parse(data_dir, *extra, **kwargs)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    heads = getattr(model.decoder, "heads", None)
    if getattr(heads, "fc2", None) is not None:
        torch.nn.init.normal_(heads.fc2.weight, std=0.5)
    return task, model.to(dtype).eval(), args


def random_sample(task, bsz, seed, min_len=2, max_len=9):
    """A left-padded source batch of random words, as fairseq's LanguagePairDataset makes."""
    rng = random.Random(seed)
    d = task.source_dictionary
    sentences = [
        [rng.randrange(d.nspecial, len(d)) for _ in range(rng.randint(min_len, max_len))] + [d.eos()]
        for _ in range(bsz)
    ]
    width = max(map(len, sentences))
    src = torch.full((bsz, width), d.pad(), dtype=torch.long)
    for i, s in enumerate(sentences):
        src[i, width - len(s):] = torch.tensor(s)
    return {
        "id": torch.arange(bsz),
        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([len(s) for s in sentences])},
    }


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """On two shared cores torch's second thread makes these tiny models slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def packed_wherever_it_applies(monkeypatch):
    """In this process every product that may run on its packed copy does (product.packed_pays
    says yes without timing): which kernel a product runs must not depend on the machine's
    timings where a test counts them. tests/test_product.py times the real choice, and the
    tests that run fairseq's own commands in a process of theirs decode with it."""
    from fairseq_bpd import product
    monkeypatch.setattr(product, "packed_pays", lambda _product, _x: True)


@pytest.fixture
def data_dir(tmp_path):
    return write_dicts(str(tmp_path / "data"))
