#!/usr/bin/env bash
# The GPU checks in one run of <= 6 minutes on one H100 / H200 / A100 (docs/testing.md "GPU check"):
#   gpu_tests        pytest -m gpu (tests/conftest.py skips them without CUDA; SmolLM2 / vLLM absent: skipped)
#   fsdp_one_rank    FSDP2 on one NCCL rank against the same steps unsharded, bf16 mixed precision, an async
#                    sharded checkpoint resumed (tests/gpu/fsdp_one_rank.py)
#   flex_recompile   flex attention under `auto` over several pack lengths: compiles counted, peak memory
#   vllm_sleep_wake  vLLM sleep -> ~60 GB allocation -> wake-up -> weight update, with and without empty_cache
#   rce_bf16         the bf16 RCE guard on Qwen2.5-0.5B-Instruct from the Hugging Face cache (offline)
#   bench_packing    memopd bench packing at config/paper.yaml's synthetic shapes with Qwen2.5-3B's sizes
# The interpreter: $PYTHON, else the first of .venv/bin/python and python3 whose torch sees CUDA (the working tree
# travels without its venv; src/ is put on PYTHONPATH). Each part has its own time limit; a part skips (exit 75,
# "skip: <why>") only for a named, expected absence: no CUDA device, an optional package not installed, weights not
# in the Hugging Face cache (tests/gpu/absent.py); any other error fails it. Writes $GPU_CHECK_OUT/summary.tsv
# (default results/gpu_check): a header, then one line per part: part, status (pass / fail / skip), seconds, detail.
# GPU_CHECK_PARTS: the parts to run (default all, in the order below). Without a GPU every part is skipped and the
# script exits 0 (GPU_CHECK_REHEARSE=1: every part runs anyway and says what it lacks, the FSDP part on gloo). It
# exits 1, with one line saying why: when its output folder or summary cannot be written, when nvidia-smi exists but
# fails (a driver error is not "no GPU"), when nvidia-smi sees a GPU that no interpreter's torch can use, or when a
# part failed.
set -u
cd "$(dirname "$0")/../.."
OUT=${GPU_CHECK_OUT:-results/gpu_check}
SUMMARY="$OUT/summary.tsv"
ALL_PARTS="gpu_tests fsdp_one_rank flex_recompile vllm_sleep_wake rce_bf16 bench_packing"
PARTS=${GPU_CHECK_PARTS:-$ALL_PARTS}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

die() {  # one line saying why, exit 1: a check that cannot record its parts has not shown anything
    echo "gpu check: FAIL: $1"
    exit 1
}

for part in $PARTS; do
    [[ " $ALL_PARTS " == *" $part "* ]] || die "GPU_CHECK_PARTS names an unknown part $part (the parts: $ALL_PARTS)"
done
mkdir -p "$OUT" 2>/dev/null || die "cannot create the output folder $OUT"
printf 'part\tstatus\tseconds\tdetail\n' 2>/dev/null > "$SUMMARY" || die "cannot write $SUMMARY"

row() {  # part status seconds detail (tabs and newlines in the detail become spaces); a failed write ends the check
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-300)" 2>/dev/null \
        >> "$SUMMARY" || die "cannot write $SUMMARY (its row for $1: $2)"
}

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

describe() {  # interpreter -> "torch VERSION, cuda true|false" or why it has none
    "$1" -c 'import torch; print(f"torch {torch.__version__}, cuda {str(torch.cuda.is_available()).lower()}")' \
        2>/dev/null || echo "no torch"
}

PY="" TRIED=""
for c in ${PYTHON:-.venv/bin/python python3}; do
    if ! command -v "$c" > /dev/null 2>&1; then TRIED="$TRIED; $c: absent"; continue; fi
    d=$(describe "$c")
    TRIED="$TRIED; $c: $d"
    if [[ "$d" == *"cuda true" ]]; then PY=$c; break; fi
