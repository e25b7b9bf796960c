"""Tables 1-2 and the matched control: evaluation scores aggregated over seeds.

Per (method, horizon, metric): mean and sample std over seeds, a 95% bootstrap interval of the mean
(resampling seeds), the change of the mean relative to PPO in %, a paired comparison with PPO (per seed:
method - ppo; mean difference and its bootstrap interval, inside or outside the noise) and the paper's
change where it reports one (PAPER_MEMOPD_VS_PPO), with a `Finding:` line per comparison (table_notes).
With 5 seeds the intervals are wide: a difference inside the seed spread is no difference, and the tables
say so by their intervals.

The matched control (`matched_control_table`) is its own experiment: `ppo`, `memopd_persistent` and
`memopd` on the seeds of `train.matched_control` (runs `{method}_seed{seed}`), evaluated on one
benchmark, with the paper's two increments (persistent teacher vs PPO; state alignment on top of it)
and their paired bootstrap intervals over seeds. The intervals are memopd.stats'.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import textwrap
from pathlib import Path

from memopd.report.tables import LABEL_VAR
from memopd.stats import NAN, bootstrap_ci, paired_bootstrap, relative_change_pct

METRICS = {
    "multiobjective": ["em", "f1", "invalid_action_rate", "calls_per_episode", "peak_context_tokens",
                       "inference_time_s"],
    "wikirag": ["em", "f1", "invalid_action_rate", "calls_per_episode", "dependency", "inference_time_s",
                "peak_context_tokens"],
    "matched_control": ["em", "f1"],
}
# The matched control: these three methods, everything else identical (the runs differ only by method).
MATCHED_METHODS = ["ppo", "memopd_persistent", "memopd"]
# Its two increments (method, baseline, what it measures) and the paper's change of the mean in %.
INCREMENTS = [
    ("memopd_persistent", "ppo", "persistent teacher", {"f1": 5.6, "em": 4.4}),
    ("memopd", "memopd_persistent", "alignment on top", {"f1": 7.0, "em": 10.0}),
]
MATCHED_DEFAULT_BENCHMARK = "q2_test"
# Tables 1-2 of the paper: MemOPD's change of the mean over PPO in % (five seeds), by (horizon label, metric).
PAPER_MEMOPD_VS_PPO = {
    ("Q2", "f1"): 14.3, ("Q8", "f1"): 283.2, ("Q16", "f1"): 416.2,
    ("Q16", "peak_context_tokens"): -33.0, ("Q16", "inference_time_s"): -14.1,
    ("wikirag", "em"): 6.1, ("wikirag", "f1"): 7.4, ("wikirag", "dependency"): -31.6,
    ("wikirag", "inference_time_s"): -28.5,
}
COLUMNS = ["method", "horizon", "metric", "mean", "std", "ci_low", "ci_high", "rel_to_ppo_pct", "seeds",
           "paired_diff_vs_ppo", "paired_ci_low", "paired_ci_high", "paper_rel_to_ppo_pct", "noise"]


def load_scores(eval_dir: str | Path, methods: list[str], seeds: list[int], benchmarks: list[str]) -> dict:
    """{(method, benchmark): {seed: eval json}} from results/eval/{method}_seed{seed}/{benchmark}.json."""
    out = {}
    for m in methods:
        for b in benchmarks:
            out[(m, b)] = {}
            for s in seeds:
                out[(m, b)][s] = _eval_json(Path(eval_dir) / f"{m}_seed{s}" / f"{b}.json",
                                            f"method {m}, seed {s}, benchmark {b}")
    return out


def _eval_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"missing evaluation {path} ({what})")
    return json.loads(path.read_text())


def load_reference(eval_dir: str | Path, models: list[str], benchmarks: list[str]) -> dict:
    """{(model, benchmark): eval json} of the SFT models (results/eval/{model}/{benchmark}.json): one greedy
    evaluation each, the rows Tables 1-2 put above the methods for scale."""
    return {(m, b): _eval_json(Path(eval_dir) / m / f"{b}.json", f"SFT model {m}, benchmark {b}")
            for m in models for b in benchmarks}


def figure_title(title: str, width: int) -> str:
    """`title` with the run's label in front (the workflow's `label`, e.g. the controlled study; as each table's
    caption), wrapped to `width` characters. Figures also carry it as their PNG Title."""
    label = os.environ.get(LABEL_VAR, "")
    return textwrap.fill(f"{label}: {title}" if label else title, width)


def horizon_order(horizons: dict[str, str]) -> dict[str, str]:
    """{benchmark: label} ordered by questions per task (Q2, Q8, Q16): the run's config reaches the command as
    JSON with sorted keys, which would put Q16 before Q2 in the tables and on the figure's axis."""
    def questions(label: str) -> float:
        digits = "".join(c for c in label if c.isdigit())
        return int(digits) if digits else float("inf")

    return dict(sorted(horizons.items(), key=lambda kv: questions(kv[1])))


