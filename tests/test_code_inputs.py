"""A pipeline step reruns exactly when the code it runs changes (memopd.codegraph, workflow/rules/common.smk code()).

* The closure is checked on a made-up package whose answer is known, and against the standard library's
  modulefinder (an independent reading of the same imports) on every module of memopd.
* Every rule names the command its shell runs; every memopd module that running the command imports (a dry
  invocation: the command up to its first check of its inputs) lies in the closure.
* A one-line change of the training code changes the code param of the training rule and of no audit; a change of
  the audit steps changes no training rule.
"""
from __future__ import annotations

import json
import modulefinder
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memopd.codegraph import closure, code_hash, command_hash, command_targets, module_files, registration

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
RULES = ROOT / "workflow" / "rules"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def made_up(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg import b\n\n\ndef f():\n    from pkg.sub import c\n    return helper()\n\n\n"
                    "def helper():\n    from . import e\n\n\ndef g():\n    import pkg.d\n",
        "pkg/b.py": "X = 1\n",
        "pkg/d.py": "import pkg.b\n",
        "pkg/e.py": "def late():\n    from pkg.sub.deep import y\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..b import X\n",
        "pkg/sub/deep.py": "y = 0\n",
        "pkg/unused.py": "import pkg.a\n",
    })
    return tmp_path


