#!/usr/bin/env bash
# Train, calibrate and evaluate the default SmolLM2 DSpark draft in ONE device call (see docs/draft-training.md).
#
#   1. here (network, .venv built):  bash benchmarks/gpu_train_draft.sh stage
#      = ../shared/gpu/stage.sh (wheels, model parts, MT-Bench prompts) + the ShareGPT extract in .gpu/train/;
#      prints the device calls. The last one carries .gpu/train beside the last model part and runs
#        bash .gpu/dev.sh bash benchmarks/gpu_train_draft.sh run
#      with timeout_s 600.
#   2. afterwards, here:  bash benchmarks/gpu_train_draft.sh unpack FILES_AT  -> results/gpu-draft/ (draft + JSON)
#
# Checks without a GPU (same commands, same flags, only sizes and the target change):
#   TINY=1 OUT=/tmp/o bash benchmarks/gpu_train_draft.sh run                   # random tiny target, ~20 s
#   SMALL=1 DEVICE=cpu OUT=/tmp/o bash benchmarks/gpu_train_draft.sh run       # real SmolLM2 on the CPU, a few minutes
#
# What it trades for time (budget: about 9 of the 15 device minutes; the rest is start-up and the model-part calls):
# on-policy answers stop being started after ON_POLICY_MIN minutes (prefill-only ShareGPT answers and the
# held-out set are made first, in full), and training stops after TRAIN_MIN minutes; the checkpoint kept
# is the one with the best held-out on-policy tau either way. Everything stays on the GPU; nothing is tuned on MT-Bench.
set -uo pipefail
mode=${1:-run}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

if [ "$mode" = stage ]; then
  set -e
  bash ../shared/gpu/stage.sh | tee /tmp/gpu-stage.log
  mkdir -p .gpu/train
  # the 80 held-out bench prompts (benchmarks/results README) stay out of the extract, so the run cannot train on them
  .venv/bin/python benchmarks/heldout_prompts.py .gpu/heldout-bench.jsonl --count 80 --training_prompts 10728
  .venv/bin/python - <<'PY'
import json
from pathlib import Path
from dspark_core.train.data import write_sharegpt_extract
bench = {json.loads(line)["messages"][0]["content"] for line in open(".gpu/heldout-bench.jsonl")}
n = write_sharegpt_extract(Path(".gpu/train/sharegpt.jsonl.gz"), max_chars=2000, answer_chars=2048, exclude=bench)
print(f"ShareGPT extract: {n} records (the {len(bench)} held-out bench prompts left out) -> .gpu/train/sharegpt.jsonl.gz")
from dspark_core.train.later_turns import write_later_extract
n = write_later_extract(Path(".gpu/train/sharegpt-later.jsonl.gz"), max_chars=2000, max_context_chars=2000, exclude_first=bench)
print(f"later-turn extract: {n} exchanges (the held-out bench prompts' conversations left out) -> .gpu/train/sharegpt-later.jsonl.gz")
PY
  # fewer, larger model parts: each call carries the tree plus at most 64 MiB in all, and the last part
  # travels with .gpu/train (every call saved is device time)
  model=$(.venv/bin/dspark-core fetch-model smollm2 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])')
  tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')  # summed over every xargs batch
  train=$(du -cb .gpu/train | tail -1 | cut -f1)
  # 3 MiB to spare: the tree grows between staging and a later session's calls (results, docs), and
  # a part sized to the byte for the old tree was refused once the tree had grown by ~1 MB
  room=$(( 64 * 1048576 - tree - 3 * 1048576 ))
  bytes=$(stat -c %s "$model")
  # as few parts as fit: full parts first (part-0 also carries the wheels), the remainder last, beside .gpu/train;
  # if the remainder and the extract do not fit one call, one part more, all of equal size
  size=$(( room - 600000 ))
  parts=$(( (bytes + size - 1) / size ))
  while [ $(( bytes - (parts - 1) * size + train )) -gt "$room" ]; do
    parts=$(( parts + 1 )); size=$(( (bytes + parts - 1) / parts ))
  done
  rm -f .gpu/part-*; split -b "$size" -d -a 1 "$model" .gpu/part-
  ls .gpu/part-* | wc -l > .gpu/whl/model.parts
  du -sh .gpu/train .gpu/part-* .gpu/whl
  last=$(ls .gpu/part-* | sort -V | tail -1)
  echo "device calls for this run (they replace the list stage.sh printed above; each right after the previous one):"
  n=$(ls .gpu/part-* | wc -l)
  echo "  1. carry [\".gpu/dev.sh\", \".gpu/whl\", \".gpu/part-0\"]   command: bash .gpu/dev.sh"
  for i in $(seq 1 $((n - 1))); do
    if [ ".gpu/part-$i" = "$last" ]; then break; fi
    echo "  $((i + 1)). carry [\".gpu/dev.sh\", \".gpu/part-$i\"]   command: bash .gpu/dev.sh"
  done
  echo "  $n. carry [\".gpu/dev.sh\", \"$last\", \".gpu/train\"]   timeout_s 600"
  echo "     command: bash .gpu/dev.sh bash benchmarks/gpu_train_draft.sh run"
  echo "  (if the run must be repeated while warm: carry [\".gpu/dev.sh\", \".gpu/train\"], same command)"
  exit 0