def budget_note(scores: dict, horizons: dict[str, str]) -> str:
    """The response budget the evaluations of `horizons` ({benchmark: label}) used (max new tokens per
    call, from each eval JSON), for a caption: one number when all agree, else per horizon (a mixed
    horizon lists its values: its runs were evaluated under different protocols)."""
    used = {label: set() for label in horizons.values()}
    for (_, bench), per_seed in scores.items():
        if bench in horizons:
            used[horizons[bench]].update(r.get("max_new_tokens") for r in per_seed.values())
    text = {label: "/".join(sorted(str(v) if v is not None else "not recorded" for v in vals))
            for label, vals in used.items()}
    if len(set(text.values())) == 1:
        return f"response budget {next(iter(text.values()))} new tokens per call"
    return "response budget (new tokens per call) " + ", ".join(f"{h} {t}" for h, t in text.items())


def table_rows(scores: dict, methods: list[str], horizons: dict[str, str], metrics: list[str],
               reference: dict | None = None) -> list[dict]:
    """horizons: {benchmark file name: horizon label}, e.g. {"q2_test": "Q2"}. reference: load_reference's
    {(model, benchmark): eval json}; each of its models gets a row above the methods' (its value and its change
    vs PPO in %; one evaluation, so the seed columns are blank)."""
    rows = []
    for bench, horizon in horizons.items():
        for metric in metrics:
            ppo = scores.get(("ppo", bench), {})
            ppo_mean = statistics.fmean(r[metric] for r in ppo.values()) if ppo else float("nan")
            for (model, b), result in (reference or {}).items():
                if b == bench:
                    rows.append({**dict.fromkeys(COLUMNS, ""), "method": model, "horizon": horizon, "metric": metric,
                                 "mean": result[metric], "paper_rel_to_ppo_pct": NAN,
                                 "rel_to_ppo_pct": relative_change_pct(ppo_mean, result[metric]) if ppo else NAN})
            for m in methods:
                per_seed = scores[(m, bench)]
                vals = [per_seed[s][metric] for s in sorted(per_seed)]
                mean = statistics.fmean(vals)
                lo, hi = bootstrap_ci(vals)
                diffs = [per_seed[s][metric] - ppo[s][metric] for s in sorted(per_seed) if s in ppo]
                dlo, dhi = bootstrap_ci(diffs) if diffs else (float("nan"), float("nan"))
                paper = PAPER_MEMOPD_VS_PPO.get((horizon, metric), NAN) if m == "memopd" else NAN
                rows.append({
                    "method": m, "horizon": horizon, "metric": metric, "mean": mean,
                    "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
                    "rel_to_ppo_pct": relative_change_pct(ppo_mean, mean) if ppo else NAN,
                    "seeds": len(vals),
                    "paired_diff_vs_ppo": statistics.fmean(diffs) if diffs else NAN,
                    "paired_ci_low": dlo, "paired_ci_high": dhi, "paper_rel_to_ppo_pct": paper,
                    "noise": "" if m == "ppo" or not diffs else _noise((dlo, dhi), len(diffs)),
                })
    return rows


