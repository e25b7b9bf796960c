"""The training-curves figure: per method the mean over seeds and the min-max band of each quantity, from
the runs' metrics.jsonl (keys as train/loop.py writes them); `memopd report curves` writes the PNG and each
run's trend table (block means against numpy, verdicts on series whose shape is known)."""
import json
import random

import numpy as np
import pytest

from memopd.report.curves import PANELS, curve, load_runs, trend, trend_rows


def _run(path, method, seed, steps, opd=True):
    lines = []
    for s in range(steps):
        m = {"step": s, "method": method, "seed": seed, "reward/task": 0.1 * s + seed, "rollout/invalid_rate": 0.5,
             "ppo/clipfrac": 0.01 * seed, "reward/f1": 0.2}
        if opd:
            m["opd/loss"] = 1.0 / (s + 1)
        lines.append(json.dumps(m))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(reversed(lines)) + "\n")  # any line order: sorted by step
    return path


def test_mean_and_band_over_seeds(tmp_path):
    paths = [_run(tmp_path / f"memopd/seed{s}/metrics.jsonl", "memopd", s, 3) for s in (0, 1, 2)]
    paths.append(_run(tmp_path / "ppo/seed0/metrics.jsonl", "ppo", 0, 2, opd=False))
    runs = load_runs(paths)
    assert sorted(runs) == ["memopd", "ppo"] and sorted(runs["memopd"]) == [0, 1, 2]
    c = curve(runs["memopd"], "reward/task")
    assert c["step"] == [0, 1, 2] and c["seeds"] == 3
    assert c["mean"] == pytest.approx([1.0, 1.1, 1.2]) and c["min"] == pytest.approx([0.0, 0.1, 0.2])
    assert c["max"] == pytest.approx([2.0, 2.1, 2.2])
    assert curve(runs["ppo"], "opd/loss") is None  # ppo scores no teacher
    assert {k for k, _ in PANELS} == {"reward/task", "rollout/invalid_rate", "opd/loss", "ppo/clipfrac"}


def test_cli_writes_the_figure_without_tracking(tmp_path, capsys, monkeypatch):
    from PIL import Image

    from memopd.cli import main

    monkeypatch.setenv("MEMOPD_LABEL", "Controlled study (x)")  # what the workflow sets from config `label`

    paths = [_run(tmp_path / f"{m}/seed{s}/metrics.jsonl", m, s, 2, opd=m != "ppo")
             for m in ("ppo", "memopd") for s in (0, 1)]
    fig = tmp_path / "figures/training_curves.png"
    main(["report", "curves", "--cfg", json.dumps({"benchmark": "q2_train"}), "--metrics", *map(str, paths),
          "--figure", str(fig), "--table", str(tmp_path / "tables/training_curves.csv"), "--reward", "em"])
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(fig).text["Title"].startswith("Controlled study (x): Training curves on q2_train")
    out = capsys.readouterr().out
    assert "tracking: off" in out and "opd/loss" in out and "memopd 1 -> 0.5" in out
    assert "panels: task reward (EM - invalid penalty); invalid-action rate" in out  # the score trained on


