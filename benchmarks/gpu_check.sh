#!/usr/bin/env bash
# The GPU path's check on one GPU (docs/real-shapes.md "The GPU path"), from a fresh copy of the working tree on a bare
# machine.
#
#   bash benchmarks/gpu_check.sh wheels        # HERE, with registry access: the wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu_check.sh               # THERE (one H200): every step on cuda, target < 8 minutes
#   bash benchmarks/gpu_check.sh cpu           # any machine: the same steps on the CPU (plumbing only; toy cost model)
#
# Steps (each timed; a failed step is reported and the others still run):
#   1. serve   the toy verifier (recipes/toy.toml, its float32) as `hycoc verify-server --device cuda`, and a
#              `hycoc run` against it at T = 0 (modes hyco-exact and server-head, 64 tokens); the same against a
#              CPU server: the texts must be equal.
#   2. qat     `hycoc build --target cpu --until head_qat` of the toy recipe at QAT_STEPS (40) steps, with --device
#              cuda (verifier in bf16, QAT under bf16 autocast) and with --device cpu (run in the background from
#              the start: it needs no GPU); W4 QAT top-1 agreement at depth 1 within 1 point of each other.
#   3. cost    benchmarks/verifier_cost_model.py --device cuda: Gemma 4 26B-A4B shape, random bf16 weights (50.5
#              GB), verification rows 1/5/33, the head step and prefill chunks at contexts 1,024 and 4,096: the
#              33-row (HyCo) vs 5-row + 4 head steps (Cloud+MTP) round ms beside the paper's 21.7 / 26.8 ms; and the
#              BATCHED line (--batch-sessions 1,4,16,64 x rows 1..512, each session at 1,024 cached positions: the
#              server's batch_forward, 28 points; checked on the CPU with the toy, not yet timed on a GPU), which
#              `hycoc capacity recipes/gemma4.toml --cost-model $OUT/cost-model-26b-a4b.json` projects with.
#
# Needs: python3 with torch (CUDA build for the cuda mode), numpy, onnx, onnxruntime, onnxscript, tokenizers, typer,
# rich, safetensors, aiohttp; the rest travels as wheels in .whl/ (`wheels` makes them: transformers 5.24, pydantic,
# websockets, ...). hycoc itself is not installed: a folder of links under /tmp maps its package layout
# (pyproject's package-dir) onto this checkout. Carry `.whl` and `bundles/toy-cpu` (built here by `hycoc build
# recipes/toy.toml --target cpu`; built there on the CPU, ~2-3 min, when missing).
#
# Environment: PY (default python3), STEPS (default "serve qat cost"), OUT, SKIP_WHEELS=1 (use PY's packages as they
# are, e.g. a venv that has hycoc's dependencies), QAT_CPU_THREADS (8), QAT_STEPS (40), QAT_EVAL_PROMPTS (30),
# QAT_TIMEOUT (420 s per build), COST_TIMEOUT (360 s), BATCH_SESSIONS (1,4,16,64: the batched line's session counts),
# KEEP_WORK=1 (keep the /tmp work folder). On a busy 2-core machine the qat step's two toy builds take far longer than on the GPU host's 16 cores.
#
# Output: a summary table on stdout and $OUT/gpu_check.json (OUT defaults to runs/gpu-check), every step's log in
# $OUT/gpu_check.log. Exit code: 0 when every step passed, 1 otherwise, 2 on a usage error.
set -euo pipefail

MODE="${1:-cuda}"
case "$MODE" in
  cuda|cpu|wheels) ;;
  *) echo "gpu_check: unknown mode '$MODE'; use: cuda (default), cpu or wheels" >&2; exit 2 ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PY:-python3}"
STEPS="${STEPS:-serve qat cost}"

if [ "$MODE" = wheels ]; then
  # Python 3.12 manylinux wheels of what the GPU image (KINDS.md's package list) lacks or has too old.
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl \
    transformers==5.24.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0 websockets==17.4
  du -sh .whl
  exit 0
fi

