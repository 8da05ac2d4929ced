#!/usr/bin/env bash
# Collect one finished §5.3 run: its records (weights are not kept) and the L0/L1.block_in
# attributions on dev documents (split "train": in-distribution pairs) and on test documents
# (split "test": held-out pairs), drawn with the examples' default seed 1, 320 documents each.
#   results/atr-split/collect.sh RUNS_DIR NAME      e.g. runs/atr-split d64-attention-lr1e-3-s0
set -euo pipefail
runs=$1; name=$2
here=$(dirname "$0")
mkdir -p "$here/$name"
cp "$runs/$name/results.csv" "$here/$name/"
for run in "$runs/$name"/*/; do
  id=$(basename "$run"); mkdir -p "$here/$name/$id"
  cp "$run"/{run.json,summary.json,mech.json,metrics.jsonl,test.json} "$here/$name/$id/"
  for split in train test; do
    hookmech patch --ckpt "$run/model.safetensors" --task-opt split=$split --n 320 --seed 1 \
      --site L0.block_in,L1.block_in --pos key,value,query,divider --json > "$here/$name/$id/mech-$split.json"
  done
done
