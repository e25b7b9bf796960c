"""Tables 1-2 and the matched control: evaluation scores aggregated over seeds.

Per (method, horizon, metric): mean and sample std over seeds, the t interval of the mean, the change of the
mean relative to PPO in %, a comparison with PPO over seeds (memopd.stats.compare_seeds: paired t interval and
exact sign-flip p when both have the same seeds, else Welch's interval and the exact permutation p) and the
paper's change where it reports one (PAPER_MEMOPD_VS_PPO), with a `Finding:` line per comparison (table_notes).
A table's primary comparisons are F1 on the trained horizon; every other comparison it makes is secondary and
judged by its Holm-adjusted p (`mark_family`). Verdict words: memopd.stats.noise_verdict.

The matched control (`matched_control_table`) is its own experiment: `ppo`, `memopd_persistent` and
`memopd` on the seeds of `train.matched_control` (runs `{method}_seed{seed}`), evaluated on one
benchmark, with the paper's two increments (persistent teacher vs PPO; state alignment on top of it),
each tested over seeds in the same way.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from memopd.config import TrainRuns
from memopd.methods import BASELINE, SELF_CONTROL
from memopd.outputs import pyplot, save_figure
from memopd.stats import (NAN, VERDICT_RULE, SeedTest, compare_seeds, holm, noise_verdict, one_sample_test, paired_bca,
                          relative_change_pct, t_interval, two_level_bootstrap)

METRICS = {
    "multiobjective": ["em", "f1", "invalid_action_rate", "calls_per_episode", "peak_context_tokens",
                       "inference_time_s"],
    "wikirag": ["em", "f1", "invalid_action_rate", "calls_per_episode", "dependency", "inference_time_s",
                "peak_context_tokens"],
    "matched_control": ["em", "f1"],
}
# The matched control: these methods, everything else identical (the runs differ only by method). Its
# increments (method, baseline, what it measures) and the paper's change of the mean in % ({}: the paper has no
# such run); the last one only when the config trains the regularisation control (methods.control_methods).
INCREMENTS = [
    ("memopd_persistent", BASELINE, "persistent teacher", {"f1": 5.6, "em": 4.4}),
    ("memopd", "memopd_persistent", "alignment on top", {"f1": 7.0, "em": 10.0}),
    ("memopd", SELF_CONTROL, "the teacher beyond a KL anchor", {}),
]
# Tables 1-2 of the paper: MemOPD's change of the mean over PPO in % (five seeds), by (horizon label, metric).
PAPER_MEMOPD_VS_PPO = {
    ("Q2", "f1"): 14.3, ("Q8", "f1"): 283.2, ("Q16", "f1"): 416.2,
    ("Q16", "peak_context_tokens"): -33.0, ("Q16", "inference_time_s"): -14.1,
    ("wikirag", "em"): 6.1, ("wikirag", "f1"): 7.4, ("wikirag", "dependency"): -31.6,
    ("wikirag", "inference_time_s"): -28.5,
}
PRIMARY_METRIC = "f1"  # a table's primary comparisons: this metric on the trained horizon; the rest are secondary
FAMILY_RULE = (f"{PRIMARY_METRIC.upper()} on the trained horizon is primary, every other comparison's p is "
               f"Holm-adjusted over the table's secondary comparisons")
# The comparison columns every table of seed-level tests shares (fill_test, mark_family)
TEST_COLUMNS = ["p", "p_min", "p_holm", "table_tests", "family_size", "role", "test"]
COLUMNS = ["method", "horizon", "metric", "mean", "std", "ci_low", "ci_high", "rel_to_ppo_pct", "seeds",
           "diff_vs_ppo", "diff_ci_low", "diff_ci_high", *TEST_COLUMNS, "paper_rel_to_ppo_pct", "noise"]


def load_scores(eval_dir: str | Path, seeds: dict[str, list[int]], benchmarks: list[str]) -> dict:
    """{(method, benchmark): {seed: eval json}} from results/eval/{method}_seed{seed}/{benchmark}.json, each method
    of `seeds` ({method: its seeds}) on its own seeds."""
    out = {}
    for m, ms in seeds.items():
        for b in benchmarks:
            out[(m, b)] = {}
            for s in ms:
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


def trained_horizon(train_benchmark: str, horizons: dict[str, str]) -> str | None:
    """The label of the horizon trained on: the benchmark of `horizons` named like `train_benchmark` before its
    split (q2_train -> the label of q2_test); None when no horizon is."""
    stem = train_benchmark.split("_")[0]
    return next((label for bench, label in horizons.items() if bench.split("_")[0] == stem), None)


def fill_test(row: dict, t: SeedTest, primary: bool) -> dict:
    """`row` with the test's p, smallest p, test name and role; p_holm / table_tests / noise come from mark_family."""
    return {**row, "p": t.p, "p_min": t.p_min, "test": t.test, "role": "primary" if primary else "secondary"}


