#!/usr/bin/env bash
# The draft decoder (--head-type draft, k=8) on a trained model's frozen base, on a CPU: one
# decoder layer that reads the base's features, the next token and the source drafts heads
# 2..8 step by step; the base's translations stay exactly as they are.
# Trains on the base's own greedy output: the self-distilled pairs and their held-out
# validation split that scripts/recipe_chained.sh makes (steps 1-3) in DATA. Resumable from
# SAVE/checkpoint_last.pt; stops by itself after HOURS of training (fairseq's --stop-time-hours).
# Batch, learning rate and warmup are the chained heads' (scripts/train_heads.sh frozen).
# Training unrolls the draft's first 3 steps (--draft-train-heads 4), decoding all 7: a
# step's self-attention reads every step before it, so 3 steps cost less than half of 7
# an update, and the later steps run the same layer (docs/draft.md measures both).
# FULL_HOURS=H then goes on from that draft for H more hours with its loss over the whole
# dictionary (--head-vocab 0, lr 5e-4) in SAVE-full: the draft learns the rarer tokens that
# a proposal lexicon (scripts/proposal_lexicon.py) lets it propose past its shortlist. Its
# checkpoints decode over the whole dictionary: pack with --head-vocab 2000
# (scripts/pack_checkpoint.py), or decode with --blockwise-proposal-vocab 2000, for the
# shortlist and the lexicon. FULL_UPDATES=N anneals that step (fairseq's polynomial_decay):
# its learning rate warms up as before (train_heads.sh's 100 updates), then falls linearly to
# zero at update N, where it stops (FULL_HOURS still caps it); a draft gains a little from
# ending at rate zero (docs/draft.md). A resumed second step keeps that schedule only when
# given the same FULL_UPDATES. The flags given go to both steps, before the second's own.
# The frozen base's features are computed once, before training, into FEATURES
# (scripts/store_features.py: about 3.6 GB for the 57,000 self-distilled pairs), and every
# update reads them instead of running the base (--stored-features); the draft's own
# products run in bfloat16 where the machine has it (--heads-bf16, --head-loss-bf16).
# Usage: [BASE=work/demo/checkpoint.pt] [DATA=work/heads-data/all] [SAVE=work/heads-draft] [HOURS=1]
#        [FULL_HOURS=0] [FULL_UPDATES=] [FEATURES=work/features] scripts/recipe_draft.sh [fairseq-train flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work}; BASE=${BASE:-$WORK/demo/checkpoint.pt}; DATA=${DATA:-$WORK/heads-data/all}
SAVE=${SAVE:-$WORK/heads-draft}; SAVE=${SAVE%/}; HOURS=${HOURS:-1}; FULL_HOURS=${FULL_HOURS:-0}
FEATURES=${FEATURES:-$WORK/features}; FULL_UPDATES=${FULL_UPDATES:-}
# fairseq reads --stop-time-hours 0 as no limit: refuse what is not a positive number of hours.
positive() { awk -v h="$1" 'BEGIN { exit !(h ~ /^[0-9]*\.?[0-9]+$/ && h + 0 > 0) }'; }
positive "$HOURS" || { echo "error: HOURS must be a positive number of hours, not '$HOURS'" >&2; exit 2; }
positive "$FULL_HOURS" || awk -v h="$FULL_HOURS" 'BEGIN { exit !(h ~ /^0*\.?0*$/) }' \
  || { echo "error: FULL_HOURS must be 0 (no second step) or a positive number of hours, not '$FULL_HOURS'" >&2; exit 2; }
[[ -z "$FULL_UPDATES" || "$FULL_UPDATES" =~ ^[1-9][0-9]*$ ]] \
  || { echo "error: FULL_UPDATES must be a positive number of updates, not '$FULL_UPDATES'" >&2; exit 2; }
if [ -n "$FULL_UPDATES" ]; then
  positive "$FULL_HOURS" || { echo "error: FULL_UPDATES anneals the second step, and FULL_HOURS=$FULL_HOURS runs none" >&2; exit 2; }
  # The first step's inverse_sqrt takes it and polynomial_decay does not: refused before the first step trains.
  for arg in "$@"; do case "$arg" in --warmup-init-lr|--warmup-init-lr=*)
    echo "error: $arg does not combine with FULL_UPDATES (the second step's polynomial_decay has none)" >&2; exit 2 ;;
  esac; done
fi
[ -f "$DATA/train.de-en.en.bin" ] || { echo "error: no self-distilled pairs in $DATA: scripts/recipe_chained.sh makes them" >&2; exit 1; }
# bfloat16 head projections only where the machine computes them natively: elsewhere torch
# falls back to a reference matrix product many times slower than float32.
BF16=$(.venv/bin/python -c "from fairseq_bpd.speedup_steps import bf16_is_fast; print('--head-loss-bf16 --heads-bf16' if bf16_is_fast(cpu=False) else '')")
# Kept where FEATURES holds this base's already (a few minutes otherwise).
.venv/bin/python scripts/store_features.py "$DATA" "$BASE" "$FEATURES"
DRAFT=(--head-type draft --draft-train-heads 4 $BF16 --max-tokens 4096 --validate-interval-updates 250
       --stored-features "$FEATURES")
# Not exec'd: the whole-dictionary step may follow.
scripts/train_heads.sh "$DATA" "$BASE" "$SAVE" 8 frozen "${DRAFT[@]}" --head-vocab 2000 --stop-time-hours "$HOURS" "$@"
positive "$FULL_HOURS" || exit 0
# It starts from the draft above (fairseq's --finetune-from-model reads every weight, the
# base's and the draft's), at a quarter of the learning rate, on a clock of its own: the
# checkpoint's training time would count towards its --stop-time-hours, so it starts from a
# copy without it. Once SAVE-full has a checkpoint_last.pt, fairseq resumes that instead.
START=$SAVE-full/start.pt
if [ ! -f "$SAVE-full/checkpoint_last.pt" ]; then
  mkdir -p "$SAVE-full"
  .venv/bin/python -c "import sys, torch, fairseq_bpd
state = torch.load(sys.argv[1], map_location='cpu')
state.get('extra_state', {}).pop('previous_training_time', None)
torch.save(state, sys.argv[2])" "$SAVE/checkpoint_last.pt" "$START"
fi
ANNEAL=()
[ -z "$FULL_UPDATES" ] || ANNEAL=(--lr-scheduler polynomial_decay --end-learning-rate 0
  --total-num-update "$FULL_UPDATES" --max-update "$FULL_UPDATES")
scripts/train_heads.sh "$DATA" "$START" "$SAVE-full" 8 frozen "${DRAFT[@]}" "$@" --head-vocab 0 \
  --lr 5e-4 "${ANNEAL[@]}" --stop-time-hours "$FULL_HOURS"
