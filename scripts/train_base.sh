#!/usr/bin/env bash
# Recipe step 1: a plain fairseq transformer (3 layers, width 256) on DATA.
# Usage: scripts/train_base.sh DATA SAVE_DIR [fairseq-train flags...]; resumes from SAVE_DIR/checkpoint_last.pt.
set -euo pipefail
DATA=$1; SAVE=$2; shift 2
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# --user-dir only for checkpoint_safety: resuming needs the allow-listed globals under torch>=2.6.
exec "$ROOT/.venv/bin/fairseq-train" "$DATA" --user-dir "$ROOT/fairseq_bpd" \
  --arch transformer --share-all-embeddings \
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 \
  --encoder-attention-heads 4 --decoder-attention-heads 4 \
  --dropout 0.1 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 1e-3 --lr-scheduler inverse_sqrt \
  --warmup-updates 1000 --warmup-init-lr 1e-7 --clip-norm 1.0 \
  --max-tokens 4096 --required-batch-size-multiple 1 \
  --save-dir "$SAVE" --save-interval-updates 500 --keep-interval-updates 1 --no-epoch-checkpoints \
  --log-format simple --log-interval 50 --seed 1 "$@"