def mark_family(rows: list[dict], ci: tuple[str, str]) -> list[dict]:
    """Over the compared rows of one table (a `p`, NaN when there is no test): `table_tests` = how many tests the
    table made, `family_size` = how many of its role's (primary: the trained horizon's F1, each a claim of its own,
    not adjusted; secondary: the rest), `p_holm` = p for a primary row and Holm-adjusted over the secondary ones,
    `noise` = noise_verdict(interval `ci` columns, p_holm)."""
    compared = [r for r in rows if isinstance(r.get("p"), float)]
    tested = [r for r in compared if not math.isnan(r["p"])]
    secondary = [r for r in compared if r["role"] == "secondary"]
    for r, adj in zip(secondary, holm([r["p"] for r in secondary])):
        r["p_holm"] = adj
    for r in compared:
        if r["role"] == "primary":
            r["p_holm"] = r["p"]
        r["table_tests"] = len(tested)
        r["family_size"] = sum(x["role"] == r["role"] for x in tested)
        r["noise"] = noise_verdict(r[ci[0]], r[ci[1]], r["p_holm"])
    return rows


def table_rows(scores: dict, methods: list[str], horizons: dict[str, str], metrics: list[str],
               reference: dict | None = None, primary: str | None = None) -> list[dict]:
    """horizons: {benchmark file name: horizon label}, e.g. {"q2_test": "Q2"}; primary: the trained horizon's label
    (its F1 comparisons are the table's primary ones). reference: load_reference's {(model, benchmark): eval json};
    each of its models gets a row above the methods' (its value and its change vs PPO in %; one evaluation, so
    the seed columns are blank)."""
    rows = []
    for bench, horizon in horizons.items():
        for metric in metrics:
            base = {s: r[metric] for s, r in scores.get((BASELINE, bench), {}).items()}
            base_mean = statistics.fmean(base.values()) if base else NAN
            for (model, b), result in (reference or {}).items():
                if b == bench:
                    rows.append({**dict.fromkeys(COLUMNS, ""), "method": model, "horizon": horizon, "metric": metric,
                                 "mean": result[metric], "paper_rel_to_ppo_pct": NAN,
                                 "rel_to_ppo_pct": relative_change_pct(base_mean, result[metric]) if base else NAN})
            for m in methods:
                per_seed = {s: r[metric] for s, r in scores[(m, bench)].items()}
                vals = [per_seed[s] for s in sorted(per_seed)]
                mean = statistics.fmean(vals)
                lo, hi = t_interval(vals)
                row = {**dict.fromkeys(COLUMNS, ""), "method": m, "horizon": horizon, "metric": metric, "mean": mean,
                       "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
                       "rel_to_ppo_pct": relative_change_pct(base_mean, mean) if base else NAN, "seeds": len(vals),
                       "paper_rel_to_ppo_pct": PAPER_MEMOPD_VS_PPO.get((horizon, metric), NAN) if m == "memopd" else NAN}
                if m != BASELINE and base:
                    t = compare_seeds(base, per_seed)
                    row = fill_test({**row, "diff_vs_ppo": t.diff, "diff_ci_low": t.ci_low, "diff_ci_high": t.ci_high},
                                    t, (horizon, metric) == (primary, PRIMARY_METRIC))
                rows.append(row)
    return mark_family(rows, ("diff_ci_low", "diff_ci_high"))


