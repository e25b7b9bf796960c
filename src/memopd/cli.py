"""`memopd` command line: one subcommand per pipeline step (the Snakemake rules call these).

Each step takes its configuration as `--cfg JSON` (the rule passes its section of the validated
Snakemake config) and records that configuration in what it writes.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path


def _write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def _write_csv(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def cmd_tokenizer(args, cfg):
    from memopd.data import corpus_texts
    from memopd.models import train_tokenizer

    tok = train_tokenizer(corpus_texts(args.data_dir), cfg["vocab_size"], args.out, cfg.get("min_frequency", 2))
    _write_json(Path(args.out) / "memopd_tokenizer.json", {"config": cfg, "data_dir": args.data_dir, "size": len(tok)})
    print(f"tokenizer: {len(tok)} tokens -> {args.out}")


def cmd_model_init(args, cfg):
    from memopd.models import init_model

    info = init_model(cfg, args.out, seed=args.seed, tokenizer_path=args.tokenizer, offline=not args.online)
    print(f"model: {info['architecture']} with {info['params']:,} parameters -> {args.out}")


def _token_pool(tokenizer_dir: str, data_dir: str, n_texts: int = 200) -> list[int]:
    """Real token ids: the first texts of the committed corpus through the real tokenizer."""
    from itertools import islice

    from memopd.data import corpus_texts
    from memopd.models import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    return [i for text in islice(corpus_texts(data_dir), n_texts) for i in tok(text)["input_ids"]]


def cmd_rce(args, cfg):
    import torch

    from memopd.models import load_model
    from memopd.rce import rce_report, report_rows
    from memopd.synthetic import RULES, random_episode

    torch.manual_seed(args.seed)
    model = load_model(args.model, dtype=cfg["dtype"], device=args.device)
    pool = _token_pool(args.model, args.data_dir)
    rng = random.Random(args.seed)
    rules = cfg.get("rules", list(RULES))
    episodes = [
        random_episode(rng, pool, rules[i % len(rules)], cfg["calls"], cfg["prefix_tokens"],
                       tuple(cfg["observation_tokens"]), tuple(cfg["response_tokens"]), task_id=f"smoke{i}-{rules[i % len(rules)]}")
        for i in range(cfg["episodes"])
    ]
    report = rce_report(model, episodes, cfg["backends"], dtype=cfg["dtype"], tolerance=cfg.get("tolerance"))
    report["config"] = {**cfg, "seed": args.seed, "model": args.model}
    _write_json(args.out, report)
    _write_csv(Path(args.out).with_suffix(".csv"), report_rows(report))
    for name, r in report["backends"].items():
        print(f"{name:14s} max|dlogp| {r['max_abs_dlogp']:.2e}  p99 {r['p99_abs_dlogp']:.2e}  "
              f"max|dlogit| {r['max_abs_dlogit']:.2e}  top1 {r['top1_agreement']:.3f}  "
              f"tokens {r['action_tokens']}  {'PASS' if r['passed'] else 'FAIL'}")
    if not report["passed"] and args.strict:
        sys.exit(f"RCE failed (tolerance {report['tolerance']:g}); report in {args.out}")


def cmd_bench_packing(args, cfg):
    from memopd.audit.packing_bench import run_sweep

    rows = run_sweep(cfg, seed=args.seed, repeats=args.repeats)
    if args.out:
        _write_csv(args.out, rows)
        print(f"wrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memopd", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, fn, help, parent=sub):
        sp = parent.add_parser(name, help=help)
        sp.add_argument("--cfg", default="{}", help="JSON configuration of this step (a section of config.yaml)")
        sp.add_argument("--seed", type=int, default=0)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("tokenizer", cmd_tokenizer, "train the offline byte-level BPE tokenizer on data/")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True)

    model = sub.add_parser("model", help="model checkpoints").add_subparsers(dest="model_command", required=True)
    sp = add("init", cmd_model_init, "create a model directory (tiny from config, or pretrained by name)", model)
    sp.add_argument("--tokenizer", help="tokenizer directory (tiny models)")
    sp.add_argument("--online", action="store_true", help="allow downloads from the hub (paper scale)")
    sp.add_argument("--out", required=True)

    sp = add("rce", cmd_rce, "RCE smoke report: packed vs independent calls, every backend")
    sp.add_argument("--model", required=True)
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out", required=True, help="JSON report (a CSV is written beside it)")
    sp.add_argument("--strict", action="store_true", help="exit non-zero when any backend fails")
    sp.add_argument("--device", default="cpu", help="torch device of the model (cuda at paper scale)")

    bench = sub.add_parser("bench", help="benchmarks that print figures").add_subparsers(dest="bench_command", required=True)
    sp = add("packing", cmd_bench_packing, "packing benchmark: 9 configurations, every exact path, with RCE", bench)
    sp.add_argument("--out", help="CSV file")
    sp.add_argument("--repeats", type=int, default=3)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        cfg = json.loads(args.cfg)
    except json.JSONDecodeError as e:
        sys.exit(f"--cfg is not valid JSON: {e}")
    args.fn(args, cfg)


if __name__ == "__main__":
    main()
