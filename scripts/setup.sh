#!/usr/bin/env bash
# Builds .venv with the pinned stack; a second run does nothing when .venv is already right.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.fairseq_bpd-stamp"
want=$(cat requirements.txt requirements-fairseq.txt setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "setting up $VENV (a few minutes: fairseq-fixed compiles its extensions)" >&2
python3.11 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade "pip<25" setuptools==75.6.0 wheel
# torch first, from the pinned CPU wheel, so nothing later can pull another build.
$PIP install torch==2.13.0
$PIP install -r requirements.txt
$PIP install --no-build-isolation --no-deps --require-hashes -r requirements-fairseq.txt
$PIP install --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import torch, fairseq, fairseq_bpd; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# The lean pass's compiled kernels (fairseq_bpd/kernels.py), built now so that decoding never
# waits for the compiler; without one, decoding runs torch's operations (the same output).
"$VENV/bin/python" -c 'from fairseq_bpd import kernels; print("built", kernels.build().__file__)' 2>/dev/null || echo "fairseq_bpd: kernels not built (no C++ compiler?); decoding still works" >&2
echo "$want" > "$STAMP"
