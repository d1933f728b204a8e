#!/usr/bin/env bash
# Chained heads (--head-type chained, k=8) on a trained model's frozen base, on a CPU:
# its translations stay exactly as they are; only the heads are new.
#   1. source text: the corpus's training sources and the Schlachter 1951 Bible
#      (scripts/get_source_text.py; the valid and test books left out), each sentence once;
#   2. the base's own greedy output for them (scripts/self_distill.sh, exact width-1 decoding);
#   3. about one pair in 57 held out as the validation split (scripts/hold_out.py), so the
#      log's `block` is an estimate on sources the heads never saw;
#   4. the base's features of those pairs, stored once (scripts/store_features.py, into FEATURES);
#   5. the heads, trained frozen on them in the background-friendly way (--stored-features):
#      resumable from SAVE/checkpoint_last.pt, stopping by itself after HOURS of training.
# Usage: [BASE=work/demo/checkpoint.pt] [SOURCES=N] [HOURS=1.5] [FEATURES=work/features]
#        scripts/recipe_chained.sh [fairseq-train flags...]
# SOURCES=N distils only the first N sources (a CPU budget). Every step skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work}; BASE=${BASE:-$WORK/demo/checkpoint.pt}; HOURS=${HOURS:-1.5}; SOURCES=${SOURCES:-}
DISTILL=$WORK/distill; PAIRS=$DISTILL/all; DATA=$WORK/heads-data/all; SAVE=${SAVE:-$WORK/heads-chained}
FEATURES=${FEATURES:-$WORK/features}
[ -f "$BASE" ] || { echo "error: base checkpoint not found: $BASE (the shipped one: scripts/pack_checkpoint.py unpack models/demo/checkpoint.int4.pt $WORK/demo/checkpoint.pt)" >&2; exit 1; }
mkdir -p "$DISTILL"
[ -s "$DISTILL/schlachter.de.bpe" ] || .venv/bin/python scripts/get_source_text.py "$DISTILL/schlachter.de" --codes data/bible-bin/bpe.codes
cat data/bible-bin/text/train.bpe.de "$DISTILL/schlachter.de.bpe" | awk '!seen[$0]++' \
  | { if [ -n "$SOURCES" ]; then head -n "$SOURCES"; else cat; fi; } > "$DISTILL/all.bpe.de.new"
if [ -f "$PAIRS/train.de-en.en.bin" ] && cmp -s "$DISTILL/all.bpe.de.new" "$DISTILL/all.bpe.de"; then
  rm "$DISTILL/all.bpe.de.new"
else
  mv "$DISTILL/all.bpe.de.new" "$DISTILL/all.bpe.de"
  scripts/self_distill.sh data/bible-bin "$BASE" "$DISTILL/all.bpe.de" "$PAIRS" \
    --task translation_blockwise --blockwise --block-size 1
fi
.venv/bin/python scripts/hold_out.py "$PAIRS" "$DATA" --data data/bible-bin
# bfloat16 head projections only where the machine computes them natively: elsewhere torch
# falls back to a reference matrix product many times slower than float32.
BF16=$(.venv/bin/python -c "from fairseq_bpd.speedup_steps import bf16_is_fast; print('--head-loss-bf16 --heads-bf16' if bf16_is_fast(cpu=False) else '')")
.venv/bin/python scripts/store_features.py "$DATA" "$BASE" "$FEATURES"  # kept where made already
scripts/train_heads.sh "$DATA" "$BASE" "$SAVE" 8 frozen --head-type chained --head-vocab 2000 \
  --head-ffn-dim 128 $BF16 --max-tokens 4096 --validate-interval-updates 250 --stored-features "$FEATURES" \
  --stop-time-hours "$HOURS" "$@"
