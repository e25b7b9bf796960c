"""What a user looks at, checked in a real browser (headless Chromium, driven by tests/browser_support.py):

* MLflow's UI (`mlflow ui`, one worker) on a store that a tiny real pipeline filled through the CLI the rules
  call: `tracking init`, three `train` runs (ppo seed 0, memopd seeds 0 and 1) with `--export`, an `eval` of
  each exported model, `report curves`. The runs page must be the model-training view (not GenAI), list the
  training runs with their evaluations nested under them, show each run's dataset and digest, group by
  method, and show an evaluation metric as a column with the values in the store.
* The Snakemake report of the whole DAG (`all`): the outputs are laid down (tables written by the library's
  table writers, figures as real PNGs, every other output an empty file) so that `snakemake -n all` has
  nothing to do, then `snakemake --report` builds the real report; every table and figure of the DAG must be
  in it, in its category, with a caption that renders the table.

Screenshots land in the test's temporary directory (printed; `pytest -s` shows the paths).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from browser_support import CHROMIUM, Browser
from workflow_helpers import snakemake, workflow_copy

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no Chromium at {CHROMIUM} (`apt-get install -y chromium`; .ci/run installs it; "
                              "MEMOPD_CHROMIUM points elsewhere)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ui(db: Path, log: Path):
    """`mlflow ui` on the store, one worker, this machine only (as docs/tracking.md "Locally" starts it)."""
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{db}",
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own process group: stopped with its uvicorn worker
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _wait_healthy(proc, url: str, log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).read().strip() == b"OK":
                return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"mlflow ui did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def _fill_store(d: Path, tracking: str) -> None:
    """The tracked steps of the pipeline, through `memopd.cli.main` (what the rules run), at toy size."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from agent_support import nq_tasks, random_student, retriever, tokenizer
    from memopd.cli import main

    for name in ("student_sft", "teacher_sft"):
        random_student(0 if name == "student_sft" else 7).save_pretrained(d / name)
        tokenizer().save_pretrained(d / name)
    for name, start in (("q2_train", 40), ("q2_test", 0)):
        tasks = nq_tasks(4, n_questions=2, start=start, benchmark=name)
        pq.write_table(pa.table({"task_id": [t.task_id for t in tasks], "questions": [t.questions for t in tasks],
                                 "answers": [t.answers for t in tasks], "benchmark": [t.benchmark for t in tasks]}),
                       d / f"{name}.parquet")
    retriever().save(d / "index")
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg = {k: cfg[k] for k in ("train", "agent", "rollout")}
    cfg["train"].update(steps=2, batch_tasks=2, checkpoint_every=2, critic_layers=None)  # tiny students: 4 layers
    cfg["rollout"].update(max_new_tokens=16, batch_size=2)
    cfg["agent"].update(invalid_action="continue", max_observation_tokens=32, turns={"default": 2})
    ecfg = {**cfg, "eval": {"max_tasks": 2, "max_new_tokens": 16, "temperature": 0.0}}
    for method, seed in (("ppo", 0), ("memopd", 0), ("memopd", 1)):
        main(["train", "--cfg", json.dumps(cfg), "--method", method, "--seed", str(seed),
              "--student", str(d / "student_sft"), "--teacher", str(d / "teacher_sft"),
              "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"),
              "--out-dir", str(d / f"train/{method}/seed{seed}"), "--export", str(d / f"models/{method}_seed{seed}"),
              "--tracking", tracking])
        main(["eval", "--cfg", json.dumps(ecfg), "--model", str(d / f"models/{method}_seed{seed}"),
              "--benchmark", str(d / "q2_test.parquet"), "--index", str(d / "index"),
              "--out-dir", str(d / f"eval/{method}_seed{seed}"), "--tracking", tracking])
    main(["report", "curves", "--cfg", json.dumps(cfg["train"]),
          "--metrics", *map(str, sorted(d.glob("train/*/seed*/metrics.jsonl"))),
          "--figure", str(d / "training_curves.png"), "--table", str(d / "training_curves.csv"), "--tracking", tracking])


def _column_values(b: Browser, metric: str) -> list[str]:
    """The displayed cells of a metric column of the runs table (group rows included)."""
    return b.eval(f"""[...document.querySelectorAll('[role=gridcell][col-id="metrics.`{metric}`"]')]
                      .map(c => c.innerText.trim())""")