def test_the_curves_rule_reads_every_main_run():
    """`results/figures/training_curves.png` (in `all`) reads the metrics of train.methods x train.seeds and
    names agent.reward in the reward panel (EM on the embedded default, whose agent.reward is em)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "-n", "-p", "--forceall",
                          "results/figures/training_curves.png"], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    block = res.stdout[res.stdout.index("rule training_curves:"):].split("\n\n")[0]
    inputs = next(line for line in block.splitlines() if line.strip().startswith("input:"))
    cfg = yaml.safe_load((root / "config/config.yaml").read_text())["train"]
    want = {f"results/train/{m}/seed{s}/metrics.jsonl" for m in cfg["methods"] for s in cfg["seeds"]}
    assert {p for p in inputs.split("input:")[1].replace(",", " ").split() if p.endswith("metrics.jsonl")} == want
    assert "results/tracking/store.json" in inputs
    reward = yaml.safe_load((root / "config/config.yaml").read_text())["agent"]["reward"]
    assert f" --reward {reward} " in res.stdout + res.stderr  # the reward panel names the score trained on


def _series(shape, n=300, seed=0):
    rng = random.Random(seed)
    return [shape(i) + rng.uniform(-0.05, 0.05) for i in range(n)]


def test_trend_block_means_and_verdicts():
    v = _series(lambda i: 0.3 * min(i, 100) / 100)  # rises over 100 steps, then flat
    t = trend(v)
    assert t["block_steps"] == 50
    assert t["first"] == pytest.approx(np.mean(v[:50])) and t["last"] == pytest.approx(np.mean(v[-50:]))
    assert t["rise"] == pytest.approx(np.mean(v[-50:]) - np.mean(v[:50]))
    assert t["end"] == pytest.approx(np.mean(v[-50:]) - np.mean(v[-100:-50]))
    assert t["rise_ci_low"] < t["rise"] < t["rise_ci_high"] and t["end_ci_low"] < t["end"] < t["end_ci_high"]
    assert t["verdict"] == "rises, flat at the end"
    assert trend(_series(lambda i: i / 300))["verdict"] == "rises, still rising"
    assert trend(_series(lambda i: 1 - i / 300))["verdict"] == "falls, still falling"
    assert trend(_series(lambda i: 0.2 * max(0, i - 200) / 100, seed=1))["verdict"] == "rises, still rising"
    assert trend([0.25] * 300)["verdict"] == "no rise, flat at the end"  # an interval of one point, at 0
    assert trend(_series(lambda i: 0.2, seed=2))["verdict"] == "no rise, flat at the end"
    assert trend(list(range(12)))["block_steps"] == 2  # 12 // 6
    assert trend([0.1, 0.2])["verdict"] == "too few steps (2)"
    assert trend([0.1, 0.2, 0.3])["verdict"] == "no interval (1 step per block)"


def test_trend_rows_per_run(tmp_path):
    paths = [_run(tmp_path / f"{m}/seed{s}/metrics.jsonl", m, s, 12, opd=m != "ppo")
             for m in ("memopd", "ppo") for s in (1, 0)]
    rows = trend_rows(load_runs(paths))
    assert [(r["method"], r["seed"]) for r in rows] == [("ppo", 0), ("ppo", 1), ("memopd", 0), ("memopd", 1)]
    memopd0 = rows[2]
    assert memopd0["steps"] == 12 and memopd0["block_steps"] == 2
    assert memopd0["first"] == pytest.approx(0.05) and memopd0["last"] == pytest.approx(1.05)  # 0.1 * step
    assert memopd0["opd_kl_first"] == pytest.approx((1 + 1 / 2) / 2)
    assert memopd0["opd_kl_last"] == pytest.approx((1 / 11 + 1 / 12) / 2)
    assert memopd0["invalid_first"] == 0.5 and rows[0]["opd_kl_first"] != rows[0]["opd_kl_first"]  # ppo: NaN
    assert all(r["verdict"] == "rises, still rising" for r in rows)


def test_cli_writes_the_trend_table(tmp_path, capsys):
    from memopd.cli import main

    paths = [_run(tmp_path / f"{m}/seed{s}/metrics.jsonl", m, s, 12, opd=m != "ppo")
             for m in ("ppo", "memopd") for s in (0, 1)]
    cfg = {"benchmark": "q2_train", "student": "student_sft", "teacher": "teacher_sft", "steps": 12, "batch_tasks": 4,
           "methods": ["ppo", "memopd"], "seeds": [0, 1], "horizons": {"q2_test": "Q2"}}  # a whole train section
    table = tmp_path / "tables/training_curves.csv"
    main(["report", "curves", "--cfg", json.dumps(cfg), "--metrics", *map(str, paths),
          "--figure", str(tmp_path / "curves.png"), "--table", str(table), "--reward", "em"])
    assert table.read_text().splitlines()[0].startswith("method,seed,steps,block_steps,first,last,rise,")
    md = table.with_suffix(".md").read_text()
    assert "student student_sft, teacher teacher_sft, 12 steps x 4 tasks of q2_train, seeds [0, 1]" in md
    assert "ppo: 2 of 2 runs rise, 0 of 2 are flat at the end" in md
    assert "rises, still rising" in capsys.readouterr().out