def table_notes(rows: list[dict], metrics: tuple[str, ...] = ("em", "f1")) -> list[str]:
    """One `Finding:` line per method other than PPO, horizon and metric of `metrics` (and every metric the
    paper reports a change for): ours vs PPO with the paired interval over seeds, the paper's, the verdict."""
    notes = []
    for r in rows:
        paper = r["paper_rel_to_ppo_pct"]
        if r["method"] == "ppo" or not r["noise"] or (r["metric"] not in metrics and math.isnan(paper)):
            continue
        ci = ("no interval" if r["seeds"] < 2 or math.isnan(r["paired_ci_low"]) else
              f"paired 95% CI of the per-seed difference {r['paired_ci_low']:+.4f} to {r['paired_ci_high']:+.4f}")
        ours = "undefined (PPO mean 0)" if math.isnan(r["rel_to_ppo_pct"]) else f"{r['rel_to_ppo_pct']:+.1f}%"
        theirs = "no paper figure" if math.isnan(paper) else f"paper {paper:+.1f}%"
        notes.append(f"Finding ({r['method']} vs ppo, {r['horizon']}, {r['metric']}): {ours} (per-seed difference "
                     f"{r['paired_diff_vs_ppo']:+.4f}; {ci}; {_seeds(r['seeds'])}); "
                     f"{theirs}; "
                     f"{verdict(r['noise'], r['paired_diff_vs_ppo'], paper)}.")
    return notes


def horizon_figure(rows: list[dict], path: str | Path, metric: str = "f1") -> None:
    """F1 vs horizon per method, with the 95% bootstrap intervals over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["metric"] == metric]
    horizons = list(dict.fromkeys(r["horizon"] for r in sel))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, m in enumerate(dict.fromkeys(r["method"] for r in sel)):
        pts = [next(r for r in sel if r["method"] == m and r["horizon"] == h) for h in horizons]
        x = [j + (i - 1) * 0.06 for j in range(len(horizons))]
        y = [p["mean"] for p in pts]
        err = [[p["mean"] - p["ci_low"] for p in pts], [p["ci_high"] - p["mean"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
    ax.set_xticks(range(len(horizons)), horizons)
    ax.set_xlabel("horizon (questions per task)")
    ax.set_ylabel(f"{metric.upper()} (mean over seeds, 95% bootstrap CI)")
    ax.legend()
    title = figure_title(f"{metric.upper()} by horizon", 60)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, metadata={"Title": title})
    plt.close(fig)


def noise_label(lo: float, hi: float) -> str:
    return "inside the noise (CI contains 0)" if lo <= 0 <= hi else "outside the noise (CI excludes 0)"


def _seeds(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


def _noise(diff_ci: tuple[float, float], seeds: int) -> str:
    if seeds < 2 or math.isnan(diff_ci[0]):
        return "no interval (1 seed)"
    return noise_label(*diff_ci)


def verdict(noise: str, diff: float, paper: float) -> str:
    """The verdict of a comparison from its noise label, its mean difference and the paper's change (NaN: none)."""
    if noise.startswith("inside"):
        return "inside the noise: the interval contains 0, so these seeds do not tell it from no difference"
    if noise.startswith("outside"):
        if math.isnan(paper):
            return "outside the noise"
        same = (diff > 0) == (paper > 0)
        return f"outside the noise, {'the same' if same else 'the opposite'} direction as the paper"
    return "one seed: no interval, so no claim either way"


def paired_over_tasks(base: dict[str, float], other: dict[str, float]) -> dict:
    """`other` minus `base`, task by task ({task_id: score} each, the same tasks): the mean difference, its 95%
    bootstrap interval resampling tasks (pairs kept together), the number of tasks and the noise label."""
    if set(base) != set(other):
        raise ValueError(f"evaluated on other tasks ({len(other)} vs {len(base)}): evaluate both on the same tasks")
    ids = sorted(base)
    pb = paired_bootstrap([base[t] for t in ids], [other[t] for t in ids])
    lo, hi = pb["diff_ci"]
    return {"diff": pb["diff"], "ci_low": lo, "ci_high": hi, "tasks": len(ids), "noise": noise_label(lo, hi)}


VS_STUDENT_COLUMNS = ["method", "horizon", "metric", "student", "mean", "diff", "ci_low", "ci_high", "tasks", "seeds",
                      "noise"]


