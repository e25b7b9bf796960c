"""The package's layer order: every module imports only from floors below its own (or from its own unit), so
no package reaches up into one that builds on it, and the packages on one floor (sft and train among them)
know nothing of each other.

A unit is a top-level module (memopd/stats.py: `stats`) or a subpackage (memopd/train/: `train`). The floors,
lowest first:

  0 atomic files   atomic (a file or directory written beside its target and renamed onto it, whole or not at
                   all; the standard library only: every floor writes through it)
  1 foundations    records, cost, losses, metrics, methods, inputs, codegraph, stats, dist, checkpoint,
                   progress, outputs (JSON, tables and figures as every step writes them), spool (a run's tracking
                   records on disk and their sender) and the package's own __init__ (no memopd import at all)
  2 config         config (the typed config sections, each default declared once; no torch)
  3 models         models (the tokenizer, tiny and pretrained models, built from their typed sections)
  4 layout         packing, vocab, schema (the workflow's config schema outside Snakemake), tracking (MLflow
                   runs, through the spool), ledger (the exact call ledger: a rollout's calls in a portable file)
  5 hub            prefetch
  6 exact forward  attention
  7 on the forward rce, parallel
  8 run harness    harness (identity, resume, checkpoints, the step loop and export of every trainer)
  9 data           data
 10 corpora        retrieval, synthetic
 11 agent          agent (protocol, memory rules, the rollout loop)
 12 generation     generation (the engines the agent samples with, the training engine's weight sync)
 13 teachers, evaluation  teachers (scripted, LLM, the trajectory step), evaluation
 14 trainers       sft, train
 15 audits, plans  audit, plan
 16 reports        report (the tables and figures over runs, audits and plans)
 17 study rules    study (the controlled study's decision rules, over evaluations and their reports)
  top              cli, __main__ and every module named `commands` (memopd.commands, sft.commands, ...): they
                   may import anything, and nothing below the top may import them

Imports are read with `ast` from the source (nothing is imported), inside functions too: the package imports
lazily, so a function-level import is as much a dependency as a top-level one.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "memopd"

FLOORS = [
    ("atomic files", {"atomic"}),
    ("foundations", {"memopd", "records", "cost", "losses", "metrics", "methods", "inputs", "codegraph",
                     "stats", "dist", "checkpoint", "progress", "outputs", "spool"}),
    ("config", {"config"}),
    ("models", {"models"}),
    ("layout", {"packing", "vocab", "schema", "tracking", "ledger"}),
    ("hub", {"prefetch"}),
    ("exact forward", {"attention"}),
    ("on the forward", {"rce", "parallel"}),
    ("run harness", {"harness"}),
    ("data", {"data"}),
    ("corpora", {"retrieval", "synthetic"}),
    ("agent", {"agent"}),
    ("generation", {"generation"}),
    ("teachers, evaluation", {"teachers", "evaluation"}),
    ("trainers", {"sft", "train"}),
    ("audits, plans", {"audit", "plan"}),
    ("reports", {"report"}),
    ("study rules", {"study"}),
]
TOP_NAMES = {"cli", "commands", "__main__"}  # modules of the top floor, by their last name
TOP = len(FLOORS)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the longest existing module the statement names)
    file: str  # the importing file, relative to the repository
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _named(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> tuple[list[str], list[str]]:
    """(names that must be modules, names that are modules if they exist) of one import statement."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names], []
    base = node.module or ""
    if node.level:
        parts = here.split(".") if is_package else here.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [base], [f"{base}.{a.name}" for a in node.names]