def test_words(r: dict) -> str:
    """A Finding line's statistics: the interval (with its test), the exact p, the smallest p these seeds allow,
    and for a secondary comparison its Holm-adjusted p over the table's comparisons."""
    if math.isnan(r["p"]):
        return f"no test ({r['test']}); {_seeds(r['seeds'])}"
    kind = "Welch" if r["test"].startswith("Welch") else "paired t"
    holm_p = (f"Holm-adjusted p {r['p_holm']:.4f} (secondary, over {r['family_size']})" if r["role"] == "secondary"
              else f"primary ({r['family_size']} in the table), not adjusted")
    return (f"{kind} 95% CI {r['diff_ci_low']:+.4f} to {r['diff_ci_high']:+.4f}; exact p {r['p']:.4f} "
            f"(smallest possible {r['p_min']:.4f}); {holm_p}; {_plural(r['table_tests'], 'comparison')} in the table; "
            f"{_seeds(r['seeds'])}")


def table_notes(rows: list[dict], metrics: tuple[str, ...] = ("em", "f1")) -> list[str]:
    """One `Finding:` line per method other than PPO, horizon and metric of `metrics` (and every metric the
    paper reports a change for): ours vs PPO with the test over seeds, the paper's, the verdict."""
    notes = []
    for r in rows:
        paper = r["paper_rel_to_ppo_pct"]
        if r["method"] == BASELINE or r["p"] == "" or (r["metric"] not in metrics and math.isnan(paper)):
            continue
        ours = "undefined (PPO mean 0)" if math.isnan(r["rel_to_ppo_pct"]) else f"{r['rel_to_ppo_pct']:+.1f}%"
        theirs = "no paper figure" if math.isnan(paper) else f"paper {paper:+.1f}%"
        notes.append(f"Finding ({r['method']} vs {BASELINE}, {r['horizon']}, {r['metric']}): {ours} (difference "
                     f"{r['diff_vs_ppo']:+.4f}; {test_words(r)}); {theirs}; "
                     f"{verdict(r['noise'], r['diff_vs_ppo'], paper)}.")
    return notes


def horizon_figure(rows: list[dict], path: str | Path, metric: str = "f1") -> None:
    """F1 vs horizon per method, with the 95% t intervals of the mean over seeds."""
    plt = pyplot()
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
    ax.set_ylabel(f"{metric.upper()} (mean over seeds, 95% t interval)")
    ax.legend()
    save_figure(fig, path, f"{metric.upper()} by horizon", dpi=150, width=60)


def noise_label(lo: float, hi: float) -> str:
    """The verdict of an interval over many tasks (no test over seeds); no interval (fewer than 2 tasks): none."""
    if math.isnan(lo) or math.isnan(hi):
        return "no interval (fewer than 2 tasks)"
    return "inside the noise (CI contains 0)" if lo <= 0 <= hi else "outside the noise (CI excludes 0)"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _seeds(n: int | str) -> str:
    """'5 seeds'; a comparison of two methods on different seeds is given as 'n1/n2'."""
    return _plural(n, "seed") if isinstance(n, int) else f"{n} seeds"


def verdict(noise: str, diff: float, paper: float) -> str:
    """The verdict of a comparison from its noise words (noise_verdict), its difference and the paper's change
    (NaN: none)."""
    if noise.startswith("inside"):
        return "inside the noise: these seeds do not tell it from no difference"
    if noise.startswith(("outside", "suggestive")):
        words = noise if noise.startswith("outside") else "suggestive only (not outside the noise)"
        if math.isnan(paper):
            return words
        return f"{words}, {'the same' if (diff > 0) == (paper > 0) else 'the opposite'} direction as the paper"
    return "no test (one seed, or a value that is not a number), so no claim either way"


