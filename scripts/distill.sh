#!/usr/bin/env bash
# Recipe step 2, sequence-level distillation: translate the training source with the
# base model's beam search (the paper: beam 4, length penalty 0.6) and binarise the
# output, with the same dictionary, as the new training targets.
# Usage: [SRC=de TGT=en] [SENTENCES=N] scripts/distill.sh DATA BASE_CKPT OUT [fairseq-generate flags...]
# SENTENCES=N distils only the first N training pairs (a CPU budget); OUT's train set is then those N.
# OUT must be another folder than DATA (its train text and dictionaries are rewritten).
# A rerun reuses OUT's targets only if OUT/.distilled, a hash of what they came from (the
# checkpoint, the source text, the dictionaries, SRC, TGT, SENTENCES and the flags), still
# matches; otherwise it distils again. Every run checks that each target is paired with
# the source it was translated from, and the pair count of what it binarises.
set -euo pipefail
DATA=$1; CKPT=$2; OUT=$3; shift 3
SENTENCES=${SENTENCES:-}
HERE="$(dirname "$0")"
BIN="$HERE/../.venv/bin"
# SRC/TGT name the languages (default: de and en, the default corpus).
SRC=${SRC:-de}; TGT=${TGT:-en}
[ -f "$DATA/dict.$SRC.txt" ] && [ -f "$DATA/dict.$TGT.txt" ] || {
  echo "error: $DATA has no dict.$SRC.txt / dict.$TGT.txt; set SRC= and TGT= to its languages" >&2; exit 1; }
for f in "$CKPT" "$DATA/text/train.bpe.$SRC"; do [ -f "$f" ] || { echo "error: not found: $f" >&2; exit 1; }; done
# head -n 0 gives an empty train set, head -n -N all but the last N lines.
[[ -z "$SENTENCES" || "$SENTENCES" =~ ^[1-9][0-9]*$ ]] || {
  echo "error: SENTENCES=$SENTENCES: give a number of training pairs, 1 or more" >&2; exit 1; }
# OUT's train text, dictionaries and stamp would overwrite DATA's own (the human targets).
for d in "$OUT" "$OUT/subset"; do
  [ "$(realpath -m "$d")" != "$(realpath -m "$DATA")" ] || {
    echo "error: OUT $OUT would overwrite the corpus DATA $DATA: give another folder" >&2; exit 1; }
done
# OUT/raw is to link to DATA's references; ln -sfn would put the link inside a folder there.
[ ! -e "$OUT/raw" ] || [ -L "$OUT/raw" ] || {
  echo "error: $OUT/raw is a folder of references of its own (OUT made by prepare_data.py?):" \
    "give another OUT" >&2; exit 1; }
stamp=$( { echo "$SRC $TGT ${SENTENCES:-all}"; printf '%s\n' "$@"
  for f in "$CKPT" "$DATA/text/train.bpe.$SRC" "$DATA/dict.$SRC.txt" "$DATA/dict.$TGT.txt"; do sha256sum < "$f"; done
} | sha256sum | cut -d' ' -f1)
mkdir -p "$OUT/text"
SOURCE="$DATA"
if [ -n "$SENTENCES" ]; then
  # a train split of the first N pairs, binarised with the same dictionary
  SOURCE="$OUT/subset"; mkdir -p "$SOURCE"
  for l in "$SRC" "$TGT"; do head -n "$SENTENCES" "$DATA/text/train.bpe.$l" > "$SOURCE/train.bpe.$l"; done
  "$BIN/fairseq-preprocess" --source-lang "$SRC" --target-lang "$TGT" --trainpref "$SOURCE/train.bpe" \
    --srcdict "$DATA/dict.$SRC.txt" --tgtdict "$DATA/dict.$TGT.txt" --destdir "$SOURCE" --workers 2 > /dev/null
  mkdir -p "$SOURCE/text"; mv "$SOURCE"/train.bpe.* "$SOURCE/text/"
fi
# Translate unless OUT holds the output of a run on the same inputs (delete it to force one).
if [ "$(cat "$OUT/.distilled" 2>/dev/null)" != "$stamp" ] || [ ! -f "$OUT/generate-train.txt" ]; then
  [ ! -e "$OUT/generate-train.txt" ] || echo "$OUT was distilled from other inputs (checkpoint, source" \
    "text, dictionaries, SRC/TGT, SENTENCES or flags): distilling again" >&2
  rm -f "$OUT/.distilled" "$OUT/generate-train.txt" "$OUT/text/train.bpe.$TGT"
  "$BIN/fairseq-generate" "$SOURCE" --path "$CKPT" --gen-subset train --source-lang "$SRC" --target-lang "$TGT" \
    --beam 4 --lenpen 0.6 --max-len-a 1.2 --max-len-b 10 --max-tokens 8000 --required-batch-size-multiple 1 "$@" \
    > "$OUT/generate-train.txt.tmp"
  mv "$OUT/generate-train.txt.tmp" "$OUT/generate-train.txt"
fi
# H-<id> lines in id order are the distilled targets (still BPE'd, as fairseq saw them).
"$BIN/python" "$HERE/distill_targets.py" extract "$OUT/generate-train.txt" "$SOURCE/text/train.bpe.$SRC" \
  "$OUT/text/train.bpe.$TGT"
echo "$stamp" > "$OUT/.distilled"
cp "$SOURCE/text/train.bpe.$SRC" "$OUT/text/train.bpe.$SRC"
rm -f "$OUT"/dict.*.txt
"$BIN/fairseq-preprocess" --source-lang "$SRC" --target-lang "$TGT" \
  --trainpref "$OUT/text/train.bpe" --validpref "$DATA/text/valid.bpe" --testpref "$DATA/text/test.bpe" \
  --srcdict "$DATA/dict.$SRC.txt" --tgtdict "$DATA/dict.$TGT.txt" --destdir "$OUT" --workers 2 > "$OUT/preprocess.log"
"$BIN/python" "$HERE/distill_targets.py" count "$OUT/train" "$SRC" "$TGT"
# valid/test keep the human references, for BLEU.
ln -sfn "$(realpath "$DATA/raw")" "$OUT/raw"
echo "distilled data in $OUT: $(wc -l < "$OUT/text/train.bpe.$SRC") pairs"