fi

if [ "$mode" = unpack ]; then
  src=${2:?usage: gpu_train_draft.sh unpack FILES_AT}
  dst=${3:-results/gpu-draft}
  mkdir -p "$dst"
  cp "$src"/results.json "$src"/log.txt "$dst"/ 2>/dev/null || true
  cat "$src"/draft.tar.part-* > "$dst/draft.tar" && tar -xf "$dst/draft.tar" -C "$dst" && rm "$dst/draft.tar"
  ls -la "$dst" "$dst/draft-calibrated" 2>/dev/null
  exit 0
fi

[ "$mode" = run ] || { echo "usage: gpu_train_draft.sh stage|run|unpack" >&2; exit 2; }

# ---- settings (environment overrides) ----
OUT=${OUT:?set OUT (the device tool sets it)}
PY=${PYTHON:-python3}  # the device has no .venv (dev.sh installs the project into its python3); here the .venv is used
[ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ] && PY=$root/.venv/bin/python
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/dsd-gpu}
SHAREGPT=${SHAREGPT:-$root/.gpu/train/sharegpt.jsonl.gz}
MTBENCH=${MTBENCH:-${DSPARK_PROMPTS:-}}
PROMPTS=${PROMPTS:-20000}          # ShareGPT pairs asked for (the extract holds ~13.5k with prompts <= 2000 chars: all of them)
HELDOUT=${HELDOUT:-256}            # held-out prompts, answered on-policy (calibration + checkpoint choice)
MAX_PROMPT_CHARS=${MAX_PROMPT_CHARS:-2000}
MAX_TOKENS=${MAX_TOKENS:-128}
GEN_BATCH=${GEN_BATCH:-384}
SHARD=${SHARD:-512}
ROWS=${ROWS:-16384}
ON_POLICY_MIN=${ON_POLICY_MIN:-2.5}
ON_POLICY_FROM=${ON_POLICY_FROM:-0}  # first training prompt answered on-policy (a fresh machine: skip those an earlier run answered)
LATER_TURNS=${LATER_TURNS:-0}      # later turns of the conversations added (prefill + on-policy, theirs first in ON_POLICY_MIN)
MAX_CONTEXT_CHARS=${MAX_CONTEXT_CHARS:-2000}  # history + question characters a later turn keeps
SHAREGPT_LATER=${SHAREGPT_LATER:-$root/.gpu/train/sharegpt-later.jsonl.gz}
STEPS=${STEPS:-3000}
SEQS=${SEQS:-64}
ANCHORS=${ANCHORS:-24}
LR=${LR:-6e-4}
EVAL_EVERY=${EVAL_EVERY:-100}
TRAIN_MIN=${TRAIN_MIN:-2.5}
INIT_LAYER=${INIT_LAYER:-}         # e.g. -1: warm-start the draft layer from the target's top layer
INIT_DRAFT=${INIT_DRAFT-default}   # fine-tune the shipped draft (on the CPU this beat training from scratch at every
                                   # data size tried); INIT_DRAFT= (empty) trains a fresh draft (give it LR=2e-3)