def paired_over_tasks(base: dict[str, float], other: dict[str, float]) -> dict:
    """`other` minus `base`, task by task ({task_id: score} each, the same tasks): the mean difference, its 95%
    BCa bootstrap interval resampling tasks (pairs kept together), the number of tasks and the noise label."""
    if set(base) != set(other):
        raise ValueError(f"evaluated on other tasks ({len(other)} vs {len(base)}): evaluate both on the same tasks")
    ids = sorted(base)
    diff, lo, hi = paired_bca([base[t] for t in ids], [other[t] for t in ids])
    return {"diff": diff, "ci_low": lo, "ci_high": hi, "tasks": len(ids), "noise": noise_label(lo, hi)}


VS_STUDENT_COLUMNS = ["method", "horizon", "metric", "student", "mean", "diff", "ci_low", "ci_high", "tasks", "seeds",
                      "seed_ci_low", "seed_ci_high", *TEST_COLUMNS, "noise"]


def task_scores(path: str | Path, metric: str) -> dict[str, float]:
    """{task_id: metric} from an evaluation's per-task CSV (results/eval/{model}/{benchmark}.csv)."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and metric not in rows[0]:
        raise ValueError(f"{path}: no column {metric!r}")
    return {r["task_id"]: float(r[metric]) for r in rows}


def vs_student_rows(eval_dir: str | Path, student: str, seeds: dict[str, list[int]], horizons: dict[str, str],
                    metrics: tuple[str, ...] = ("em", "f1"), primary: str | None = None) -> list[dict]:
    """Each trained method ({method: its seeds}) against the SFT student it started from (greedy, one evaluation),
    on the same tasks.

    diff: the method's per-task score (mean over seeds) minus the student's, averaged over tasks; ci_low/ci_high:
    its 95% interval, a two-level bootstrap (seeds, then tasks) with several seeds, BCa over tasks with one.
    The test is over seeds: per seed the mean difference over tasks, its t interval (seed_ci_*) and exact sign-flip
    p; the verdict is noise_verdict over that (Holm-adjusted for the secondary rows: all but F1 on `primary`).
    With one seed there is no test over seeds: the verdict is the task interval's, and says so."""
    rows = []
    for bench, horizon in horizons.items():
        for metric in metrics:
            base = task_scores(Path(eval_dir) / student / f"{bench}.csv", metric)
            ids = sorted(base)
            for m, ms in seeds.items():
                per_seed = [task_scores(Path(eval_dir) / f"{m}_seed{s}" / f"{bench}.csv", metric) for s in ms]
                for s, scores in zip(ms, per_seed):
                    if set(scores) != set(base):
                        raise ValueError(f"{eval_dir}/{m}_seed{s}/{bench}.csv: tasks differ from the student's "
                                         f"({len(scores)} vs {len(base)}): evaluate both on the same tasks")
                b, o = [base[t] for t in ids], [[sc[t] for t in ids] for sc in per_seed]
                diff, lo, hi = two_level_bootstrap(b, o) if len(ms) > 1 else paired_bca(b, o[0])
                row = {**dict.fromkeys(VS_STUDENT_COLUMNS, ""), "method": m, "horizon": horizon, "metric": metric,
                       "student": statistics.fmean(b), "mean": statistics.fmean(statistics.fmean(x) for x in o),
                       "diff": diff, "ci_low": lo, "ci_high": hi, "tasks": len(ids), "seeds": len(ms)}
                if len(ms) > 1:
                    t = one_sample_test([statistics.fmean(x) - row["student"] for x in o])
                    row = fill_test({**row, "seed_ci_low": t.ci_low, "seed_ci_high": t.ci_high}, t,
                                    (horizon, metric) == (primary, PRIMARY_METRIC))
                else:
                    row["noise"] = f"no test over seeds (1 seed); over tasks {noise_label(lo, hi)}"
                rows.append(row)
    return mark_family(rows, ("seed_ci_low", "seed_ci_high"))