def task_scores(path: str | Path, metric: str) -> dict[str, float]:
    """{task_id: metric} from an evaluation's per-task CSV (results/eval/{model}/{benchmark}.csv)."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and metric not in rows[0]:
        raise ValueError(f"{path}: no column {metric!r}")
    return {r["task_id"]: float(r[metric]) for r in rows}


def vs_student_rows(eval_dir: str | Path, student: str, methods: list[str], seeds: list[int],
                    horizons: dict[str, str], metrics: tuple[str, ...] = ("em", "f1")) -> list[dict]:
    """Each trained method against the SFT student it started from, task by task: per task the method's score
    (mean over seeds) minus the student's (greedy, one evaluation), the mean difference and its 95% bootstrap
    interval resampling tasks (pairs kept together: the same task for both), and whether it excludes 0.
    The interval is over tasks, so it is the evaluation's noise at these seeds, not the seed-to-seed spread."""
    rows = []
    for bench, horizon in horizons.items():
        for metric in metrics:
            base = task_scores(Path(eval_dir) / student / f"{bench}.csv", metric)
            for m in methods:
                per_seed = [task_scores(Path(eval_dir) / f"{m}_seed{s}" / f"{bench}.csv", metric) for s in seeds]
                for s, scores in zip(seeds, per_seed):
                    if set(scores) != set(base):
                        raise ValueError(f"{eval_dir}/{m}_seed{s}/{bench}.csv: tasks differ from the student's "
                                         f"({len(scores)} vs {len(base)}): evaluate both on the same tasks")
                other = {t: statistics.fmean(sc[t] for sc in per_seed) for t in base}
                pt = paired_over_tasks(base, other)
                rows.append({"method": m, "horizon": horizon, "metric": metric,
                             "student": statistics.fmean(base.values()), "mean": statistics.fmean(other.values()),
                             "diff": pt["diff"], "ci_low": pt["ci_low"], "ci_high": pt["ci_high"],
                             "tasks": pt["tasks"], "seeds": len(seeds), "noise": pt["noise"]})
    return rows


MATCHED_COLUMNS = ["row", "metric", "mean", "std", "ci_low", "ci_high", "seeds", "change_pct", "change_ci_low",
                   "change_ci_high", "paired_diff", "paired_ci_low", "paired_ci_high", "paper_change_pct", "noise"]


def matched_control_rows(scores: dict, benchmark: str, metrics: list[str] | None = None) -> list[dict]:
    """The matched-control table from load_scores(..., MATCHED_METHODS, seeds, [benchmark]).

    Per metric: one row per method (mean, sample std and 95% bootstrap interval over seeds), then one row
    per increment of INCREMENTS ("memopd_persistent vs ppo", "memopd vs memopd_persistent"): the change of
    the mean in % with its paired bootstrap interval over seeds, the mean per-seed difference with its
    interval, the paper's change in %, and whether the interval contains 0. Cells that do not apply are ""."""
    metrics = metrics or METRICS["matched_control"]
    per = {m: scores[(m, benchmark)] for m in MATCHED_METHODS}
    seeds = sorted(per["ppo"])
    for m, runs in per.items():
        if sorted(runs) != seeds:
            raise ValueError(f"matched control: {m} has seeds {sorted(runs)}, ppo has {seeds} (pairs need the same seeds)")
    blank = dict.fromkeys(MATCHED_COLUMNS, "")
    rows = []
    for metric in metrics:
        vals = {m: [float(per[m][s][metric]) for s in seeds] for m in MATCHED_METHODS}
        for m in MATCHED_METHODS:
            lo, hi = bootstrap_ci(vals[m])
            rows.append({**blank, "row": m, "metric": metric, "mean": statistics.fmean(vals[m]),
                         "std": statistics.stdev(vals[m]) if len(seeds) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
                         "seeds": len(seeds)})
        for other, base, _, paper in INCREMENTS:
            pb = paired_bootstrap(vals[base], vals[other])
            rows.append({**blank, "row": f"{other} vs {base}", "metric": metric, "seeds": len(seeds),
                         "change_pct": pb["rel_pct"], "change_ci_low": pb["rel_ci"][0], "change_ci_high": pb["rel_ci"][1],
                         "paired_diff": pb["diff"], "paired_ci_low": pb["diff_ci"][0], "paired_ci_high": pb["diff_ci"][1],
                         "paper_change_pct": paper.get(metric, float("nan")), "noise": _noise(pb["diff_ci"], len(seeds))})
    return rows


