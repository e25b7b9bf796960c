"""envs/setup.sh never replaces an installed CUDA (or newer) torch with the CPU pin: run on a copy of envs/ with a
stand-in .venv/bin/python that reports a fake installed torch and records the requirements pip is given."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from agent_support import ROOT

FAKE_PYTHON = """#!/bin/bash
# stands in for the venv's python: pip records its requirement files, `import torch` is FAKE_TORCH
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  shift 2
  while [ $# -gt 0 ]; do [ "$1" = "-r" ] && cat "$2" >> "$LOG"; shift; done
  exit 0
fi
if [ "$1" = "-" ]; then  # the script on stdin, run by a real python with a fake torch module
  mkdir -p "$FAKE_DIR/torch"
  printf 'import types\\n__version__ = "%s"\\nversion = types.SimpleNamespace(cuda=%s)\\n' \\
    "${FAKE_TORCH% *}" "${FAKE_TORCH#* }" > "$FAKE_DIR/torch/__init__.py"
  [ "$FAKE_TORCH" = "broken" ] && echo 'raise OSError("libcudart.so.12: cannot open shared object file")' \\
    > "$FAKE_DIR/torch/__init__.py"
  [ "$FAKE_TORCH" = "none" ] && rm -rf "$FAKE_DIR/torch"
  PYTHONPATH="$FAKE_DIR" exec "$REAL_PYTHON" -
fi
echo "memopd env ready (fake)"
"""


@pytest.mark.parametrize("torch_build, pinned", [("2.14.0+cu128 '12.8'", False), ("2.13.0+cu126 '12.6'", False),
                                                 ("2.15.0 None", False), ("2.13.0+cpu None", True),
                                                 ("2.12.1 None", True), ("none", True),
                                                 ("broken", False)])
def test_setup_keeps_a_cuda_or_newer_torch(tmp_path, torch_build, pinned):
    for name in ("envs", "pyproject.toml"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp_path / name)
    py = tmp_path / ".venv/bin/python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    env = {**os.environ, "LOG": str(tmp_path / "requirements.log"), "FAKE_TORCH": torch_build,
           "FAKE_DIR": str(tmp_path / "fake"), "REAL_PYTHON": sys.executable}
    out = subprocess.run(["bash", "envs/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    given = (tmp_path / "requirements.log").read_text()
    pin = next(x for x in (ROOT / "envs/requirements-cpu.txt").read_text().splitlines() if x.startswith("torch=="))
    assert (pin in given) is pinned, given
    assert "-e .[workflow,test,embedded,dense,frameworks]" in given  # the rest goes in either way
    assert ("keeping the installed torch" in out.stdout) is (not pinned)
    if torch_build == "broken":  # a CUDA torch whose import fails: kept, and the reason said
        assert "its import fails: OSError: libcudart.so.12" in out.stdout