def vs_student_notes(rows: list[dict]) -> list[str]:
    """One line per row: the method against the student, its interval, the test over seeds and the verdict."""
    out = []
    for r in rows:
        test = (f"; over seeds: t 95% CI {r['seed_ci_low']:+.3f} to {r['seed_ci_high']:+.3f}, exact p {r['p']:.4f} "
                f"(smallest possible {r['p_min']:.4f}"
                + (f", Holm-adjusted {r['p_holm']:.4f} over {r['family_size']} secondary" if r["role"] == "secondary"
                   else ", primary")
                + f", {_plural(r['table_tests'], 'comparison')})" if r["p"] != "" else "")
        kind = "seeds and tasks" if r["seeds"] > 1 else "tasks, BCa"
        out.append(f"{r['method']} on {r['horizon']}, {r['metric']}: {r['mean']:.3f} vs the student's "
                   f"{r['student']:.3f}, difference {r['diff']:+.3f} (95% CI over {kind} {r['ci_low']:+.3f} to "
                   f"{r['ci_high']:+.3f}, {r['tasks']} tasks, {_seeds(r['seeds'])}){test}: {r['noise']}")
    return out


MATCHED_COLUMNS = ["row", "metric", "mean", "std", "ci_low", "ci_high", "seeds", "change_pct", "diff", "diff_ci_low",
                   "diff_ci_high", *TEST_COLUMNS, "paper_change_pct", "noise"]


def matched_control_rows(scores: dict, benchmark: str, metrics: list[str] | None = None) -> list[dict]:
    """The matched-control table from load_scores(eval_dir, {method: seeds}, [benchmark]) over the control's
    methods (methods.control_methods), each on its own seeds.

    Per metric: one row per method (mean, sample std and t interval over seeds), then one row per increment of
    INCREMENTS whose two methods are there: the change of the mean in %, the difference of the means over seeds
    with its interval and exact p (stats.compare_seeds: paired t and sign-flip on the same seeds, else Welch and
    the permutation over the splits), the paper's change in % (NaN: none), and the verdict (F1 primary; the other
    metrics Holm-adjusted). Cells that do not apply are ""."""
    metrics = metrics or METRICS["matched_control"]
    per = {m: runs for (m, b), runs in scores.items() if b == benchmark}
    blank = dict.fromkeys(MATCHED_COLUMNS, "")
    rows = []
    for metric in metrics:
        vals = {m: {s: float(r[metric]) for s, r in sorted(runs.items())} for m, runs in per.items()}
        for m, v in ((m, list(v.values())) for m, v in vals.items()):
            lo, hi = t_interval(v)
            rows.append({**blank, "row": m, "metric": metric, "mean": statistics.fmean(v),
                         "std": statistics.stdev(v) if len(v) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
                         "seeds": len(v)})
        for other, base, _, paper in (i for i in INCREMENTS if {i[0], i[1]} <= set(per)):
            t = compare_seeds(vals[base], vals[other])
            n = (len(vals[other]), len(vals[base]))
            rows.append(fill_test({**blank, "row": f"{other} vs {base}", "metric": metric,
                                   "seeds": n[0] if n[0] == n[1] else f"{n[0]}/{n[1]}",
                                   "change_pct": relative_change_pct(statistics.fmean(vals[base].values()),
                                                                     statistics.fmean(vals[other].values())),
                                   "diff": t.diff, "diff_ci_low": t.ci_low, "diff_ci_high": t.ci_high,
                                   "paper_change_pct": paper.get(metric, NAN)}, t, metric == PRIMARY_METRIC))
    return mark_family(rows, ("diff_ci_low", "diff_ci_high"))


def _signed(v: float, unit: str = "%") -> str:
    return "undefined (baseline mean 0)" if math.isnan(v) else f"{v:+.1f}{unit}"


def _paper(pct: float) -> str:
    return "no paper figure" if math.isnan(pct) else f"paper {pct:+.1f}%"


def matched_control_notes(rows: list[dict]) -> list[str]:
    """One `Finding:` line per increment and metric: ours (the test over seeds), the paper's, the verdict."""
    notes = []
    for other, base, label, _ in INCREMENTS:
        for r in (r for r in rows if r["row"] == f"{other} vs {base}"):
            notes.append(f"Finding ({label}, {other} vs {base}, {r['metric'].upper()}): {_signed(r['change_pct'])} "
                         f"(difference {r['diff']:+.4f}; {test_words(r)}); "
                         f"{_paper(r['paper_change_pct'])}; "
                         f"{verdict(r['noise'], r['diff'], r['paper_change_pct'])}.")
    return notes


