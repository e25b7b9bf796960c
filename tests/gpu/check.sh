#!/usr/bin/env bash
# The GPU checks in one run of <= 8 minutes on one H100 / H200 / A100 (docs/testing.md "GPU check"):
#   gpu_tests        pytest -m gpu (tests/conftest.py skips them without CUDA)
#   vllm_sleep_wake  vLLM sleep -> ~60 GB allocation -> wake-up -> weight update, with and without empty_cache
#   rce_bf16         the bf16 RCE guard on Qwen2.5-0.5B-Instruct from the Hugging Face cache (offline)
#   bench_packing    memopd bench packing at config/paper.yaml's synthetic shapes with Qwen2.5-3B's sizes
# Each part has its own time limit. Writes $GPU_CHECK_OUT/summary.tsv (default results/gpu_check): a header, then
# one line per part: part, status (pass / fail / skip), seconds, detail. Without a CUDA GPU every part is skipped
# and the script exits 0; otherwise it exits 1 if a part failed.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_CHECK_OUT:-results/gpu_check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.tsv"
printf 'part\tstatus\tseconds\tdetail\n' > "$SUMMARY"
PARTS="gpu_tests vllm_sleep_wake rce_bf16 bench_packing"

row() {  # part status seconds detail (tabs and newlines in the detail become spaces)
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-300)" >> "$SUMMARY"
}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    for part in $PARTS; do row "$part" skip 0 "no CUDA GPU"; done
    echo "gpu check: no CUDA GPU, every part skipped ($SUMMARY)"
    exit 0
fi

run() {  # part limit_s command...: status from the exit code (124: over the limit), detail from the last line
    local part=$1 limit=$2 log="$OUT/$1.log" t0 rc secs status detail
    shift 2
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    detail=$(grep -v '^\s*$' "$log" | tail -n 1)
    case $rc in
        0) status=pass ;;
        75) status=skip ;;  # EX_TEMPFAIL: the part's prerequisite (vllm, the weights) is missing here
        124|137) status=fail; detail="over its ${limit} s limit; $detail" ;;
        *) status=fail; detail="exit $rc; $detail" ;;
    esac
    row "$part" "$status" "$secs" "$detail"
    echo "gpu check: $part $status in ${secs} s: $detail"
}

run gpu_tests 120 "$PY" -m pytest -q -m gpu -x -p no:cacheprovider tests
run vllm_sleep_wake 140 "$PY" tests/gpu/vllm_cycle.py
run rce_bf16 50 "$PY" tests/gpu/rce_qwen.py
# config/paper.yaml's synthetic sweep (calls x prefix tokens) on Qwen2.5-3B's layer shapes, 4 of its 36 layers: the
# per-layer costs at the paper's sizes (all 36 would hold ~99 GB of fp32 activations in the padded 16-call path)
BENCH='{"calls": [4, 8, 16], "prefix_tokens": [128, 256, 512], "device": "cuda", "untimed": ["independent_sequential", "packed_eager"],
 "model": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936}}'
run bench_packing 150 "$PY" -m memopd.cli bench packing --cfg "$BENCH" --repeats 2 --threads 1 --out "$OUT/bench_packing.csv"
echo "gpu check: $SUMMARY"
! grep -q $'\tfail\t' "$SUMMARY"
