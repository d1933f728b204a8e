"""scripts/train_speed.py: fairseq-train's wps read from its log, and a failed run named."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import train_speed  # noqa: E402

LOG = """\
2026-12-05 09:29:03 | INFO | fairseq_cli.train | {'common': {'log_interval': 10}}
2026-12-05 09:29:03 | INFO | train_inner | epoch 001:     10 / 494 loss=1.6, wps=900.5, ups=0.9, num_updates=10, lr=1e-4
2026-12-05 09:29:13 | INFO | train_inner | epoch 001:     20 / 494 loss=1.5, wps=3369.5, ups=0.92, num_updates=20, lr=2e-4
2026-12-05 09:29:23 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 2.2 | wps 9999.0 | num_updates 20
2026-12-05 09:29:33 | INFO | train_inner | epoch 001:     30 / 494 loss=1.4, wps=4097.2, ups=1.14, num_updates=30, lr=3e-4
"""


def test_wps_is_read_from_train_inner_lines_past_the_skipped_updates():
    # The first interval (start-up) is skipped; the validation line's wps is not training's.
    assert train_speed.wps_lines(LOG, skip=10) == [(20, 3369.5), (30, 4097.2)]
    assert train_speed.wps_lines(LOG, skip=0)[0] == (10, 900.5)
    assert train_speed.wps_lines(LOG, skip=30) == []


def test_a_failed_training_is_named_with_its_log(tmp_path):
    script = tmp_path / "train_heads.sh"
    script.write_text("echo 'error: base checkpoint not found: BASE' >&2\nexit 3\n")
    with pytest.raises(SystemExit) as failed:
        train_speed.train(str(script), str(tmp_path), str(tmp_path / "base.pt"), 8, 5, 1, [])
    message = str(failed.value)
    assert str(script) in message and "(3)" in message and "base checkpoint not found" in message


def test_no_interval_past_the_skip_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_speed, "train", lambda *args: LOG)
    monkeypatch.setattr(sys, "argv", ["train_speed.py", "s.sh", "data", "base.pt", "--skip", "30"])
    with pytest.raises(SystemExit) as refused:
        train_speed.main()
    assert "no train_inner line past update 30" in str(refused.value)
    monkeypatch.setattr(sys, "argv", ["train_speed.py", "s.sh", "data", "base.pt", "--skip", "10"])
    train_speed.main()
    assert capsys.readouterr().out.startswith("wps 3733 (updates 20..30: 3370 4097)")