def seeds_words(seeds: dict[str, list[int]]) -> str:
    """'seeds [0, 1]' when every method has the same seeds, else each method's: 'seeds ppo [0, 1], memopd [0]'."""
    lists = list(seeds.values())
    if all(x == lists[0] for x in lists):
        return f"seeds {lists[0]}"
    return "seeds " + ", ".join(f"{m} {ms}" for m, ms in seeds.items())


def settings_words(runs: TrainRuns) -> str:
    """The `train` section's per-method settings other than seeds ('; per method: ppo lr_actor 0.0003, ppo.beta
    0.01'), '' when there are none."""
    parts = []
    for m, own in runs.per_method.items():
        kv = ([f"{k} {v:g}" for k, v in own.items() if k not in ("seeds", "ppo")]
              + [f"ppo.{k} {v:g}" for k, v in (own.get("ppo") or {}).items()])
        if kv:
            parts.append(f"{m} {', '.join(kv)}")
    return f"; per method: {'; '.join(parts)}" if parts else ""


def matched_control_caption(runs: TrainRuns, seeds: dict[str, list[int]], benchmark: str, scores: dict) -> str:
    """Names the methods, seeds, benchmark, runs (run directories, models, evaluations) and training set-up."""
    models = [f"{m}_seed{s}" for m, ms in seeds.items() for s in ms]
    episodes = sorted({int(r["episodes"]) for m in seeds for r in scores[(m, benchmark)].values()
                       if "episodes" in r})
    tasks = f", {'/'.join(map(str, episodes))} tasks each" if episodes else ""
    own = "; MemOPD with the SFT student as its own teacher (a KL anchor)" if SELF_CONTROL in seeds else ""
    increments = ", ".join(f"`{o} vs {b}` = {label}" for o, b, label, _ in INCREMENTS if {o, b} <= set(seeds))
    return (f"Matched control on {benchmark}: methods {', '.join(seeds)} (PPO without teacher; MemOPD "
            f"with the teacher on the persistent history; MemOPD with the teacher on the exact state{own}), "
            f"everything else identical{settings_words(runs)}; {seeds_words(seeds)}; runs "
            f"results/train/{{method}}/seed{{seed}}/ exported as models {', '.join(models)}; evaluations "
            f"results/eval/{{model}}/{benchmark}.json{tasks}. Student {runs.student}, teacher {runs.teacher}, "
            f"trained on {runs.benchmark} for {runs.steps} steps x {runs.batch_tasks} tasks. Method rows: mean "
            f"+- std over seeds and 95% t interval; increment rows ({increments}): change of the mean in %, the "
            f"difference over seeds with its 95% interval and exact p (paired t interval and sign-flip p when both "
            f"have the same seeds, else Welch's interval and the permutation p over the splits of the seeds; "
            f"{VERDICT_RULE}; F1 primary, EM Holm-adjusted), and the paper's change (persistent teacher +5.6% F1 / "
            f"+4.4% EM over PPO; alignment a further +7.0% F1 / +10.0% EM; no figure for the KL anchor); EM/F1 = "
            f"per-task mean over questions")


def matched_control_table(runs: TrainRuns, eval_dir: str | Path, out_csv: str | Path) -> list[dict]:
    """results/tables/matched_control.{csv,md} from results/eval/{method}_seed{seed}/{benchmark}.json, for the
    matched control of the `train` section's runs (TrainRuns.control: the methods' seeds, the benchmark)."""
    from memopd.outputs import write_table

    seeds, benchmark = runs.control()
    scores = load_scores(eval_dir, seeds, [benchmark])
    rows = matched_control_rows(scores, benchmark)
    write_table(rows, out_csv, matched_control_caption(runs, seeds, benchmark, scores),
                notes=matched_control_notes(rows))
    return rows
