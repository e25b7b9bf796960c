"""Diagnosis of the matched control (docs/study.md "Status"): how well does a model act when its input is
the persistent-history flattening, the state `memopd_persistent`'s teacher is scored on? It evaluates the model
with the config's `eval` settings and one change, `agent.view: persistent` (each call shown the transcript of the
episode's exact states and responses so far: the packing compiler's persistent layout), by the same `memopd eval`
command as rule eval. `--rule` also replaces the memory rule (e.g. full_retention, every earlier output and
observation kept). Compare with results/eval/MODEL/BENCHMARK.json, the same model on its own exact states.

    python workflow/scripts/flattened_eval.py --configfile config/study/base.yaml --results results/study/results \
        --model teacher_sft --benchmark q2_test --out-dir /tmp/flattened
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

from memopd.config import eval_job_config
from memopd.plan.models import load_config


def eval_cfg(cfg: dict, benchmark: str, view: str = "persistent", rule: str | None = None) -> str:
    """What rule eval passes (workflow/rules/common.smk eval_cfg), with the agent's view (and memory rule) replaced."""
    return json.dumps(eval_job_config(cfg, benchmark, view=view, rule=rule or cfg["agent"]["rule"]), sort_keys=True)


def searches_per_episode(episodes: Path) -> dict[int, int]:
    """{searches: episodes} of an evaluation's episodes (its .episodes.parquet: one row per call)."""
    calls = pd.read_parquet(episodes, columns=["episode", "metrics"])
    first = calls.groupby("episode")["metrics"].first()
    counts = Counter(int((json.loads(m) if isinstance(m, str) else m)["searches"]) for m in first)
    return dict(sorted(counts.items()))


def summary(res: dict, episodes: Path) -> str:
    keys = ("f1", "em", "calls_per_episode", "answered_rate", "invalid_action_rate")
    return ", ".join(f"{k} {res[k]:.3f}" for k in keys) + f"; episodes by searches {searches_per_episode(episodes)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", required=True, nargs="+",
                    help="the config file(s) the models were built with (merged in order, as Snakemake merges them)")
    ap.add_argument("--results", required=True, help="that workflow's results/ directory")
    ap.add_argument("--model", required=True, help="a model under RESULTS/models/")
    ap.add_argument("--benchmark", default="q2_test")
    ap.add_argument("--view", default="persistent", help="what the model is shown: persistent | exact")
    ap.add_argument("--rule", help="the memory rule to evaluate under (default: the config's)")
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    cfg = load_config(a.configfile)
    res = Path(a.results)
    cmd = [sys.executable, "-m", "memopd.cli", "eval", "--cfg", eval_cfg(cfg, a.benchmark, a.view, a.rule),
           "--seed", str(cfg["seed"]), "--model", str(res / "models" / a.model),
           "--benchmark", str(res / "benchmarks" / f"{a.benchmark}.parquet"), "--index", str(res / "retrieval" / "index"),
           "--out-dir", str(Path(a.out_dir) / a.model)]
    subprocess.run(cmd, check=True)
    out = Path(a.out_dir) / a.model / a.benchmark
    print(f"{a.model} on {a.benchmark}, view {a.view}, rule {a.rule or cfg['agent']['rule']}: "
          + summary(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".episodes.parquet")))
    own = res / "eval" / a.model / a.benchmark
    if own.with_suffix(".json").exists():
        print(f"{a.model} on {a.benchmark} under its own rule ({cfg['agent']['rule']}): "
              + summary(json.loads(own.with_suffix(".json").read_text()), own.with_suffix(".episodes.parquet")))


if __name__ == "__main__":
    main()
