"""`memopd` command line: one subcommand per pipeline step (the Snakemake rules call these).

Each step takes its configuration as `--cfg JSON` (the rule passes its section of the validated
Snakemake config) and records that configuration in what it writes. Each package's commands.py adds its
commands with `register(cli)`; bad input (a missing file, config section or key, a wrong type) is reported
here in one line, exit status 2 (MEMOPD_TRACEBACK=1: the traceback instead).
"""
from __future__ import annotations

import argparse
import os
import sys

# Site settings every step runs with, before torch initialises CUDA: expandable segments let the allocator return
# freed memory to vLLM's wake-up (it works with sleep mode since vLLM 0.13) and cut fragmentation across pack
# lengths. A value the environment already sets wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from memopd import commands
from memopd.audit import commands as audit
from memopd.data import commands as data
from memopd.data.loaders import DataConfigError, DataFormatError
from memopd.evaluation import commands as evaluation
from memopd.generation import commands as generation
from memopd.inputs import UsageError, one_line, parse_cfg
from memopd.plan import commands as plan
from memopd.report import commands as report
from memopd.retrieval import commands as retrieval
from memopd.sft import commands as sft
from memopd.study import commands as study
from memopd.train import commands as train

REGISTERS = (commands.register, evaluation.register, generation.register, train.register, report.register, sft.register, audit.register,
             data.register, retrieval.register, plan.register, study.register)
GROUPS = {"model": "model checkpoints",
          "report": "tables and figures",
          "sft": "SFT stage: trajectories, examples, training",
          "audit": "alignment audits and ablation tables (config section `audit`)",
          "bench": "benchmarks that print figures",
          "retrieval": "retrieval corpus, index, recall (config section `retrieval`)",
          "tracking": "MLflow store",
          "study": "the controlled study's decision rules",
          "ledger": "exact call ledgers: a rollout's calls for checking any trainer's batch"}
# `memopd --help` lists the commands in pipeline order, whichever package adds them
LISTED = {"": ("tokenizer", "model", "rce", "eval", "rce-rollouts", "fetch", "train", "report", "sft", "audit", "bench",
               "benchmarks", "retrieval", "plan", "prefetch", "tracking", "study", "ledger"),
          "bench": ("packing", "decode", "eval", "opd-memory", "index", "sft")}
BAD_INPUT = (UsageError, DataConfigError, DataFormatError, FileNotFoundError)


class Commands:
    """The command groups of the parser; each package's register(cli) calls cli.add for its commands."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.groups = {"": parser.add_subparsers(dest="command", required=True)}
        for name, help in GROUPS.items():
            group = self.groups[""].add_parser(name, help=help)
            self.groups[name] = group.add_subparsers(dest=f"{name}_command", required=True)

    def add(self, path: str, fn, help: str) -> argparse.ArgumentParser:
        """Command `path` ("eval", "bench packing") running fn(args, cfg), with --cfg and --seed."""
        group, _, name = path.rpartition(" ")
        sp = self.groups[group].add_parser(name, help=help)
        sp.add_argument("--cfg", default="{}", help="JSON configuration of this step (a section of config.yaml)")
        sp.add_argument("--seed", type=int, default=0)
        sp.set_defaults(fn=fn, prog=sp.prog)
        return sp

    def list_in_order(self, group: str, names: tuple[str, ...]) -> None:
        sub, rank = self.groups[group], {n: i for i, n in enumerate(names)}
        parsers = sorted(sub.choices.items(), key=lambda kv: rank.get(kv[0], len(names)))
        sub.choices.clear()
        sub.choices.update(parsers)  # the usage line's {a,b,...}
        sub._choices_actions.sort(key=lambda a: rank.get(a.dest, len(names)))  # the help lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memopd", description=__doc__.splitlines()[0])
    cli = Commands(p)
    for register in REGISTERS:
        register(cli)
    for group, names in LISTED.items():
        cli.list_in_order(group, names)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.fn(args, parse_cfg(args.cfg))
    except BAD_INPUT as e:
        if os.environ.get("MEMOPD_TRACEBACK") == "1":
            raise
        print(f"{args.prog}: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