done
TRIED=${TRIED#; }
GPU=""
if command -v nvidia-smi > /dev/null 2>&1; then  # present: it must answer (exit 0), GPU or not
    SMI=$(nvidia-smi -L 2>&1)
    SMI_RC=$?
    if [ "$SMI_RC" != 0 ]; then
        row nvidia_smi fail 0 "nvidia-smi -L exits $SMI_RC: $(tail -n 1 <<< "$SMI")"
        die "nvidia-smi -L exits $SMI_RC ($(tail -n 1 <<< "$SMI")): a broken driver is not a machine without a GPU"
    fi
    GPU=$(grep -m1 '^GPU' <<< "$SMI" || true)
fi
if [ -z "$PY" ] && [ -z "$GPU" ] && [ -n "${GPU_CHECK_REHEARSE:-}" ]; then
    # a rehearsal on a machine without a GPU: every part runs on the first interpreter with a torch and says
    # for itself what it lacks (the parts that need CUDA skip; fsdp_one_rank runs on gloo)
    for c in ${PYTHON:-.venv/bin/python python3}; do
        [[ "$(describe "$c" 2>/dev/null)" == torch* ]] && { PY=$c; break; }
    done
fi
if [ -z "$PY" ]; then
    if [ -n "$GPU" ]; then
        row interpreter fail 0 "nvidia-smi sees $GPU but no interpreter has a CUDA torch ($TRIED)"
        echo "gpu check: FAIL: nvidia-smi sees $GPU, but no interpreter's torch can use it ($TRIED); set PYTHON to one that can"
        exit 1
    fi
    for part in $PARTS; do row "$part" skip 0 "skip: no CUDA GPU (nvidia-smi: none; $TRIED)"; done
    echo "gpu check: skip: no CUDA GPU (nvidia-smi: none; $TRIED): every part skipped ($SUMMARY)"
    exit 0
fi
echo "gpu check: $PY ($(describe "$PY")); ${GPU:-nvidia-smi: none}"

run() {  # part limit_s command...: status from the exit code (124: over the limit), detail from the last line
    local part=$1 limit=$2 log="$OUT/$1.log" t0 rc secs status detail
    shift 2
    wanted "$part" || return 0
    t0=$(date +%s)
    : 2>/dev/null > "$log" || die "cannot write $log"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    detail=$(grep -v '^\s*$' "$log" | tail -n 1)
    if [ "$part" = gpu_tests ] && [ "$rc" = 0 ] && ! grep -q ' passed' <<< "$detail"; then
        rc=75  # every test skipped (each with its reason in the log): nothing was shown to work
    fi
    case $rc in
        0) status=pass ;;
        75) status=skip ;;  # EX_TEMPFAIL: the part's prerequisite (vllm, the weights) is missing here
        124|137) status=fail; detail="over its ${limit} s limit; $detail" ;;
        *) status=fail; detail="exit $rc; $detail" ;;
    esac
    row "$part" "$status" "$secs" "$detail"
    echo "gpu check: $part $status in ${secs} s: $detail"
}

missing=$("$PY" - <<'PY'
import importlib.util
need = ["pytest", "pyarrow", "yaml", "safetensors", "transformers"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if ! wanted gpu_tests; then
    :
elif [ -n "$missing" ]; then
    row gpu_tests skip 0 "skip: $PY lacks $missing"
    echo "gpu check: gpu_tests skip: $PY lacks $missing"
else
    run gpu_tests 100 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs tests
fi
run fsdp_one_rank 40 "$PY" tests/gpu/fsdp_one_rank.py
run flex_recompile 40 "$PY" tests/gpu/flex_probe.py
run vllm_sleep_wake 60 "$PY" tests/gpu/vllm_cycle.py
run rce_bf16 30 "$PY" tests/gpu/rce_qwen.py
# config/paper.yaml's synthetic sweep (calls x prefix tokens) on Qwen2.5-3B's layer shapes, 4 of its 36 layers: the
# per-layer costs at the paper's sizes (all 36 would hold ~99 GB of fp32 activations in the padded 16-call path)
BENCH='{"calls": [4, 8, 16], "prefix_tokens": [128, 256, 512], "device": "cuda", "untimed": ["independent_sequential", "packed_eager"],
 "model": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936}}'
if [ -n "$GPU" ] || ! wanted bench_packing; then
    run bench_packing 90 "$PY" -m memopd.cli bench packing --cfg "$BENCH" --repeats 2 --threads 1 --out "$OUT/bench_packing.csv"
else
    row bench_packing skip 0 "skip: no CUDA GPU (its sweep runs on cuda)"
    echo "gpu check: bench_packing skip: no CUDA GPU (its sweep runs on cuda)"
fi
rows=$(tail -n +2 "$SUMMARY" 2>/dev/null | wc -l)
[ "$rows" = "$(wc -w <<< "$PARTS")" ] || die "$SUMMARY holds $rows rows for $(wc -w <<< "$PARTS") parts"
echo "gpu check: $SUMMARY"
if grep -q $'\tfail\t' "$SUMMARY"; then
    echo "gpu check: FAIL: $(grep $'\tfail\t' "$SUMMARY" | cut -f1 | tr '\n' ' ')failed"
    exit 1
fi
