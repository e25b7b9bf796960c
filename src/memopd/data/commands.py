"""`memopd benchmarks` (compose the Q_n and Wiki-RAG tasks, config section `benchmarks`), `memopd kb` (the
controlled study's synthetic knowledge base, config section `kb`) and `memopd fetch` (one data file from the
hub, paper scale)."""
from __future__ import annotations

from memopd.inputs import require


def cmd_benchmarks(args, cfg):
    from memopd.data.steps import build_benchmarks

    build_benchmarks(cfg, args.data_dir, args.seed, args.out_dir, args.stats)


def cmd_kb(args, cfg):
    from memopd.config import KBConfig
    from memopd.data.kb import write

    require(cfg, "people", "first_names", "surnames", "values", where="kb")
    counts = write(KBConfig.from_dict(cfg), args.seed, args.out_dir)
    print(f"knowledge base: {counts} -> {args.out_dir}")


def cmd_fetch(args, cfg):
    from memopd.data.hub import fetch_file
    from memopd.prefetch import FETCH_REPO_TYPE

    require(cfg, "repo", "file")
    fetch_file(cfg["repo"], cfg["file"], args.out, repo_type=cfg.get("repo_type", FETCH_REPO_TYPE),
               revision=cfg.get("revision"))
    print(f"fetched {cfg['repo']}/{cfg['file']} -> {args.out}")


def register(cli) -> None:
    sp = cli.add("fetch", cmd_fetch, "download a data file from the hub (paper scale; --cfg {repo, file, ...})")
    sp.add_argument("--out", required=True)

    sp = cli.add("kb", cmd_kb, "generate the controlled study's knowledge base (config section `kb`)")
    sp.add_argument("--out-dir", required=True, help="passages.jsonl, {train,dev,test}.jsonl, kb.json")

    sp = cli.add("benchmarks", cmd_benchmarks, "compose Q_n and Wiki-RAG tasks (config section `benchmarks`)")
    sp.add_argument("--data-dir", default="data")
    sp.add_argument("--out-dir", default="results/benchmarks", help="one {benchmark}_{split}.parquet per task set")
    sp.add_argument("--stats", default="results/tables/benchmark_stats.csv")
