#!/usr/bin/env bash
# Greedy self-distillation: translate a monolingual source file with the
# base's own greedy search (--beam 1) and binarise the pairs, with DATA's dictionaries,
# as split SPLIT of OUT. With a frozen base (--head-layout base --freeze-base) head 1
# IS the base, so head i trained on these targets learns exactly what verification
# accepts: the base's greedy token i-1 steps ahead. Any German text serves as SOURCE
# (scripts/get_source_text.py writes the Schlachter 1951 Bible, valid/test books left out).
# Usage: [SRC=de TGT=en] [SPLIT=train] scripts/self_distill.sh DATA BASE_CKPT SOURCE OUT [fairseq-generate flags...]
# SOURCE: one sentence a line, tokenised and BPE'd with DATA's codes (as DATA/text/*.bpe.de).
# Splits OUT lacks among valid/test are linked from DATA (human references, for BLEU).
# Flags go to fairseq-generate: e.g. --task translation_blockwise --blockwise on a checkpoint
# with heads gives the same output in fewer decoder passes.
set -euo pipefail
[ $# -ge 4 ] || { echo "usage: scripts/self_distill.sh DATA BASE_CKPT SOURCE OUT [fairseq-generate flags...]" >&2; exit 2; }
DATA=$1; CKPT=$2; SOURCE=$3; OUT=$4; shift 4
ROOT="$(cd "$(dirname "$0")/.." && pwd)"; BIN="$ROOT/.venv/bin"
SRC=${SRC:-de}; TGT=${TGT:-en}; SPLIT=${SPLIT:-train}
case "$SPLIT" in train|valid|test) ;; *) echo "error: SPLIT must be train, valid or test, not '$SPLIT'" >&2; exit 2 ;; esac
[ -f "$DATA/dict.$SRC.txt" ] && [ -f "$DATA/dict.$TGT.txt" ] || {
  echo "error: $DATA has no dict.$SRC.txt / dict.$TGT.txt; set SRC= and TGT= to its languages" >&2; exit 1; }
for f in "$CKPT" "$SOURCE"; do [ -f "$f" ] || { echo "error: not found: $f" >&2; exit 1; }; done
[ -s "$SOURCE" ] || { echo "error: SOURCE $SOURCE is empty" >&2; exit 1; }
blank=$(grep -n -m1 -v '[^[:space:]]' "$SOURCE" | cut -d: -f1 || true)
[ -z "$blank" ] || { echo "error: SOURCE $SOURCE: line $blank is blank (one sentence a line)" >&2; exit 1; }
mkdir -p "$OUT/text"
WORK="$OUT/$SPLIT-source"; rm -rf "$WORK"; mkdir -p "$WORK"
cp "$SOURCE" "$WORK/input.$SRC"
"$BIN/fairseq-preprocess" --only-source --source-lang "$SRC" --target-lang "$TGT" --trainpref "$WORK/input" \
  --srcdict "$DATA/dict.$SRC.txt" --destdir "$WORK" --workers 2 > "$WORK/preprocess.log" 2>&1
cp "$DATA/dict.$TGT.txt" "$WORK/"
"$BIN/fairseq-generate" "$WORK" --path "$CKPT" --user-dir "$ROOT/fairseq_bpd" --gen-subset train \
  --source-lang "$SRC" --target-lang "$TGT" --beam 1 --max-len-a 1.2 --max-len-b 10 --max-tokens 8000 \
  --required-batch-size-multiple 1 "$@" > "$WORK/generate.txt" 2> "$WORK/generate.log" || {
  tail -n 5 "$WORK/generate.log" >&2; echo "error: fairseq-generate failed (log: $WORK/generate.log)" >&2; exit 1; }
# H-<id> lines in id order are the targets (still BPE'd, as fairseq saw them).
grep '^H-' "$WORK/generate.txt" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$WORK/output.$TGT"
want=$(wc -l < "$SOURCE"); got=$(wc -l < "$WORK/output.$TGT")
[ "$want" = "$got" ] || { echo "error: $got greedy translations for $want sources (see $WORK/generate.log)" >&2; exit 1; }
cp "$SOURCE" "$OUT/text/$SPLIT.bpe.$SRC"; mv "$WORK/output.$TGT" "$OUT/text/$SPLIT.bpe.$TGT"
rm -f "$OUT"/dict.*.txt
"$BIN/fairseq-preprocess" --source-lang "$SRC" --target-lang "$TGT" --"$SPLIT"pref "$OUT/text/$SPLIT.bpe" \
  --srcdict "$DATA/dict.$SRC.txt" --tgtdict "$DATA/dict.$TGT.txt" --destdir "$OUT" --workers 2 > "$OUT/preprocess-$SPLIT.log" 2>&1
for split in valid test; do
  for l in "$SRC" "$TGT"; do for ext in bin idx; do
    f="$split.$SRC-$TGT.$l.$ext"
    [ -e "$OUT/$f" ] || [ ! -e "$DATA/$f" ] || ln -s "$(realpath "$DATA/$f")" "$OUT/$f"
  done; done
done
[ -e "$OUT/raw" ] || [ ! -e "$DATA/raw" ] || ln -s "$(realpath "$DATA/raw")" "$OUT/raw"
mv "$WORK/generate.log" "$OUT/generate-$SPLIT.log"; rm -rf "$WORK"
echo "$got greedy pairs in $OUT ($SPLIT)"
