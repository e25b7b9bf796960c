"""The test suite under the README's `pytest -n 2 --dist loadfile`: a file's tests share one worker (a module
fixture is built once), and `slurm` tests of different files take turns (tests/conftest.py's lock)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

HERE = Path(__file__).parent

# each file: a module fixture used by 6 tests, and 2 slurm tests that log when they run
FILE = '''
import os
import time
import pytest

@pytest.fixture(scope="module")
def built():
    with open("built_{name}.log", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_fixture(built, i):
    pass

@pytest.mark.slurm
@pytest.mark.parametrize("i", range(2))
def test_cluster(i):
    start = time.time()
    time.sleep(1.0)
    with open("slurm.log", "a") as f:
        f.write(f"{{start}} {{time.time()}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
'''


def test_a_file_shares_a_worker_and_slurm_tests_take_turns(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: x\n    gpu: x\n")
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(FILE.format(name=name))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "16 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("a", "b"):
        assert len((tmp_path / f"built_{name}.log").read_text().split()) == 1  # built once
    runs = sorted(tuple(float(x) for x in line.split()[:2]) for line in (tmp_path / "slurm.log").read_text().splitlines())
    workers = {line.split()[2] for line in (tmp_path / "slurm.log").read_text().splitlines()}
    assert len(runs) == 4 and workers == {"gw0", "gw1"}  # both workers ran slurm tests ...
    assert all(end <= next_start for (_, end), (next_start, _) in pairwise(runs))  # ... never two at once