EVAL_MTBENCH=${EVAL_MTBENCH:-0}    # 1: also run eval-draft on MT-Bench here (about 2 min); by default the returned draft
                                   # is evaluated on the CPU, so the device minutes go to data and training
EVAL_BATCH=${EVAL_BATCH:-16}
EVAL_LIMIT=${EVAL_LIMIT:-0}
WIDTHS=${WIDTHS:-5,7}
extra=(); tiny=()
if [ "${TINY:-0}" = 1 ]; then
  DEVICE=${DEVICE_TINY:-cpu}; PROMPTS=24; HELDOUT=6; MAX_TOKENS=40; GEN_BATCH=8; SHARD=8; ROWS=256
  STEPS=30; EVAL_EVERY=10; EVAL_BATCH=4; WIDTHS=2,4; tiny=(--tiny)
  INIT_DRAFT=""; EVAL_MTBENCH=${EVAL_MTBENCH_TINY:-1}  # a random tiny target has no shipped draft to start from
  LATER_TURNS=${LATER_TURNS_TINY:-4}
elif [ "${SMALL:-0}" = 1 ]; then  # real SmolLM2, CPU-sized
  PROMPTS=40; HELDOUT=8; MAX_TOKENS=32; GEN_BATCH=16; SHARD=16; ROWS=2048; ON_POLICY_MIN=0.5
  STEPS=20; SEQS=4; ANCHORS=8; EVAL_EVERY=10; TRAIN_MIN=1; EVAL_LIMIT=4; EVAL_BATCH=4
  [ -f "$SHAREGPT" ] || SHAREGPT=""
fi
[ -n "$INIT_LAYER" ] && extra+=(--init_from_target_layer="$INIT_LAYER")
[ -n "$INIT_DRAFT" ] && extra+=(--init_draft="$INIT_DRAFT")
[ "${TINY:-0}" = 1 ] || extra+=(--baseline_draft=default)  # the shipped draft on the same held-out set
mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
: > "$LOG"
CLI=("$PY" -c 'import sys; from dspark_core.cli import main; sys.exit(main(sys.argv[1:]))')
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
stage() {  # stage NAME LIMIT_S STDOUT_FILE|- CMD...: time-limited; stderr (and stdout unless a file is named) to the log
  local name=$1 limit=$2 out=$3 rc t0=$SECONDS; shift 3
  say "== $name (limit ${limit}s)"
  if [ "$out" = - ]; then
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
  else
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$out" 2> >(tee -a "$LOG" >&2); rc=$?
  fi
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$WORK/stages.jsonl"
  say "== $name: rc $rc, $((SECONDS - t0)) s"
  return "$rc"
}
rm -f "$WORK/stages.jsonl" "$WORK/calibrate.json" "$WORK/eval-mtbench.json"
say "device $DEVICE; python $PY; prompts $PROMPTS later turns $LATER_TURNS heldout $HELDOUT max_tokens $MAX_TOKENS gen_batch $GEN_BATCH steps $STEPS seqs $SEQS lr $LR"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 | tee -a "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"

src=()
[ -n "$SHAREGPT" ] && src=(--sharegpt="$SHAREGPT")
if [ "$LATER_TURNS" != 0 ]; then
  src+=(--later_turns="$LATER_TURNS" --max_context_chars="$MAX_CONTEXT_CHARS")
  [ -f "$SHAREGPT_LATER" ] && src+=(--sharegpt_later="$SHAREGPT_LATER")