def test_mlflow_ui_opens_on_the_training_runs_grouped_by_method(tmp_path):
    import torch

    from memopd.cli import main

    threads = torch.get_num_threads()
    db = tmp_path / "mlflow.db"
    tracking = json.dumps({"uri": f"sqlite:///{db}", "experiment": "memopd"})
    main(["tracking", "init", "--cfg", tracking, "--out", str(tmp_path / "store.json")])
    store = json.loads((tmp_path / "store.json").read_text())
    ui, url = _start_ui(db, tmp_path / "ui.log")  # starts while the runs are written (as during a pipeline run)
    try:
        try:
            _fill_store(tmp_path, tracking)
        finally:
            torch.set_num_threads(threads)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        runs = {r.info.run_name: r for r in client.search_runs([store["experiment_id"]], max_results=100)}
        train_names = ["train-ppo-seed0", "train-memopd-seed0", "train-memopd-seed1"]
        eval_names = ["eval-ppo_seed0-q2_test", "eval-memopd_seed0-q2_test", "eval-memopd_seed1-q2_test"]
        assert sorted(runs) == sorted(train_names + eval_names + ["training-curves"])
        digest = runs["train-ppo-seed0"].inputs.dataset_inputs[0].dataset.digest
        peak = {n: runs[n].data.metrics["eval/peak_context_tokens"] for n in eval_names}
        _wait_healthy(ui, url, tmp_path / "ui.log")

        with Browser() as b:
            # the documented address of the runs (store.json's ui_path): the model-training view
            b.open(f"{url}/{store['ui_path']}")
            b.wait_for("document.body.innerText.includes('train-memopd-seed1')", timeout=60)
            text = b.eval("document.body.innerText")
            assert "/runs" in b.eval("location.hash") and "workflowType=machine_learning" in b.eval("location.hash")
            assert "Model registry" in text and "Observability" not in text and "No data available" not in text
            assert "Open the Model training view" in text  # the experiment's note
            table = b.eval("[...document.querySelectorAll('[role=row]')].map(r => r.innerText).join('\\n')")
            for name in train_names + ["training-curves"]:
                assert name in table
            assert not any(n in table for n in eval_names)  # nested: hidden under their training runs
            assert f"q2_train ({digest})" in table and "Train" in table and "memopd train" in table
            b.screenshot(tmp_path / "mlflow_runs.png")

            # expand train-ppo-seed0: its evaluation is its child
            assert b.click("""[...document.querySelectorAll('[role=row]')].filter(r => r.innerText.includes('train-ppo-seed0'))
                              .map(r => r.querySelector('button[data-component-id*=runnamecellrenderer]')).filter(Boolean)""")
            b.wait_for("document.body.innerText.includes('eval-ppo_seed0-q2_test')", timeout=20)
            assert "eval-memopd_seed0-q2_test" not in b.eval("document.body.innerText")

            # Group by -> tag method
            b.click_text_until("Group by", "!!document.querySelector('[role=menuitemcheckbox]')")
            assert b.click_text("method", "[role=menuitemcheckbox]")
            b.key("Escape", 27)
            groups = b.wait_for("""(() => { const t = document.body.innerText;
                return ['memopd', 'ppo', 'report'].every(g => t.includes('Group: ' + g)) && t; })()""", timeout=20)
            for name in train_names + eval_names:
                assert name in groups  # every run, evaluations included, in its method's group

            # Columns -> eval/peak_context_tokens: each evaluation run's value, as in the store
            b.click_text_until("Columns", "!!document.querySelector('input[placeholder=\"Search columns\"]')")
            b.eval("document.querySelector('input[placeholder=\"Search columns\"]').focus()")
            b.type_text("peak_context")
            b.wait_for("[...document.querySelectorAll('span, label')].some(e => e.innerText === 'eval/peak_context_tokens')",
                       timeout=20)
            assert b.click_text("eval/peak_context_tokens")
            b.key("Escape", 27)
            cells = b.wait_for("""(() => { const c = [...document.querySelectorAll(
                '[role=gridcell][col-id="metrics.`eval/peak_context_tokens`"]')].map(c => c.innerText.trim());
                return c.length && c; })()""", timeout=20)
            for v in peak.values():
                assert f"{v:g}" in cells
            b.screenshot(tmp_path / "mlflow_grouped.png")
            print(f"screenshots: {tmp_path / 'mlflow_runs.png'} {tmp_path / 'mlflow_grouped.png'}")
            assert not b.console, b.console  # no uncaught exception in the page
    finally:
        _stop(ui)


# --- the Snakemake report -------------------------------------------------------------------------------

REPORTED = re.compile(r"results/(tables|audit|bench)/[^/]+\.csv$|results/figures/[^/]+\.png$")


