#!/usr/bin/env bash
# The whole recipe behind models/demo/: corpus -> base transformer -> distillation ->
# 8 proposal heads fine-tuned with the base on the distilled targets -> packed checkpoint.
# Every step resumes or skips what is already done. On a 2-core CPU it takes hours;
# set BASE_EPOCHS / HEAD_UPDATES to trade time for quality.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work}; BASE_EPOCHS=${BASE_EPOCHS:-6}; HEAD_UPDATES=${HEAD_UPDATES:-1500}; K=${K:-8}
bash scripts/setup.sh
.venv/bin/python scripts/get_bible.py
.venv/bin/python scripts/prepare_data.py --src de --tgt en --train data/bible-raw/train \
  --valid data/bible-raw/valid --test data/bible-raw/test --out data/bible-bin
scripts/train_base.sh data/bible-bin "$WORK/base" --max-epoch "$BASE_EPOCHS"
scripts/distill.sh data/bible-bin "$WORK/base/checkpoint_last.pt" data/bible-distill \
  --user-dir fairseq_bpd
scripts/train_heads.sh data/bible-distill "$WORK/base/checkpoint_last.pt" "$WORK/heads-k$K" "$K" finetune \
  --head-ffn-dim 128 --max-update "$HEAD_UPDATES"
.venv/bin/python scripts/pack_checkpoint.py pack "$WORK/heads-k$K/checkpoint_last.pt" models/demo/checkpoint.int4.pt
