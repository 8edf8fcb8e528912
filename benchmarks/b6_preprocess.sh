#!/usr/bin/env bash
# B6: `meshtron preprocess` vs Megatron-LM's tools/preprocess_data.py, same corpus, tokenizer and workers.
#
#   bash benchmarks/b6_preprocess.sh [WORK_DIR] [RUNS]
#
# WORK_DIR (default /tmp/b6) receives the corpus (benchmarks/b6_corpus.py: ~60 MB jsonl of Python
# source), a GPT-2-size byte-level BPE as vocab.json/merges.txt in WORK_DIR/gpt2, and a Megatron-LM
# checkout exported from MEGATRON_GIT (a git dir; default the `fetch` mirror) with two changes for a
# CPU-only Python 3.11 machine: `typing.override` imported from typing_extensions (Python 3.12 API),
# and triton (imported by Megatron's Triton kernels on the import path; no kernel runs) installed
# with pip into WORK_DIR/pydeps, put on PYTHONPATH for Megatron only. Megatron's GPT2BPETokenizer
# loads `AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...)`; run from WORK_DIR,
# "gpt2" is the local folder, so nothing is downloaded. Runs alternate A/B RUNS times (default 3),
# each pair's outputs are compared byte for byte, and wall clock includes start-up on both sides.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/b6}
RUNS=${2:-3}
WORKERS=${WORKERS:-2}
MEGATRON_GIT=${MEGATRON_GIT:-/work/.mirror/NVIDIA+Megatron-LM/repo}
mkdir -p "$WORK/out"
python "$REPO/benchmarks/b6_corpus.py" --out "$WORK"

if [ ! -d "$WORK/megatron-lm" ]; then
  mkdir "$WORK/megatron-lm"
  git --git-dir="$MEGATRON_GIT" archive HEAD megatron tools | tar -x -C "$WORK/megatron-lm"
  for f in megatron/training/models/gpt.py megatron/training/models/hybrid.py; do
    sed -i -E 's/^from typing import (.*), override$/from typing import \1\nfrom typing_extensions import override/' "$WORK/megatron-lm/$f"
  done
fi
if ! python -c "import triton" 2>/dev/null && [ ! -d "$WORK/pydeps/triton" ]; then
  TRITON=$(python -c "import importlib.metadata as m; print(next(r.split('==')[1].split(';')[0].strip() for r in m.requires('torch') if r.startswith('triton==')))" 2>/dev/null || echo "")
  pip install -q --no-deps --target "$WORK/pydeps" "triton${TRITON:+==$TRITON}"
fi

cd "$WORK"
TOK=(--tokenizer-type GPT2BPETokenizer --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt --append-eod --workers "$WORKERS")
seconds() { local t0 t1; t0=$(date +%s.%N); "$@" > out/last.log 2>&1 || { cat out/last.log; exit 1; }; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }
echo "commit $(git -C "$REPO" rev-parse --short HEAD), Megatron-LM $(git --git-dir="$MEGATRON_GIT" rev-parse --short HEAD), $(nproc) CPUs: $(lscpu | sed -n 's/^Model name: *//p')"
echo "corpus $(( $(stat -c %s python_src.jsonl) / 1000000 )) MB, $(wc -l < python_src.jsonl) documents, workers $WORKERS"
RATIOS=()
for run in $(seq "$RUNS"); do
  MEG=$(seconds env PYTHONPATH="$WORK/pydeps" HF_HUB_OFFLINE=1 python megatron-lm/tools/preprocess_data.py --input python_src.jsonl --output-prefix out/meg "${TOK[@]}")
  MESH=$(seconds env PYTHONPATH="$REPO" python -m meshtron preprocess --input python_src.jsonl --output-prefix out/mesh "${TOK[@]}")
  TOKENS=$(sed -n 's/.* documents, \([0-9]*\) tokens.*/\1/p' out/last.log)
  cmp -s out/meg_text_document.bin out/mesh_text_document.bin && cmp -s out/meg_text_document.idx out/mesh_text_document.idx && SAME=yes || SAME=NO
  RATIO=$(echo "scale=2; $MEG / $MESH" | bc)
  RATIOS+=("$RATIO")
  printf "run %d: Megatron %6.2f s (%9.0f tokens/s)  meshtron %6.2f s (%9.0f tokens/s)  ratio %5.2fx  identical: %s\n" \
    "$run" "$MEG" "$(echo "$TOKENS / $MEG" | bc)" "$MESH" "$(echo "$TOKENS / $MESH" | bc)" "$RATIO" "$SAME"
done
echo "tokens $TOKENS; median ratio $(printf '%s\n' "${RATIOS[@]}" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')x"
