#!/usr/bin/env bash
# The recipe behind models/demo/'s base: corpus -> base transformer -> greedy
# self-distillation of 8,000 training sources -> 8 independent proposal heads fine-tuned
# with the base on those targets -> packed checkpoint. The defaults are the commands and
# update counts that made the base (models/demo/manifest.json): about 5 minutes of
# training on one H200; on a 2-core CPU the same updates take many hours, so lower
# BASE_UPDATES / HEAD_UPDATES to trade quality for time. The shipped heads are chained
# heads trained on that base, frozen, by scripts/recipe_chained.sh (BASE= the unpacked
# checkpoint this script packs). Every step resumes or skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work}; K=${K:-8}
BASE_UPDATES=${BASE_UPDATES:-2423}; DISTILL_SENTENCES=${DISTILL_SENTENCES:-8000}; HEAD_UPDATES=${HEAD_UPDATES:-1675}
bash scripts/setup.sh
.venv/bin/python scripts/get_bible.py
.venv/bin/python scripts/prepare_data.py --src de --tgt en --train data/bible-raw/train \
  --valid data/bible-raw/valid --test data/bible-raw/test --out data/bible-bin
scripts/train_base.sh data/bible-bin "$WORK/base" --max-tokens 16384 --warmup-updates 400 \
  --max-update "$BASE_UPDATES"
SENTENCES=$DISTILL_SENTENCES scripts/distill.sh data/bible-bin "$WORK/base/checkpoint_last.pt" \
  data/bible-distill --user-dir fairseq_bpd --beam 1 --max-tokens 32000
scripts/train_heads.sh data/bible-distill "$WORK/base/checkpoint_last.pt" "$WORK/heads-k$K" "$K" finetune \
  --head-ffn-dim 128 --head-vocab 2000 --max-tokens 16384 --max-update "$HEAD_UPDATES"
.venv/bin/python scripts/pack_checkpoint.py pack "$WORK/heads-k$K/checkpoint_last.pt" models/demo/checkpoint.int4.pt
