"""`memopd`'s command line: every help text as recorded in tests/data/cli_help/ (tests/cli_help.py writes them),
and bad input (a missing file, config section or key, a wrong type) refused by every command in one line with
exit status 2, before any model loads and without writing anything.

Fast: the parser, and each command up to its first check.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_help import HELP_DIR, commands, file_name, help_texts
from memopd.cli import build_parser, main
from memopd.inputs import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# commands that read no file and need no config section: a --cfg of the wrong type is their bad input
NOTHING_TO_MISS = {("bench", "packing"), ("bench", "opd-memory"), ("bench", "index")}


def test_every_help_text_is_as_recorded():
    texts = help_texts()
    recorded = {p.name: p.read_text() for p in HELP_DIR.glob("*.txt")}
    assert set(texts) == set(recorded)
    for name, text in texts.items():
        assert text == recorded[name], f"{name} differs from {HELP_DIR / name} (python tests/cli_help.py rewrites it)"


def _leaves() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    def has_subcommands(p):
        return any(isinstance(a, argparse._SubParsersAction) for a in p._actions)

    return [(path, p) for path, p in commands(build_parser()) if path and not has_subcommands(p)]


def _bad_argv(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    """The command with its required arguments filled: paths under missing/ (never created), the first of
    the choices, 1 for a number; --cfg '{}', or '[]' where nothing else can be missing."""
    argv = [*path, "--cfg", "[]" if path in NOTHING_TO_MISS else "{}"]
    for a in parser._actions:
        if not a.required:
            continue
        value = a.choices[0] if a.choices else "1" if a.type in (int, float) else f"missing/{a.dest}"
        argv += [a.option_strings[0], value] if a.option_strings else [value]
    return argv


LEAVES = _leaves()


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(path, parser, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative defaults (results/..., data) point inside the empty tmp_path
    with pytest.raises(SystemExit) as e:
        main(_bad_argv(path, parser))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert e.value.code == 2, err
    assert lines and lines[-1].startswith(f"memopd {' '.join(path)}: "), err
    assert any(w in lines[-1] for w in ("no such file: ", "not found", "config", "--cfg")), lines[-1]  # names it
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,said", [
    (["eval", "--model", "nothing/model", "--benchmark", "x.parquet", "--index", "nothing/index", "--out-dir", "o"],
     "memopd eval: config has no section 'rollout' (give --cfg with it)"),
    (["plan", "--config", "nothing.yaml"], "memopd plan: no such file: nothing.yaml"),
    (["plan", "--config", str(ROOT / "config/config.yaml"), str(ROOT / "tests/data/plan/unknown_method.yaml"), "--out",
      "p.csv"], "memopd plan: config train.methods.1: 'memopdd' is not one of ['ppo', 'memopd'"),
    (["plan", "--config", str(ROOT / "tests/data/plan/malformed.yaml"), "--out", "p.csv"],
     "memopd plan: " + str(ROOT / "tests/data/plan/malformed.yaml") + ": malformed YAML at line 4, column 8"),
    (["audit", "alignment", "--cfg", '{"dtype": "float32", "clip": 0.2, "backends": []}', "--model", "nothing/model",
      "--episodes", "e.parquet", "--out", "t.csv"], "memopd audit alignment: no such file: nothing/model"),
    (["tokenizer", "--cfg", "{bad", "--out", "tok"], "memopd tokenizer: --cfg is not valid JSON"),
])
def test_a_user_sees_one_line_and_no_traceback(argv, said, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("MEMOPD_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "memopd.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(said), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_memopd_traceback_shows_where_bad_input_was_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMOPD_TRACEBACK", "1")
    with pytest.raises(ConfigError, match="vocab_size"):
        main(["tokenizer", "--out", "tok"])


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """Only bad input is reported in one line: a KeyError inside a step is a bug and propagates."""
    import memopd.retrieval.steps as steps

    def search_step(index, queries, k):
        raise KeyError("backend")

    monkeypatch.setattr(steps, "search_step", search_step)
    with pytest.raises(KeyError):
        main(["retrieval", "search", "--index", str(tmp_path), "who"])