def test_closure_of_a_made_up_package(made_up):
    mods = module_files(made_up, "pkg")
    # f reaches c (its own import), e (through helper) and e's function-level import of sub.deep; not g's d
    assert closure("pkg.a:f", mods) == {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.e", "pkg.sub.deep"}
    assert closure("pkg.a:g", mods) == {"pkg", "pkg.a", "pkg.b", "pkg.d"}
    assert closure("pkg.a", mods) == {"pkg", "pkg.a", "pkg.b", "pkg.d", "pkg.e", "pkg.sub", "pkg.sub.c", "pkg.sub.deep"}
    with pytest.raises(KeyError, match="no function nope"):
        closure("pkg.a:nope", mods)


def test_code_hash_follows_the_closure_and_only_it(made_up):
    h = code_hash("pkg.a:f", made_up, "pkg")
    (made_up / "pkg/d.py").write_text("import pkg.b  # g's dependency only\n")
    assert code_hash("pkg.a:f", made_up, "pkg") == h  # f never imports d
    (made_up / "pkg/a.py").write_text((made_up / "pkg/a.py").read_text().replace("import pkg.d", "import pkg.d  # x"))
    assert code_hash("pkg.a:f", made_up, "pkg") == h  # another function of f's own module
    (made_up / "pkg/sub/deep.py").write_text("y = 1\n")
    assert code_hash("pkg.a:f", made_up, "pkg") != h  # deep in the closure
    h2 = code_hash("pkg.a:f", made_up, "pkg")
    (made_up / "pkg/a.py").write_text((made_up / "pkg/a.py").read_text().replace("return helper()", "return helper() or 1"))
    assert code_hash("pkg.a:f", made_up, "pkg") != h2  # f itself


def test_a_commands_argument_defaults_are_part_of_its_hash(made_up):
    """command_hash: the function's closure and the statements registering the command's arguments; another
    command's registration in the same function is not part of it."""
    _write(made_up, {"pkg/commands.py": (
        "def f():\n    from pkg import b\n\n\ndef g():\n    import pkg.d\n\n\ndef register(cli):\n"
        "    sp = cli.add(\"run f\", f, \"f\")\n    sp.add_argument(\"--stage\", default=\"sft\")\n"
        "    sp = tracked(cli.add(\"run g\", g, \"g\"))\n    sp.add_argument(\"--n\", default=3)\n")})
    assert registration("run f", made_up, "pkg").splitlines() == [
        'sp = cli.add("run f", f, "f")', 'sp.add_argument("--stage", default="sft")']
    assert "--n" in registration("run g", made_up, "pkg") and registration("run h", made_up, "pkg") == ""
    f, g = command_hash("run f", made_up, "pkg"), command_hash("run g", made_up, "pkg")
    assert f.startswith("pkg.commands:f@") and g.startswith("pkg.commands:g@")
    text = (made_up / "pkg/commands.py").read_text()
    (made_up / "pkg/commands.py").write_text(text.replace('default="sft"', 'default="pretrain"'))
    assert command_hash("run f", made_up, "pkg") != f and command_hash("run g", made_up, "pkg") == g
    (made_up / "pkg/commands.py").write_text(text.replace("default=3", "default=4"))
    assert command_hash("run f", made_up, "pkg") == f and command_hash("run g", made_up, "pkg") != g


def test_the_trajectory_chunks_fingerprint_the_code_that_plays_them():
    from memopd.teachers.shards import PLAYER, code_digest

    mods = module_files(SRC)
    assert {"memopd.agent.rollout", "memopd.retrieval", "memopd.data.compose", "memopd.records"} <= closure(PLAYER, mods)
    assert code_digest() == code_hash(PLAYER, SRC)


def test_closure_agrees_with_modulefinder():
    """Whole modules: the closure is what the standard library's modulefinder finds of the package (it reads the
    bytecode's imports, function-level ones included), searching only src/ so that third-party packages are not
    scanned."""
    mods = module_files(SRC)
    for name in mods:
        finder = modulefinder.ModuleFinder(path=[str(SRC)])
        finder.import_hook(name)
        found = {m for m in finder.modules if m == "memopd" or m.startswith("memopd.")}
        assert closure(name, mods) == found, name


def _rules() -> dict[str, tuple[str | None, str | None]]:
    """rule -> (the command its code param names, the memopd command its shell runs)."""
    out = {}
    for smk in sorted(RULES.glob("*.smk")):
        for block in re.split(r"^(?=(?:rule|use rule) )", smk.read_text(), flags=re.M)[1:]:
            name = re.match(r"(?:use rule \w+ as |rule )(\w+)", block).group(1)
            code = re.search(r'code=code\("([^"]+)"\)', block)
            shell = re.search(r'"\{params\.(?:memopd|launch)\} ([a-z][\w -]*?) --', block)
            out[name] = (code and code.group(1), shell and shell.group(1))
    return out


def test_every_rule_names_the_command_it_runs():
    commands = command_targets(SRC)
    rules = _rules()
    assert len(rules) > 25
    for rule, (code, shell) in rules.items():
        if rule.startswith("audit_rule_episodes"):  # `use rule audit_episodes`: inherits its params and shell
            continue
        if shell is None or rule == "prefetch":  # no memopd command / the downloader (prefetch.smk says why)
            assert code is None, rule
            continue
        assert code == shell, (rule, code, shell)
        assert code in commands, (rule, code)


def _dry_imports(argv: list[str]) -> set[str]:
    """The memopd modules imported by running the command until it refuses its (missing) inputs, minus those that
    building the parser imports (the CLI's assembly)."""
    script = ("import json, sys\nfrom memopd.cli import build_parser, main\nbuild_parser()\n"
              "before = set(sys.modules)\ntry:\n    main(json.loads(sys.argv[1]))\nexcept SystemExit:\n    pass\n"
              "print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith('memopd'))))\n")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(argv)], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_what_a_command_imports_lies_in_its_closure(tmp_path):
    from test_cli import LEAVES, _bad_argv

    mods, commands = module_files(SRC), command_targets(SRC)
    used = {code for code, _ in _rules().values() if code}
    argvs = {" ".join(path): _bad_argv(path, parser) for path, parser in LEAVES if " ".join(path) in used}
    assert set(argvs) == used
    for command, argv in argvs.items():
        imported = _dry_imports([a.replace("/nonexistent", str(tmp_path / "missing")) for a in argv])
        assert imported <= closure(commands[command], mods), (command, imported - closure(commands[command], mods))


def _hashes(src: Path) -> dict[str, str]:
    commands = command_targets(src)
    return {rule: code_hash(commands[code], src) for rule, (code, _) in _rules().items() if code}


def test_a_change_reruns_the_steps_that_run_it_and_no_other(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    before = _hashes(src)

    def changed_after(path: str) -> set[str]:
        f = src / "memopd" / path
        f.write_text(f.read_text() + "\nONE_MORE_LINE = 1\n")
        after = _hashes(src)
        return {rule for rule in before if after[rule] != before[rule]}

    training = changed_after("train/update.py")
    assert "train" in training and not any(r.startswith("audit") or r.startswith("sft") for r in training), training
    before = _hashes(src)
    audits = changed_after("audit/steps.py")
    assert "train" not in audits and {"audit_alignment", "audit_state_corruption"} <= audits, audits
    before = _hashes(src)
    assert changed_after("plan/report.py") == {"plan"}