OUT="${OUT:-$REPO/runs/gpu-check}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/hycoc-gpu-check.XXXXXX)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$(date +%s)
declare -A STATUS SECONDS_OF NOTE
PIDS=()
QAT_RECIPE="$REPO/recipes/.gpu-check-toy.toml"   # beside toy.toml: its model paths are relative to recipes/
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  rm -f "$QAT_RECIPE"
  [ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT

say() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# ---- environment --------------------------------------------------------------------------------------------------
if [ "${SKIP_WHEELS:-0}" = 1 ]; then
  say "SKIP_WHEELS=1: using $PY's own packages"
elif compgen -G ".whl/*.whl" > /dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) wheels from .whl into $WORK/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    >> "$LOG" 2>&1 || { say "FAILED: pip could not install .whl/ (see $LOG)"; exit 1; }
fi
# hycoc's package layout (pyproject [tool.setuptools] package-dir) as links: hycoc/ plus its four mapped folders
mkdir -p "$WORK/src/hycoc"
for f in "$REPO"/hycoc/*; do ln -s "$f" "$WORK/src/hycoc/$(basename "$f")"; done
for pair in passes:passes targets:targets runtime:runtime verifier:verifier; do
  ln -s "$REPO/${pair#*:}" "$WORK/src/hycoc/${pair%%:*}"
done
export PYTHONPATH="$WORK/site:$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
HYCOC=("$PY" -m hycoc.cli)
DEV=cuda; [ "$MODE" = cpu ] && DEV=cpu   # the device under test (cpu mode: the plumbing only)

"$PY" - "$MODE" <<'EOF' 2>&1 | tee -a "$LOG"
import sys, platform, torch, transformers, onnxruntime
print(f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}), transformers "
      f"{transformers.__version__}, onnxruntime {onnxruntime.__version__}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: mode cuda, but torch sees no CUDA device; run `bash benchmarks/gpu_check.sh cpu` instead")
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
import hycoc.verifier.engine  # noqa: F401  the layout links work
EOF

if [ ! -f bundles/toy-cpu/manifest.json ]; then
  say "bundles/toy-cpu missing (carry it to save minutes): building it on the CPU"
  "${HYCOC[@]}" build recipes/toy.toml --target cpu --out bundles/toy-cpu --cache-dir "$WORK/cache-bundle" >> "$LOG" 2>&1
fi

# The CPU reference of step 2 needs no GPU: start it now, in the background. Both QAT runs use the toy recipe with
# QAT_STEPS optimizer steps (default 40 of its 100, warm-up half of them) and QAT_EVAL_PROMPTS evaluation answers
# (default 30 of 60), so the CPU run fits the 8 minutes; the comparison is like for like.
if [[ " $STEPS " == *" qat "* ]]; then
  QS="${QAT_STEPS:-40}"
  sed -e "s/^steps = 100\b/steps = $QS/" -e "s/^warmup_steps = 50\b/warmup_steps = $(( QS / 2 ))/" \
      -e "s/^eval_prompts = 60\b/eval_prompts = ${QAT_EVAL_PROMPTS:-30}/" recipes/toy.toml > "$QAT_RECIPE"
  grep -q "^steps = $QS\b" "$QAT_RECIPE" || { say "FAILED: could not set [head_qat] steps in $QAT_RECIPE"; exit 1; }
  say "qat: CPU reference build started in the background"
  # a few threads: the toy's matrices are small, and the GPU build beside it needs CPU too
  ( OMP_NUM_THREADS="${QAT_CPU_THREADS:-8}" timeout "${QAT_TIMEOUT:-420}" "${HYCOC[@]}" build "$QAT_RECIPE" \
      --target cpu --until head_qat --device cpu --cache-dir "$WORK/cache-cpu" > "$WORK/qat-cpu.log" 2>&1
    echo $? > "$WORK/qat-cpu.rc" ) &
  PIDS+=($!)
fi

step() {  # step NAME FUNCTION: run it, time it, record PASS/FAIL without stopping the script
  local name=$1 fn=$2 start rc
  start=$(date +%s)
  say "== $name"
  set +e
  ( set -euo pipefail; "$fn" )
  rc=$?
  set -e
  SECONDS_OF[$name]=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then STATUS[$name]=PASS; else STATUS[$name]=FAIL; fi
  say "== $name: ${STATUS[$name]} in ${SECONDS_OF[$name]} s"
}

# ---- 1. serve -----------------------------------------------------------------------------------------------------
start_server() {  # start_server DEVICE -> prints the ws:// URL; the server's pid in $WORK/server-DEVICE.pid
  local device=$1 out="$WORK/server-$1.out"
  "${HYCOC[@]}" verify-server recipes/toy.toml --device "$device" --host 127.0.0.1 --port 0 \
    --keep-set bundles/toy-cpu/keep_set.npy > "$out" 2> "$WORK/server-$device.err" &
  echo $! > "$WORK/server-$device.pid"
  for _ in $(seq 1 240); do
    if grep -q "listening on " "$out"; then grep -o "ws://[^ ]*" "$out" | head -1; return 0; fi
    if ! kill -0 "$(cat "$WORK/server-$device.pid")" 2>/dev/null; then
      echo "gpu_check: the $device verify-server exited: $(tail -3 "$WORK/server-$device.err")" >&2; return 1
    fi
    sleep 0.5
  done
  echo "gpu_check: the $device verify-server did not listen within 120 s" >&2; return 1
}

serve() {
  local url mode label device
  for label in gpu cpu; do
    device=cpu; [ "$label" = gpu ] && device=$DEV
    url=$(start_server "$device")
    say "serve: $label server ($device) at $url"
    for mode in hyco-exact server-head; do
      timeout 180 "${HYCOC[@]}" run bundles/toy-cpu --server "$url" --backend cpu --mode "$mode" --temperature 0 \
        --max-new-tokens 64 --prompt "How do I open a file in Python?" --json \
        > "$WORK/run-$label-$mode.out" 2>> "$LOG"
    done
    kill "$(cat "$WORK/server-$device.pid")" 2>/dev/null || true
    while kill -0 "$(cat "$WORK/server-$device.pid")" 2>/dev/null; do sleep 0.2; done
    cat "$WORK/server-$device.err" >> "$LOG"
  done
  "$PY" - "$WORK" "$DEV" "$OUT/serve.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
work, gpu, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
rows, ok = {"gpu_device": gpu}, True
for mode in ("hyco-exact", "server-head"):
    # `hycoc run --json`: the streamed text, then one JSON object on the last line
    runs = {label: json.loads(work.joinpath(f"run-{label}-{mode}.out").read_text().strip().splitlines()[-1])
            for label in ("gpu", "cpu")}
    g, c = runs["gpu"], runs["cpu"]
    same = g["text"] == c["text"]
    ok &= same and g["tokens"] > 0
    rows[mode] = {"text_equal": same, "tokens": g["tokens"], "mat": g["mat"],
                  "server_ms_per_token": {"gpu": g["server_ms_per_token"], "cpu": c["server_ms_per_token"]}}
    print(f"serve: {mode}: {gpu} text {'==' if same else '!='} cpu text ({g['tokens']} tokens, MAT {g['mat']}); "
          f"server ms/token {gpu} {g['server_ms_per_token']}, cpu {c['server_ms_per_token']}")
    if not same:
        print(f"  {gpu}: {g['text'][:200]!r}\n  cpu:  {c['text'][:200]!r}")
out.write_text(json.dumps(rows, indent=1))
sys.exit(0 if ok else 1)
EOF
}

# ---- 2. qat -------------------------------------------------------------------------------------------------------
qat() {
  local device=$DEV
  timeout "${QAT_TIMEOUT:-420}" "${HYCOC[@]}" build "$QAT_RECIPE" --target cpu --until head_qat --device "$device" \
    --cache-dir "$WORK/cache-$device-qat" > "$WORK/qat-dut.log" 2>&1 \
    || { tail -20 "$WORK/qat-dut.log"; return 1; }
  say "qat: $device build done; waiting for the CPU reference"
  while [ ! -f "$WORK/qat-cpu.rc" ]; do sleep 2; done
  cat "$WORK/qat-cpu.log" "$WORK/qat-dut.log" >> "$LOG"
  [ "$(cat "$WORK/qat-cpu.rc")" = 0 ] || { tail -20 "$WORK/qat-cpu.log"; return 1; }
  "$PY" - "$WORK/cache-$device-qat" "$WORK/cache-cpu" "$OUT/qat.json" "$device" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
def report(cache):
    entries = [p for p in Path(cache, "head_qat").iterdir() if (p / "report.json").is_file()]
    assert len(entries) == 1, f"{cache}: {len(entries)} head_qat entries"
    answers = [p for p in Path(cache, "calibration_answers").iterdir() if (p / "report.json").is_file()]
    r = json.loads((entries[0] / "report.json").read_text())
    a = json.loads((answers[0] / "report.json").read_text()) if answers else {}
    return r, a
(gpu, gpu_ans), (cpu, cpu_ans) = report(sys.argv[1]), report(sys.argv[2])
label = f"w{gpu['numbers']['bits']}_qat"
d_gpu, d_cpu = gpu["numbers"]["agreement"][label], cpu["numbers"]["agreement"][label]
diff = [round(100 * (g - c), 2) for g, c in zip(d_gpu, d_cpu)]
ok = abs(diff[0]) <= 1.0
out = {"device": sys.argv[4], "agreement_depths": {"gpu": d_gpu, "cpu": d_cpu}, "difference_points": diff,
       "within_1_point_at_depth_1": ok,
       "seconds": {"head_qat_gpu": gpu.get("seconds"), "head_qat_cpu": cpu.get("seconds"),
                   "answers_gpu": gpu_ans.get("seconds"), "answers_cpu": cpu_ans.get("seconds")},
       "seconds_per_step": {"gpu": gpu["numbers"]["seconds_per_step"], "cpu": cpu["numbers"]["seconds_per_step"]},
       "summary": {"gpu": gpu["summary"], "cpu": cpu["summary"]}}
Path(sys.argv[3]).write_text(json.dumps(out, indent=1))
print(f"qat: {label} top-1 agreement d1..d4 {sys.argv[4]} {d_gpu} vs cpu {d_cpu}: difference {diff} points "
      f"({'within' if ok else 'NOT within'} 1 point at depth 1); s/step {out['seconds_per_step']}")
sys.exit(0 if ok else 1)
EOF
}

# ---- 3. cost ------------------------------------------------------------------------------------------------------
cost() {
  if [ "$MODE" = cuda ]; then
    timeout "${COST_TIMEOUT:-360}" "$PY" benchmarks/verifier_cost_model.py --device cuda --contexts 1024,4096 \
      --warmup 2 --repeats 5 --batch-sessions "${BATCH_SESSIONS:-1,4,16,64}" --batch-context 1024 \
      --out "$OUT/cost-model-26b-a4b.json" 2>&1 | tee -a "$LOG"
    [ -f "$OUT/cost-model-26b-a4b.json" ] || { echo "gpu_check: no cost model written" >&2; return 1; }
  else  # the toy verifier and head with real weights: the same code, not the 26B-A4B shape
    "$PY" benchmarks/verifier_cost_model.py --device cpu --recipe recipes/toy.toml --contexts 64,256 --warmup 1 \
      --repeats 3 --batch-sessions 1,4 --batch-rows 1,4,33,132 --batch-context 64 \
      --out "$OUT/cost-model-toy-cpu.json" 2>&1 | tee -a "$LOG"
  fi
}

for s in $STEPS; do
  case "$s" in
    serve) step serve serve ;;
    qat) step qat qat ;;
    cost) step cost cost ;;
    *) say "unknown step '$s' in STEPS (serve qat cost)"; STATUS[$s]=FAIL; SECONDS_OF[$s]=0 ;;
  esac
done

# ---- summary ------------------------------------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - T0 ))
FAILED=0
{
  echo
  printf '%-8s %-6s %8s\n' step result seconds
  for s in $STEPS; do printf '%-8s %-6s %8s\n' "$s" "${STATUS[$s]:-SKIP}" "${SECONDS_OF[$s]:-0}"; done
  printf '%-8s %-6s %8s\n' total "" "$TOTAL"
} | tee -a "$LOG"
for s in $STEPS; do [ "${STATUS[$s]:-FAIL}" = PASS ] || FAILED=1; done
"$PY" - "$OUT" "$MODE" "$TOTAL" $(for s in $STEPS; do echo "$s=${STATUS[$s]:-FAIL}:${SECONDS_OF[$s]:-0}"; done) <<'EOF'
import json, sys
from pathlib import Path
out, mode, total = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
steps = {}
for arg in sys.argv[4:]:
    name, rest = arg.split("=", 1)
    status, seconds = rest.split(":")
    steps[name] = {"status": status, "seconds": int(seconds)}
    part = out / {"serve": "serve.json", "qat": "qat.json",
                  "cost": "cost-model-26b-a4b.json" if mode == "cuda" else "cost-model-toy-cpu.json"}.get(name, "-")
    if part.is_file():
        steps[name]["result"] = json.loads(part.read_text())
doc = {"mode": mode, "total_seconds": total, "steps": steps}
tmp = out / ".gpu_check.json.tmp"
tmp.write_text(json.dumps(doc, indent=1))
tmp.replace(out / "gpu_check.json")
print(f"wrote {out / 'gpu_check.json'}")
EOF
exit $FAILED
