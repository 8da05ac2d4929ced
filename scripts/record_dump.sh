#!/usr/bin/env bash
# Write every kind of record hookmech makes into one folder, so that two checkouts can be compared
# byte for byte (`diff -r` of two dumps): a refactor that claims to change no number runs this on
# the old and the new code and shows the folders equal.
#
#   scripts/record_dump.sh OUT [HOOKMECH]     # HOOKMECH: the command to run (default: hookmech)
#   diff -r OUT_OLD OUT_NEW && echo identical
#
# Covers, on the attention and Mamba CPU fixtures and on two small models trained here (GLA and
# Based, a few steps each: the `train` checkpoints are records too): `sites`; `patch` at every site
# kind (embed, block, mixer, mlp, inside hooks such as L0.mixer.q, a head, ssm/kv state), zero /
# mean / resample ablations, noising, the four metrics; AtP; AtP* with and without --graddrop and
# with --verify-top; path patching of every kind (resid, head, state, conv); `cache` and patching
# from it; a small `das`; `view` of a checkpoint. Each command's stdout, and every file it writes,
# lands under OUT; `commands.txt` lists them (one a line) and counts them.
set -euo pipefail
OUT=${1:?usage: scripts/record_dump.sh OUT [HOOKMECH]}
HM=${2:-hookmech}
REPO=$(cd "$(dirname "$0")/.." && pwd)
ATT=$REPO/fixtures/attention_ar_cpu.safetensors
MAMBA=$REPO/fixtures/mamba_ar_cpu.safetensors
mkdir -p "$OUT"
: > "$OUT/commands.txt"
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1
N=0

# run NAME ARGS...: run one hookmech command, its stdout into OUT/NAME.out (stderr into NAME.err,
# with the output folder's path written as OUT so that two dumps in two folders compare equal, and
# the exit status last)
run() {
    local name=$1
    shift
    N=$((N + 1))
    echo "$name: ${*//$OUT/OUT}" >> "$OUT/commands.txt"
    local rc=0
    $HM "$@" > "$OUT/$name.out" 2> "$OUT/$name.err.raw" || rc=$?
    echo "exit $rc" >> "$OUT/$name.err.raw"
    [ "$rc" = 0 ] || echo "FAILED ($rc): $name" >&2
    sed -e "s#$OUT#OUT#g" -e "s#$REPO#REPO#g" "$OUT/$name.err.raw" > "$OUT/$name.err"
    rm "$OUT/$name.err.raw"
}

P="--n 48 --seed 1 --threads 1 --json"
# the two models trained here are barely trained: keep every row (no p_clean - p_corrupt filter)
Q="$P --threshold -1"

# --- train: two small models of other mixers, with a checkpoint half-way (checkpoints are records)
TRAIN="--task-opt vocab_size=32 --task-opt num_kv_pairs=4 --steps 40 --n-train 640 --n-dev 32 --batch-size 16 --eval-every 8 --ckpt-every 8 --seed 0 --threads 1"
run train_gla train --mixer gla --n-heads 2 $TRAIN -o "$OUT/train_gla"
run train_based train --mixer based $TRAIN -o "$OUT/train_based"
GLA=$OUT/train_gla/model.safetensors
BASED=$OUT/train_based/model.safetensors
# the training log and summary record wall-clock seconds; the rest of each folder is compared whole
for f in "$OUT"/train_*/metrics.jsonl "$OUT"/train_*/summary.json; do
    python3 - "$f" <<'EOF'
import json, sys
path = sys.argv[1]
text = open(path).read()
rows = [json.loads(line) for line in text.splitlines()] if path.endswith(".jsonl") else [json.loads(text)]
for row in rows:
    row.pop("seconds", None)
