#!/usr/bin/env bash
# Recipe step 3: k proposal heads on a trained base (scripts/train_base.sh).
# Usage: scripts/train_heads.sh DATA BASE_CKPT SAVE_DIR K frozen|finetune [fairseq-train flags...]
# frozen trains the heads alone (--freeze-base; the base stays in eval mode, and head 1, a
# constant, is not computed in training), at lr 2e-3 after 100 warmup updates: heads of
# about a million weights take it (scripts/recipe_chained.sh). finetune trains heads and base
# together, head 1 weighted 7 times each other head (--head1-weight 7). A later flag wins.
# Resumes from SAVE_DIR/checkpoint_last.pt when it exists. Another --lr-scheduler (such as
# polynomial_decay, to anneal a draft's last hour) replaces inverse_sqrt and its
# --warmup-init-lr (which polynomial_decay refuses; pass it again where another takes it).
set -euo pipefail
DATA=$1; BASE=$2; SAVE=$3; K=$4; MODE=$5; shift 5
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
case "$MODE" in
  frozen) MODE_FLAGS=(--freeze-base --lr 2e-3 --warmup-updates 100) ;;
  # finetune: head 1 gets half of a k=8 loss, so the base keeps its translations (docs/speed.md)
  finetune) MODE_FLAGS=(--lr 5e-4 --head1-weight 7) ;;
  *) echo "error: mode must be frozen or finetune, not '$MODE'" >&2; exit 2 ;;
esac
SCHEDULER=(--lr-scheduler inverse_sqrt --warmup-init-lr 1e-7)
for arg in "$@"; do case "$arg" in --lr-scheduler|--lr-scheduler=*) SCHEDULER=() ;; esac; done
[ -f "$BASE" ] || { echo "error: base checkpoint not found: $BASE" >&2; exit 1; }
exec "$ROOT/.venv/bin/fairseq-train" "$DATA" --user-dir "$ROOT/fairseq_bpd" \
  --task translation_blockwise --arch transformer_blockwise_small --block-size "$K" --share-all-embeddings \
  --criterion blockwise_cross_entropy --label-smoothing 0.1 --finetune-from-model "$BASE" \
  --optimizer adam --adam-betas '(0.9, 0.98)' "${SCHEDULER[@]}" \
  --warmup-updates 200 --clip-norm 1.0 --max-tokens 4096 \
  --save-dir "$SAVE" --save-interval-updates 250 --keep-interval-updates 1 --no-epoch-checkpoints \
  --log-format simple --log-interval 50 --seed 1 "${MODE_FLAGS[@]}" "$@"
