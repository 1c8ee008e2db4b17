#!/usr/bin/env bash
# One device sitting for issue 17, prepared on the CPU: environment, exactness in float32 (the CUDA
# default), the K=7 bench at concurrency 1/4/16/64, the step-time breakdown, bfloat16 divergences
# classified, and the host time a step spends outside its graph keys. Every part has its own time
# limit and writes under $OUT as it finishes, so a hang or a crash in one part still returns the
# others and the log.
#
# On the device (after ../shared/gpu/stage.sh and the model-part calls; see ../shared/gpu/README.md):
#     bash .gpu/dev.sh bash benchmarks/h200/sitting.sh
# One device command may run 10 minutes at most: if the parts do not fit one call, name them per call,
#     PARTS=env,exactness-float32,bench-k7 bash .gpu/dev.sh bash benchmarks/h200/sitting.sh
#     PARTS=step-profile,exactness-bfloat16,host-overhead bash .gpu/dev.sh bash benchmarks/h200/sitting.sh
# (step-profile reuses the bench's cost table when the same OUT still holds it).
# At most 8 files come back from a device call, and the parts write more: write under /tmp and
# return one tar (the call the first sitting made, 2026-12-04):
#     O=$OUT; PARTS=... OUT=/tmp/sit bash .gpu/dev.sh bash benchmarks/h200/sitting.sh; \
#         tar -C /tmp -cf $O/sitting.tar sit; cp /tmp/sit/log.txt $O/
# A 15-minute session (start-up and the model-part calls take about a minute) fits two such calls
# if their limits add up to less: issue 17 asks for exactness on 80 prompts x 128 tokens, so the
# first call is PARTS=env,attention-micro,exactness-float32,bench-k7 with LIMIT_attention_micro=40
# LIMIT_bench_k7=230 PER_CONCURRENCY=4,16,64,64 (570 s of limits). The second gets what is left,
# about 250 s: PARTS=step-profile,step-profile-nospans,step-profile-sdpa STEPS=20 LIMIT_step_profile=80
# LIMIT_step_profile_nospans=80 LIMIT_step_profile_sdpa=80. exactness-bfloat16 and host-overhead then wait
# for another session. KV spans (--captured_kv_spans=auto: 256, 512, 1 024) capture each cache-reading key
# four times: read the warmup seconds in the first part's log before trusting these limits.
# A shorter sitting (a device call that shares its minutes with other work) names fewer parts, smaller
# sizes, the bench's POLICIES and per-part limits, e.g. LIMIT_bench_k7=150.
# A dry run here on the CPU with tiny sizes (what to run before spending device time):
#     DEVICE=cpu PROMPTS_FILE=prompts.jsonl N=2 TOKENS=8 CONCURRENCY=1,2 PER_CONCURRENCY=2,2 CALIBRATION=demo \
#         MAX_SEQS=16 PAIRS=none:1,fixed-k7:2 STEPS=4 CLI=.venv/bin/dspark-core PY=.venv/bin/python \
#         OUT=/tmp/sitting bash benchmarks/h200/sitting.sh
set -uo pipefail
OUT=${OUT:-/tmp/h200-sitting}
DEVICE=${DEVICE:-cuda}
PROMPTS_FILE=${PROMPTS_FILE:-${DSPARK_PROMPTS:-}}
N=${N:-80}
TOKENS=${TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
PER_CONCURRENCY=${PER_CONCURRENCY:-8,16,64,80}
PAIRS=${PAIRS:-none:1,fixed-k7:1,none:16,fixed-k7:16,adaptive:16}
STEPS=${STEPS:-50}
CALIBRATION=${CALIBRATION:-$(cd "$(dirname "$0")" && pwd)/calibration-k7.json}
MAX_SEQS=${MAX_SEQS:-64}
POLICIES=${POLICIES:-}  # bench policies (empty: the bench's default list)
PARTS=${PARTS:-env,attention-micro,exactness-float32,bench-k7,step-profile,step-profile-nospans,step-profile-sdpa,exactness-bfloat16,host-overhead}
CLI=${CLI:-dspark-core}
PY=${PY:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
LOG=$OUT/log.txt
if [ -z "$PROMPTS_FILE" ]; then echo "no prompts: set PROMPTS_FILE (dev.sh sets DSPARK_PROMPTS)" | tee -a "$LOG"; exit 2; fi

part() {  # part NAME SECONDS COMMAND...: run with a limit (if NAME is in PARTS), log its tail and exit status
  # LIMIT_<name> (dashes as underscores, e.g. LIMIT_bench_k7=120) overrides the limit for a shorter sitting
  local name=$1 limit=$2 started rc var
  var=LIMIT_${1//-/_}; limit=${!var:-$limit}
  shift 2
  case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
  started=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" > "$OUT/$name.out" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.out" | tee -a "$LOG"
  echo "== $name: exit $rc after $(( $(date +%s) - started )) s" | tee -a "$LOG"
}

part env 60 "$PY" - "$DEVICE" <<'PY'
import json, subprocess, sys
import torch
device = sys.argv[1]
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    info["driver"] = None
print(json.dumps(info))
PY
[ -f "$OUT/env.out" ] && cp "$OUT/env.out" "$OUT/env.json"

# one layer's decode attention alone, SDPA against the matmul form CUDA decode steps now take
part attention-micro 60 "$PY" "$HERE/attention_micro.py" --device "$DEVICE" --output "$OUT/attention-micro.json"

# float32 (the CUDA default): every policy must equal target-only greedy; exit 1 on a real difference
part exactness-float32 240 "$PY" "$HERE/../exactness.py" --device "$DEVICE" --dtype auto \
    --prompts_file "$PROMPTS_FILE" --prompts "$N" --max_tokens "$TOKENS" --concurrency 16 \
    --policies none,fixed-k1,fixed-k3,fixed-k7,adaptive --output "$OUT/exactness-float32.json"

BENCH_POLICIES=()
[ -n "$POLICIES" ] && BENCH_POLICIES=(--policies="$POLICIES")
part bench-k7 270 "$CLI" bench "${BENCH_POLICIES[@]}" --device="$DEVICE" --calibration="$CALIBRATION" --max_seqs_per_batch="$MAX_SEQS" \
    --prompts="$PROMPTS_FILE" --concurrency="$CONCURRENCY" --prompts_per_concurrency="$PER_CONCURRENCY" \
    --max_tokens="$TOKENS" --rounds=1 --output_dir="$OUT/bench-k7" --overwrite --json \
    --policy_variants='{"adaptive-nocopysteps": ["adaptive", {"copy_steps": false}]}'

TABLE=()
[ -f "$OUT/bench-k7/cost-table.json" ] && TABLE=(--cost_table "$OUT/bench-k7/cost-table.json")
part step-profile 150 "$PY" "$HERE/step_profile.py" --device "$DEVICE" "${TABLE[@]}" --max_seqs_per_batch "$MAX_SEQS" \
    --prompts_file "$PROMPTS_FILE" --pairs "$PAIRS" --steps "$STEPS" --output "$OUT/step-profile.json"

# the same pairs with every key reading the whole 2 048-position cache (no KV spans): what spans bought
part step-profile-nospans 150 "$PY" "$HERE/step_profile.py" --device "$DEVICE" "${TABLE[@]}" --max_seqs_per_batch "$MAX_SEQS" \
    --prompts_file "$PROMPTS_FILE" --pairs "$PAIRS" --steps "$STEPS" --captured_kv_spans off --output "$OUT/step-profile-nospans.json"

# the same pairs with SDPA attention everywhere (before the matmul form): what the change bought end to end
part step-profile-sdpa 150 "$PY" "$HERE/step_profile.py" --device "$DEVICE" "${TABLE[@]}" --max_seqs_per_batch "$MAX_SEQS" \
    --prompts_file "$PROMPTS_FILE" --pairs "$PAIRS" --steps "$STEPS" --attention sdpa --output "$OUT/step-profile-sdpa.json"

# the opt-in fast mode: differences are expected at near-ties; each is classified by the target's top-2 gap
part exactness-bfloat16 150 "$PY" "$HERE/../exactness.py" --device "$DEVICE" --dtype bfloat16 \
    --prompts_file "$PROMPTS_FILE" --prompts "$(( N < 16 ? N : 16 ))" --max_tokens "$TOKENS" --concurrency 16 \
    --policies none,fixed-k3,adaptive --output "$OUT/exactness-bfloat16.json"

# the host's share of a step (tiny models, CPU only): this machine's CPU sets the floor of a replayed step
part host-overhead 120 "$PY" "$HERE/../host_overhead.py" --steps "$(( STEPS * 4 ))" --output "$OUT/host-overhead.json"

echo "== done; results under $OUT" | tee -a "$LOG"