fi
run_dir=$WORK/run
# 1. features (held-out on-policy, ShareGPT answers prefill-only, on-policy answers within ON_POLICY_MIN) + training
LIMIT_TRAIN=${LIMIT_TRAIN:-470}
stop_at=$(( $(date +%s) + LIMIT_TRAIN - 25 ))  # training exports before the stage limit even if features ran long
stage train-draft "$LIMIT_TRAIN" - "${CLI[@]}" train-draft --device="$DEVICE" --answers=on_policy,sharegpt "${src[@]}" \
  --prompts="$PROMPTS" --heldout="$HELDOUT" --max_prompt_chars="$MAX_PROMPT_CHARS" --max_tokens="$MAX_TOKENS" \
  --gen_batch="$GEN_BATCH" --shard_size="$SHARD" --rows_per_forward="$ROWS" --on_policy_minutes="$ON_POLICY_MIN" --on_policy_from="$ON_POLICY_FROM" \
  --steps="$STEPS" --seqs_per_step="$SEQS" --anchors_per_seq="$ANCHORS" --lr="$LR" --eval_every="$EVAL_EVERY" \
  --max_minutes="$TRAIN_MIN" --stop_at="$stop_at" --save_every=500 --seed=0 --features_dir="$WORK/features" --output="$run_dir" \
  --no_progress "${extra[@]}" "${tiny[@]}"
# 2. STS + shared offset on the held-out on-policy features (no target pass)
if [ -d "$run_dir/draft" ]; then
  stage calibrate "${LIMIT_CALIBRATE:-60}" "$WORK/calibrate.json" "${CLI[@]}" calibrate-confidence --device="$DEVICE" --draft_model="$run_dir/draft" \
    --heldout="$run_dir/heldout-features.pt" --offset --output="$run_dir/draft-calibrated" --json "${tiny[@]}"
fi
# the calibrated draft goes under $OUT at once, so that a call cut short later still returns it
if [ -d "$run_dir/draft-calibrated" ]; then
  tar -C "$run_dir" -cf "$WORK/draft.tar" draft-calibrated curve.jsonl train-summary.json heldout.jsonl 2>/dev/null
  split -b 15m -d -a 1 "$WORK/draft.tar" "$OUT/draft.tar.part-"
fi
# 3. MT-Bench first turns through the real engine (evaluation only; nothing is chosen on it)
if [ "$EVAL_MTBENCH" = 1 ] && [ -d "$run_dir/draft-calibrated" ]; then
  if [ "${TINY:-0}" = 1 ]; then eval_prompts=$run_dir/heldout.jsonl; else eval_prompts=$MTBENCH; fi
  eargs=(--device="$DEVICE" --draft_model="$run_dir/draft-calibrated" --widths="$WIDTHS" --max_tokens="$MAX_TOKENS"
         --batch="$EVAL_BATCH" --limit="$EVAL_LIMIT" --json "${tiny[@]}")
  [ -n "$eval_prompts" ] && eargs+=(--prompts="$eval_prompts")
  stage eval-mtbench "${LIMIT_EVAL:-120}" "$WORK/eval-mtbench.json" "${CLI[@]}" eval-draft "${eargs[@]}"
fi
# 4. results under $OUT (at most 8 files, 16 MiB each): results.json, log.txt, the calibrated draft as tar parts
"$PY" - "$WORK" "$OUT/results.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
def load(p):
    try:
        return json.loads(p.read_text())
    except Exception as exc:  # a stage that failed leaves nothing (or a partial file)
        return {"missing": str(p), "error": type(exc).__name__}
res = {"stages": [json.loads(l) for l in (work / "stages.jsonl").read_text().splitlines()] if (work / "stages.jsonl").is_file() else [],
       "train_summary": load(work / "run" / "train-summary.json"),
       "curve": [json.loads(l) for l in (work / "run" / "curve.jsonl").read_text().splitlines()] if (work / "run" / "curve.jsonl").is_file() else [],
       "calibrate": load(work / "calibrate.json"), "eval_mtbench": load(work / "eval-mtbench.json")}
try:
    import torch
    res["torch"] = torch.__version__
    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:
    pass
out.write_text(json.dumps(res, indent=1) + "\n")
e = res["eval_mtbench"].get("widths", {}) if isinstance(res["eval_mtbench"], dict) else {}
print("results:", {k: round(v["tau"], 3) for k, v in e.items()}, "best held-out:", res["train_summary"].get("best"))
PY
say "done; files under $OUT:"; ls -la "$OUT" | tee -a "$LOG"