open(path, "w").write("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
EOF
done

# --- sites (every hook of each model)
run sites_att sites --ckpt "$ATT"
run sites_mamba sites --ckpt "$MAMBA"
run sites_gla sites --ckpt "$GLA"
run sites_based sites --ckpt "$BASED"

# --- node patching, exact, at every site kind
run att_blocks patch --ckpt "$ATT" --site embed,pos_embed,L0.block_in,L1.block_in,L0.block_out,final_norm --pos key,value,query $P -o "$OUT/att_blocks.png" --per-example "$OUT/att_blocks.per_example.json"
run att_mixer_mlp patch --ckpt "$ATT" --site 'L*.mixer_in,L*.mixer_out,L*.resid_mid,L*.mlp_in,L*.mlp_out' --pos key,value,query,whole $P
run att_inside patch --ckpt "$ATT" --site 'L0.mixer.q,L0.mixer.k,L0.mixer.v,L1.mixer.z,L1.mixer.attn_scores,L1.mixer.pattern' --pos key,value,query $P
run att_heads patch --ckpt "$ATT" --site 'L1.mixer.z[0],L0.mixer.q[*]' --pos all $P
run att_all patch --ckpt "$ATT" --site all --pos key+value,2 --n 48 --seed 1 --threads 1 --csv
run att_metrics_logit patch --ckpt "$ATT" --site L1.block_in --pos key,value --metric logit_diff $P
run att_metrics_kl patch --ckpt "$ATT" --site L1.block_in --pos key,value --metric kl $P
run att_metrics_logp patch --ckpt "$ATT" --site L1.block_in --pos key,value --metric log_p --direction noise $P
run att_ablate_zero patch --ckpt "$ATT" --site L0.mixer_out,L1.mixer.v --pos key,value --ablate zero $P
run att_ablate_mean patch --ckpt "$ATT" --site L0.mixer_out,L1.mixer.v --pos key,value --ablate mean $P
run att_ablate_resample patch --ckpt "$ATT" --site L0.mixer_out --pos key,value --ablate resample --ablate-seed 3 $P
run att_corrupt_value patch --ckpt "$ATT" --site L1.block_in --pos key,value --corrupt value $P
run mamba_blocks patch --ckpt "$MAMBA" --site 'embed,L*.block_in,L*.mixer_in,L*.mixer_out,L*.block_out,final_norm' --pos key,value,query,whole $P
run mamba_inside patch --ckpt "$MAMBA" --site 'L0.mixer.in_x,L0.mixer.gate,L0.mixer.conv,L1.mixer.conv_act,L1.mixer.delta,L1.mixer.B,L1.mixer.C,L1.mixer.y' --pos key,value,query $P
run mamba_state patch --ckpt "$MAMBA" --site 'L0.mixer.ssm_state,L1.mixer.ssm_state' --pos key,value,query,all $P
run gla_all patch --ckpt "$GLA" --site all --pos key,value,query $Q
run gla_heads patch --ckpt "$GLA" --site 'L1.mixer.*[*]' --pos key,query $Q
run based_all patch --ckpt "$BASED" --site all --pos key,value,query $Q
run based_ablate patch --ckpt "$BASED" --site 'L0.mixer.*' --pos key --ablate mean $Q

# --- AtP and AtP*
run att_atp patch --ckpt "$ATT" --site all --pos key,value,query --method atp $P
run att_atp_verify patch --ckpt "$ATT" --site all --pos key,value,query --method atp --verify-top 3 $P
run att_atpstar patch --ckpt "$ATT" --site all --pos key,value,query --method atp-star $P
run att_atpstar_gd patch --ckpt "$ATT" --site all --pos key,value,query --method atp-star --graddrop --verify-top 3 $P
run att_atpstar_inside patch --ckpt "$ATT" --site 'L*.mixer.q,L*.mixer.k,L*.mixer.v,L*.mixer.attn_scores,L*.mixer.pattern,L*.mixer.z' --pos all --method atp-star $P
run att_atp_inside patch --ckpt "$ATT" --site 'L*.mixer.*' --pos key,value,query --method atp $P
run mamba_atpstar_inside patch --ckpt "$MAMBA" --site 'L*.mixer.*' --pos key,value,query --method atp-star $P
run mamba_atp patch --ckpt "$MAMBA" --site all --pos key,value,query --method atp $P
run mamba_atpstar patch --ckpt "$MAMBA" --site all --pos key,value,query --method atp-star $P
run mamba_atpstar_gd patch --ckpt "$MAMBA" --site all --pos key,value,query --method atp-star --graddrop --verify-top 3 $P
run gla_atp patch --ckpt "$GLA" --site all --pos key,value,query --method atp $Q
run gla_atpstar_gd patch --ckpt "$GLA" --site all --pos key,value,query --method atp-star --graddrop $Q
run based_atpstar_gd patch --ckpt "$BASED" --site all --pos key,value,query --method atp-star --graddrop $Q

# --- path patching: every kind
run path_resid patch --ckpt "$ATT" --sender L0.block_in@key,L0.mixer_out@key,L0.mlp_out@key --receiver L1.block_in@key --via resid $P
run path_resid_all patch --ckpt "$MAMBA" --sender L0.block_out@all --receiver L1.block_in@all --via resid $P
run path_head patch --ckpt "$ATT" --sender 'L0.mixer.z[0]@value' --receiver L1.mixer.q@query,L1.mixer.k@value,L1.mixer.v@value --via head $P
run path_head_based patch --ckpt "$BASED" --sender 'L0.mixer.y@value' --receiver L1.mixer.q@query,L1.mixer.k@value --via head $Q
run path_state patch --ckpt "$MAMBA" --sender L1.mixer.ssm_state@key,L1.mixer.ssm_state@whole --receiver L1.mixer.ssm_state@query --via state $P
run path_state_based patch --ckpt "$BASED" --sender L1.mixer.kv_state@key,L1.mixer.kv_state@whole --receiver L1.mixer.kv_state@query --via state $Q
run path_state_gla patch --ckpt "$GLA" --sender L1.mixer.state@key --receiver L1.mixer.state@query --via state $Q
run path_conv patch --ckpt "$MAMBA" --sender L1.mixer.in_x@key --receiver L1.mixer.conv@key,L1.mixer.conv@whole --via conv $P
run path_conv_own patch --ckpt "$MAMBA" --sender L0.mixer.conv@value --receiver L0.mixer.conv@value,L0.mixer.conv@query --via conv $P

# --- cache, and patching and DAS from it
run cache_att cache --ckpt "$ATT" --n 48 --seed 1 --threads 1 -o "$OUT/att.h5"
run cache_mamba cache --ckpt "$MAMBA" --n 48 --seed 1 --threads 1 --sites all --dtype float16 --compression gzip -o "$OUT/mamba.h5"
run cache_gla cache --ckpt "$GLA" --n 48 --seed 1 --threads 1 -o "$OUT/gla.h5"
run att_from_cache patch --ckpt "$ATT" --cache "$OUT/att.h5" --site 'L*.block_in,L*.block_out' --pos key,value,query --threads 1 --json --memory 1
run mamba_from_cache patch --ckpt "$MAMBA" --cache "$OUT/mamba.h5" --site all --pos key,value --method atp --threads 1 --json
run das_att das --ckpt "$ATT" --cache "$OUT/att.h5" --site L1.block_in --pos key --dim 1 --dim 2 --steps 5 --batch-size 16 --threads 1 --json -o "$OUT/das_att"
run das_mamba das --ckpt "$MAMBA" --cache "$OUT/mamba.h5" --site L1.block_in --pos key --dim 1 --steps 5 --batch-size 16 --threads 1 --json -o "$OUT/das_mamba"

# --- view of a checkpoint
run view_att view --ckpt "$ATT" --n 16 --site L0.block_out,L1.block_in --pos key,value,query --maps 2 --threads 1 -o "$OUT/view_att.html"
run view_mamba view --ckpt "$MAMBA" --n 16 --maps 2 --threads 1 -o "$OUT/view_mamba.html"

echo "$N commands" >> "$OUT/commands.txt"
echo "$N commands written under $OUT"