def _lay_down_outputs(w: Path) -> tuple[list[str], list[str]]:
    """A copy of the workflow in `w` with every output of `all` (tables and figures real, the rest empty,
    directories as directories, all with one modification time): the outputs the report must hold, and the
    tables that have a Markdown beside them."""
    workflow_copy(w)
    dry = snakemake(w, "-n", "--forceall", "all")
    outputs = sorted({p.strip() for line in dry.stdout.splitlines() if line.strip().startswith("output:")
                      for p in line.split("output:", 1)[1].split(",")})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memopd.outputs import write_csv, write_table

    for o in outputs:
        p = w / o
        if "." not in p.name:  # directory() outputs (the retrieval index)
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if REPORTED.match(o) and p.suffix == ".csv":
            rows = [{"name": f"row_{i}", "max_abs_dlogp": 1e-6 * (i + 1), "passed": True} for i in range(3)]
            if o[:-4] + ".md" in outputs:  # CSV + Markdown (caption with reST-active characters, a finding)
                write_table(rows, p, f"{p.stem}: |d log p| *caption* of `x_0`", notes=["Finding: all at the floor."])
            else:
                write_csv(p, rows)
        elif p.suffix == ".png":
            fig, ax = plt.subplots(figsize=(3, 2))
            ax.plot([0, 1], [1, 0])
            ax.set_title(p.stem)
            fig.savefig(p)
            plt.close(fig)
        elif not p.exists():
            p.touch()
    t = time.time()
    for o in outputs:
        os.utime(w / o, (t, t))
    return [o for o in outputs if REPORTED.match(o)], [o[:-3] + "csv" for o in outputs if o.endswith(".md")]


def test_the_report_holds_every_table_and_figure(tmp_path):
    w = tmp_path / "workdir"
    expected, with_md = _lay_down_outputs(w)
    assert len(expected) >= 19 and "results/figures/training_curves.png" in expected
    dry = snakemake(w, "-n", "all")
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-3000:]
    snakemake(w, "--report", "results/report.html", "all")
    assert (w / "results/report.html").exists()

    with Browser() as b:
        b.open((w / "results/report.html").as_uri())
        b.wait_for("typeof results !== 'undefined' && document.body.innerText.includes('Results')", timeout=30)
        results = b.eval("Object.fromEntries(Object.entries(results).map(([k, v]) => [k, [v.mime_type, v.caption]]))")
        categories = b.eval("categories")
        assert sorted(results) == sorted(expected)
        assert sorted(categories) == ["1. Benchmarks and retrieval", "2. SFT", "3. Alignment audits", "4. Training",
                                      "5. Efficiency"]
        for path, (mime, caption) in results.items():
            assert mime == ("image/png" if path.endswith(".png") else "text/csv") and caption.strip(), path
            if path.startswith("results/tables/") or path.startswith("results/bench/"):  # the CSV rendered
                assert "<table" in caption and "row_2" in caption, path
            if path in with_md:  # and the Markdown verbatim: the step's caption and findings
                assert "Finding: all at the floor." in caption and "|d log p| *caption*" in caption, path
                assert "problematic" not in caption and "system-message" not in caption, path  # no reST errors
        assert "MemOPD" in b.eval("document.body.innerText")  # the workflow description (workflow/report/workflow.rst)

        # as a user: each category (-> each subcategory) of the menu lists its files
        def nav(*labels):
            # the breadcrumb's first link (a house icon): the menu's top
            assert b.click("[...document.querySelectorAll('nav a')].filter(a => a.className === 'hover:text-emerald-600'"
                           " && !a.innerText.trim())", real=False)
            for label in labels:
                b.wait_for(f"[...document.querySelectorAll('nav a')].some(a => a.innerText.trim() === {json.dumps(label)})",
                           timeout=10)
                assert b.click_text(label, "nav a", real=False), label

        listed = set()
        for cat, subs in categories.items():
            for sub in subs:
                nav(cat, *([sub] if len(subs) > 1 else []))
                b.wait_for(f"document.querySelector('nav').innerText.includes({json.dumps(subs[sub][0])})", timeout=10)
                text = b.eval("document.querySelector('nav').innerText")
                listed |= {p for p in subs[sub] if p in text}
        assert listed == set(expected)

        # a table's caption (the info button) renders it; a figure opens in the main view
        nav("4. Training", "Tables 1-2")
        b.wait_for("document.body.innerText.includes('results/tables/multiobjective.csv')", timeout=10)
        assert b.click("""[...document.querySelectorAll('tr, li, div')].filter(r => r.innerText.trim().startsWith(
            'results/tables/multiobjective.csv')).map(r => r.querySelector('a[iconname=information-circle]'))
            .filter(Boolean)""", real=False)
        b.wait_for("[...document.querySelectorAll('table')].some(t => t.innerText.includes('max_abs_dlogp'))", timeout=10)
        b.screenshot(tmp_path / "report_table.png")
        nav("4. Training", "training curves")
        b.wait_for("document.body.innerText.includes('results/figures/training_curves.png')", timeout=10)
        assert b.click("[...document.querySelectorAll('a[iconname=eye]')]", real=False)
        b.wait_for("[...document.querySelectorAll('img')].some(i => i.src.startsWith('data:image/png'))", timeout=10)
        b.screenshot(tmp_path / "report_figure.png")
        print(f"screenshots: {tmp_path / 'report_table.png'} {tmp_path / 'report_figure.png'}")
        assert not b.console, b.console
