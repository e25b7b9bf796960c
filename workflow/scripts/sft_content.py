"""The SFT content experiment of the README ("What the tiny SFT models learn"), rerunnable.

Needs a finished main job (results/ with the tokenizer, the initial and pre-trained models, the SFT
examples, the corpus, the benchmarks and the retrieval index). Each variant = an optional pre-training stage
(or the main job's, "main") + SFT of a tiny model (student or teacher) with the config's `sft` section
overridden, then its held-out target loss and a greedy evaluation
on the first N held-out Q2 tasks (EM/F1, calls, invalid actions, the copy probe). Everything goes
under results/experiments/sft_content/ (one directory per variant, a CSV of all). Takes ~1.5 h on 2 cores:

    .venv/bin/python workflow/scripts/sft_content.py [--variants A B E3] [--tasks 100] [--seed 0]

(the README's S/T table was run with --seed 0: the seed also draws the held-out split)
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

R = Path("results")
OUT = R / "experiments/sft_content"
# name -> (role, pre-training: None, "main" (results/models/{role}_lm) or {lm_text, copy per_text, steps, lr},
#          the role's SFT overrides)
COPY600 = {"lm_text": False, "per_text": 2, "steps": 600, "lr": 2e-3}
VARIANTS = {
    "A": ("student", None, {"steps": 200}),
    "B": ("student", None, {"epochs": 3}),
    "C": ("student", {"lm_text": True, "per_text": 0, "steps": 400, "lr": 1e-3}, {"steps": 200}),
    "D": ("student", {"lm_text": True, "per_text": 1, "steps": 400, "lr": 1e-3}, {"steps": 200}),
    "E": ("student", COPY600, {"steps": 200}),
    "E2": ("student", COPY600, {"epochs": 1}),
    "E4": ("student", COPY600, {"epochs": 1, "lr": 4e-4}),
    "E3": ("student", COPY600, {"epochs": 2}),
    "S1": ("student", "main", {"epochs": 1}),
    "S2": ("student", "main", {"epochs": 2}),
    "S4": ("student", "main", {"epochs": 4}),
    "T1": ("teacher", "main", {"epochs": 1}),
    "T2": ("teacher", "main", {"epochs": 2, "lr": 6e-4}),
}
KEYS = ("em", "f1", "calls_per_episode", "invalid_action_rate", "answered_rate", "copy_f1", "copy_exact")


def memopd(*args: str) -> None:
    exe = Path(sys.executable).with_name("memopd")
    subprocess.run([str(exe), *args], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--tasks", type=int, default=100, help="held-out Q2 tasks evaluated")
    ap.add_argument("--seed", type=int, help="default: the config's seed")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    seed, rows = str(cfg["seed"] if args.seed is None else args.seed), []
    for name in args.variants:
        role, pre, sft_role = VARIANTS[name]
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        sft = copy.deepcopy(cfg["sft"])
        sft[role] = sft_role
        init = R / f"models/{role}_init"
        if pre == "main":
            init = R / f"models/{role}_lm"
        elif pre:
            sft["pretrain"] = {"lm_text": pre["lm_text"], "copy": {"per_text": pre["per_text"], "span": [8, 48]},
                               role: {"steps": pre["steps"], "lr": pre["lr"]}}
            memopd("sft", "lm-data", "--cfg", json.dumps(sft), "--seed", seed,
                   "--corpus", str(R / "retrieval/corpus.parquet"), "--tokenizer", str(R / "models/tokenizer"),
                   "--out", str(d / "lm.parquet"), "--stats", str(d / "lm.json"))
            memopd("sft", "train", "--stage", "pretrain", "--role", role, "--cfg", json.dumps(sft),
                   "--seed", seed, "--threads", "1", "--examples", str(d / "lm.parquet"), "--init", str(init),
                   "--out", str(d / "lm"))
            init = d / "lm"
        memopd("sft", "train", "--role", role, "--cfg", json.dumps(sft), "--seed", seed, "--threads", "1",
               "--examples", str(R / "sft/examples.parquet"), "--init", str(init), "--out", str(d / "sft"))
        memopd("sft", "eval", "--role", role, "--name", name, "--cfg", json.dumps(sft), "--seed", seed,
               "--threads", "1", "--model", str(d / "sft"), "--examples", str(R / "sft/examples.parquet"),
               "--out", str(d / "heldout.json"))
        ev_cfg = {k: cfg[k] for k in ("agent", "rollout", "eval")}
        memopd("eval", "--cfg", json.dumps(ev_cfg), "--seed", seed, "--model", str(d / "sft"),
               "--benchmark", str(R / "benchmarks/q2_test.parquet"), "--index", str(R / "retrieval/index"),
               "--out-dir", str(d), "--limit", str(args.tasks))
        ev, held = (json.loads((d / f).read_text()) for f in ("q2_test.json", "heldout.json"))
        info = json.loads((d / "sft/memopd_model.json").read_text())
        rows.append({"variant": name, "role": role, "pretrain": json.dumps(pre), "sft": json.dumps(sft_role),
                     "pretrain_seconds": info.get("pretrain", {}).get("train_seconds", 0.0),
                     "sft_seconds": info["sft"]["train_seconds"], "heldout_target_loss": held["heldout_target_loss"],
                     "tasks": ev["episodes"], **{k: ev[k] for k in KEYS}})
        print(json.dumps(rows[-1]))
    with open(OUT / "variants.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {OUT / 'variants.csv'}")


if __name__ == "__main__":
    main()
