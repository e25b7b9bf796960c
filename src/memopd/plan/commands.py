"""`memopd plan`: the config files merged, the plan printed (and written with --out), a refusal of what does not
fit."""
from __future__ import annotations

from pathlib import Path

from memopd.plan.models import load_config
from memopd.plan.report import failures, markdown, rows
from memopd.plan.stages import plan


def cmd_plan(args, cfg):
    import sys

    cfg = cfg or load_config(args.config or ["config/config.yaml"])
    if args.gpu_memory_gb is not None:
        cfg = {**cfg, "plan": {**(cfg.get("plan") or {}), "gpu_memory_gb": args.gpu_memory_gb}}
    jobs = plan(cfg, set(args.rules) if args.rules else None)
    text = markdown(cfg, jobs)
    print(text)
    if args.out:
        from memopd.outputs import write_csv

        write_csv(args.out, rows(jobs))
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    bad = failures(cfg, jobs)
    if bad:
        msg = "plan: does not fit:\n  " + "\n  ".join(bad)
        if args.no_refuse:
            print(msg)
        else:
            sys.exit(msg)
    else:
        print(f"plan: all {len(jobs)} modelled jobs fit")


def register(cli) -> None:
    sp = cli.add("plan", cmd_plan, "estimate every job's peak GPU / host memory and disk; refuse what does not fit")
    sp.add_argument("--config", nargs="+", help="config YAML file(s), merged in order (default config/config.yaml); "
                    "--cfg JSON (the whole config) takes precedence")
    sp.add_argument("--rules", nargs="+", help="only the jobs of these rules")
    sp.add_argument("--gpu-memory-gb", type=float, help="override plan.gpu_memory_gb (what-if)")
    sp.add_argument("--out", help="CSV of the summary (the Markdown plan is written beside it)")
    sp.add_argument("--no-refuse", action="store_true", help="report jobs that do not fit, exit 0")