def imports(mods: dict[str, Path], src: Path = SRC) -> tuple[list[Import], list[str]]:
    """Every import of a package module by another (the package's own __init__, which every import runs,
    is no edge), and the imports naming a module that does not exist (`file:line: name`)."""
    found, missing = [], []
    for name, path in mods.items():
        file = path.relative_to(src.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            must, may = _named(node, name, path.name == "__init__.py")
            for target in must + [t for t in may if t in mods]:
                if not target.startswith(PACKAGE + "."):
                    continue
                if target not in mods:
                    missing.append(f"{file}:{node.lineno}: {target}")
                    while target not in mods:
                        target = target.rpartition(".")[0]
                if target not in (name, PACKAGE):
                    found.append(Import(name, target, file, node.lineno))
    return found, missing


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor(module: str) -> int | None:
    """The module's floor (TOP for cli, __main__ and commands modules); None: its unit has no floor."""
    if module.split(".")[-1] in TOP_NAMES:
        return TOP
    return next((n for n, (_, units) in enumerate(FLOORS) if unit(module) in units), None)


def floor_name(n: int) -> str:
    return "top" if n == TOP else f"{n} {FLOORS[n][0]}"


def against_the_order(imp: Import) -> bool:
    """An import up, or sideways (another unit of the same floor); a module of the top floor imports anything.
    Units without a floor are left to `test_every_unit_has_a_floor`."""
    src, dst = floor(imp.source), floor(imp.target)
    if src is None or dst is None:
        return False
    return not (src == TOP or (dst < TOP and unit(imp.source) == unit(imp.target)) or dst < src)


def violations(found: list[Import]) -> list[str]:
    """The imports against the layer order, each with its file, line and floors."""
    return [f"{i.where()}: {i.source} (floor {floor_name(floor(i.source))}) imports {i.target} (floor "
            f"{floor_name(floor(i.target))}): {'up' if floor(i.target) > floor(i.source) else 'sideways'}"
            for i in found if against_the_order(i)]


def cycles(found: list[Import]) -> list[list[str]]:
    """Import cycles between modules (strongly connected components of more than one module)."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, *imports(mods)


def test_every_unit_has_a_floor(graph):
    mods, _, _ = graph
    units, listed = {unit(m) for m in mods}, set().union(*(u for _, u in FLOORS))
    unplaced = sorted({unit(m) for m in mods if floor(m) is None})
    assert not unplaced, f"units without a floor (add them to FLOORS and the docstring of {Path(__file__).name}): {unplaced}"
    assert listed <= units, f"FLOORS names units that do not exist: {sorted(listed - units)}"


def test_no_import_goes_up_or_sideways(graph):
    _, found, _ = graph
    bad = violations(found)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle(graph):
    _, found, _ = graph
    comps = cycles(found)
    lines = [f"{' <-> '.join(c)}: " + ", ".join(f"{i.where()} {i.source} -> {i.target}" for i in found
                                              if i.source in c and i.target in c) for c in comps]
    assert not comps, "import cycles:\n" + "\n".join(lines)


def test_every_import_names_an_existing_module(graph):
    _, _, missing = graph
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_planted_imports(tmp_path):
    """A lower module importing a higher one, two packages of one floor, a function-level import, a module
    importing a commands module, a cycle, and a missing module are all named with their file and line."""
    pkg = tmp_path / "src" / PACKAGE
    for rel, text in {
        "__init__.py": "",
        "records.py": "def f():\n    from memopd.sft import trainer\n",  # floor 1 -> 11, inside a function
        "stats.py": "import memopd.dist\n",  # sideways on floor 1
        "dist.py": "from memopd import stats\n",  # and back: a cycle
        "sft/__init__.py": "",
        "sft/trainer.py": "from memopd.train.loop import run\n",  # sft -> train: sideways
        "sft/commands.py": "from memopd.train import loop\nfrom memopd.audit import steps\n",  # top: anything
        "train/__init__.py": "from memopd.train.commands import main\n",  # a package reaching its top module
        "train/loop.py": "from memopd.sft.gone import x\n",  # a module that does not exist
        "train/commands.py": "",
        "audit/__init__.py": "",
        "audit/steps.py": "from memopd.train import loop\n",  # down: fine
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    found, missing = imports(modules(tmp_path / "src"), tmp_path / "src")
    bad = {(i.file, i.line, i.target) for i in found if against_the_order(i)}
    assert bad == {("src/memopd/records.py", 2, "memopd.sft"), ("src/memopd/records.py", 2, "memopd.sft.trainer"),
                   ("src/memopd/stats.py", 1, "memopd.dist"),
                   ("src/memopd/dist.py", 1, "memopd.stats"), ("src/memopd/sft/trainer.py", 1, "memopd.train.loop"),
                   ("src/memopd/train/__init__.py", 1, "memopd.train.commands"),
                   ("src/memopd/train/loop.py", 1, "memopd.sft")}
    assert cycles(found) == [["memopd.dist", "memopd.stats"]]
    assert [m.split(": ")[1] for m in missing] == ["memopd.sft.gone"]