def _signed(v: float, unit: str = "%") -> str:
    return "undefined (baseline mean 0)" if math.isnan(v) else f"{v:+.1f}{unit}"


def matched_control_notes(rows: list[dict]) -> list[str]:
    """One `Finding:` line per increment and metric: ours (interval), the paper's, the noise verdict."""
    notes = []
    for other, base, label, _ in INCREMENTS:
        for r in (r for r in rows if r["row"] == f"{other} vs {base}"):
            m = r["metric"].upper()
            ci = ("no interval" if math.isnan(r["paired_ci_low"]) else
                  f"paired 95% CI of the change {_signed(r['change_ci_low'])} to {_signed(r['change_ci_high'])}"
                  if not math.isnan(r["change_ci_low"]) else
                  f"paired 95% CI of the per-seed difference {r['paired_ci_low']:+.4f} to {r['paired_ci_high']:+.4f}")
            notes.append(f"Finding ({label}, {other} vs {base}, {m}): {_signed(r['change_pct'])} "
                         f"(per-seed difference {r['paired_diff']:+.4f}; {ci}; {_seeds(r['seeds'])}); "
                         f"paper {r['paper_change_pct']:+.1f}%; "
                         f"{verdict(r['noise'], r['paired_diff'], r['paper_change_pct'])}.")
    return notes


def matched_control_caption(cfg: dict, seeds: list[int], benchmark: str, scores: dict) -> str:
    """Names the methods, seeds, benchmark, runs (run directories, models, evaluations) and training set-up."""
    models = [f"{m}_seed{s}" for m in MATCHED_METHODS for s in seeds]
    episodes = sorted({int(r["episodes"]) for m in MATCHED_METHODS for r in scores[(m, benchmark)].values()
                       if "episodes" in r})
    tasks = f", {'/'.join(map(str, episodes))} tasks each" if episodes else ""
    return (f"Matched control on {benchmark}: methods {', '.join(MATCHED_METHODS)} (PPO without teacher; MemOPD "
            f"with the teacher on the persistent history; MemOPD with the teacher on the exact state), everything "
            f"else identical; seeds {list(seeds)}; runs results/train/{{method}}/seed{{seed}}/ exported as models "
            f"{', '.join(models)}; evaluations results/eval/{{model}}/{benchmark}.json{tasks}. Student "
            f"{cfg['student']}, teacher {cfg['teacher']}, trained on {cfg['benchmark']} for {cfg['steps']} steps x "
            f"{cfg['batch_tasks']} tasks. Method rows: mean +- std over seeds and 95% bootstrap CI; increment rows "
            f"(`memopd_persistent vs ppo` = persistent teacher, `memopd vs memopd_persistent` = alignment on top): "
            f"change of the mean in % with its paired bootstrap CI over seeds, mean per-seed difference with its "
            f"CI, and the paper's change (persistent teacher +5.6% F1 / +4.4% EM over PPO; alignment a further "
            f"+7.0% F1 / +10.0% EM); EM/F1 = per-task mean over questions")


def matched_control_config(cfg: dict) -> tuple[list[int], str]:
    """(seeds, benchmark) of the train section's matched_control (defaults: train.seeds, q2_test)."""
    mc = cfg.get("matched_control") or {}
    return list(mc.get("seeds", cfg["seeds"])), mc.get("benchmark", MATCHED_DEFAULT_BENCHMARK)


def matched_control_table(cfg: dict, eval_dir: str | Path, out_csv: str | Path) -> list[dict]:
    """results/tables/matched_control.{csv,md} from results/eval/{method}_seed{seed}/{benchmark}.json.
    cfg: the `train` config section (its matched_control gives seeds and benchmark)."""
    from memopd.report.tables import write_table

    seeds, benchmark = matched_control_config(cfg)
    scores = load_scores(eval_dir, MATCHED_METHODS, seeds, [benchmark])
    rows = matched_control_rows(scores, benchmark)
    write_table(rows, out_csv, matched_control_caption(cfg, seeds, benchmark, scores),
                notes=matched_control_notes(rows))
    return rows
