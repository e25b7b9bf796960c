"""The runs' archive (memopd report archive / from-archive): the tables rebuilt from it alone are the tables
built from the runs' own results, byte for byte; a missing or changed file is named."""
import csv
import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memopd.cli import main
from memopd.config import TrainRuns
from memopd.report.archive import MANIFEST, contents, read_archive

# The second edition's form: the two controls on fewer seeds than ppo and memopd (train.per_method), the matched
# control on each method's own seeds
OWN = {"ppo": [0, 1, 2, 3, 4, 5], "memopd": [0, 1, 2, 3, 4, 5], "memopd_persistent": [0, 1, 2], "memopd_self": [0, 1, 2]}
TRAIN = {"student": "student_sft", "teacher": "teacher_sft", "methods": list(OWN), "seeds": OWN["ppo"],
         "per_method": {m: {"seeds": OWN[m]} for m in ("memopd_persistent", "memopd_self")},
         "benchmark": "q2_train", "horizons": {"q2_test": "Q2", "wikirag_test": "wikirag"},
         "matched_control": {"seeds": None, "benchmark": "q2_test"}, "steps": 12, "batch_tasks": 4}
LEVEL = {"ppo": 0.10, "memopd": 0.14, "memopd_persistent": 0.05, "memopd_self": 0.11, "student_sft": 0.12,
         "teacher_sft": 0.2}


def _results(root, train=TRAIN):
    """Evaluations (scores, per-task CSV) and training metrics of every run, made of seeded noise per model."""
    rng = random.Random(1)
    evals, runs = contents(TrainRuns.from_section(train))
    for model, bench in evals:
        d = root / "eval" / model
        d.mkdir(parents=True, exist_ok=True)
        level = LEVEL[model.split("_seed")[0]]
        tasks = [{"task_id": f"t{i}", "reward": 0.0, "em": float(rng.random() < level), "f1": rng.random() * 2 * level,
                  "calls": 3} for i in range(30)]
        with open(d / f"{bench}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, list(tasks[0]))
            w.writeheader()
            w.writerows(tasks)
        scores = {k: sum(t[k] for t in tasks) / 30 for k in ("em", "f1")}
        (d / f"{bench}.json").write_text(json.dumps({
            **scores, "episodes": 30, "invalid_action_rate": rng.random() * 0.1, "calls_per_episode": 3 - rng.random(),
            "peak_context_tokens": 300 + rng.random(), "inference_time_s": rng.random(), "dependency": rng.random(),
            "max_new_tokens": 64, "config": {"agent": {"rule": "summary_replacement"}}, "throughput": {"calls": 90}}))
    for method, seed in runs:
        d = root / "train" / method / f"seed{seed}"
        d.mkdir(parents=True, exist_ok=True)
        steps = [{"method": method, "seed": seed, "step": i, "reward/task": LEVEL[method] + i * 0.01 * rng.random(),
                  "rollout/invalid_rate": rng.random() * 0.1, "opd/loss": None if method == "ppo" else rng.random(),
                  "ppo/clipfrac": rng.random()} for i in range(12)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def _tables_from_results(root, out):
    """As the workflow builds them: Tables 1-2 and the curves from the train section without matched_control
    (workflow/rules/train.smk TRAIN_RUN), the matched control from the whole section."""
    cfg, run = json.dumps(TRAIN), json.dumps({k: v for k, v in TRAIN.items() if k != "matched_control"})
    main(["report", "results", "--cfg", run, "--eval-dir", str(root / "eval"), "--out-dir", str(out / "tables"),
          "--figure", str(out / "figures/f1_vs_horizon.png")])
    main(["report", "matched-control", "--cfg", cfg, "--eval-dir", str(root / "eval"),
          "--out", str(out / "tables/matched_control.csv")])
    metrics = [str(root / "train" / m / f"seed{s}" / "metrics.jsonl") for m, ss in OWN.items() for s in ss]
    main(["report", "curves", "--cfg", run, "--metrics", *metrics, "--figure", str(out / "figures/training_curves.png"),
          "--table", str(out / "tables/training_curves.csv"), "--reward", "f1"])


TABLES = ["multiobjective", "wikirag", "vs_student", "matched_control", "training_curves"]


LABEL = "Controlled study (a test)"


@pytest.fixture
def archived(tmp_path, monkeypatch):
    _results(tmp_path / "results")
    monkeypatch.setenv("MEMOPD_LABEL", LABEL)  # as the workflow sets it for every command of a labelled run
    main(["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir",
          str(tmp_path / "results/eval"), "--train-dir", str(tmp_path / "results/train"), "--out", str(tmp_path / "archive")])
    return tmp_path


def test_tables_rebuilt_from_the_archive_alone_are_the_runs_tables(archived, monkeypatch):
    tmp = archived
    _tables_from_results(tmp / "results", tmp / "own")
    shutil.rmtree(tmp / "results")  # nothing but the archive from here on
    monkeypatch.delenv("MEMOPD_LABEL")  # the label comes from the archive
    main(["report", "from-archive", "--archive", str(tmp / "archive"), "--out-dir", str(tmp / "rebuilt")])
    for t in TABLES:
        own, rebuilt = (tmp / d / "tables" / f"{t}.csv" for d in ("own", "rebuilt"))
        assert rebuilt.read_bytes() == own.read_bytes(), t
        md = (tmp / "rebuilt/tables" / f"{t}.md").read_text()
        assert md == (tmp / "own/tables" / f"{t}.md").read_text() and md.startswith(f"*{LABEL}: "), t
    assert (tmp / "rebuilt/figures/f1_vs_horizon.png").stat().st_size > 0
    assert (tmp / "rebuilt/figures/training_curves.png").stat().st_size > 0


def test_the_claims_table_rebuilt_from_the_archive_is_the_runs(tmp_path, capsys):
    """A run that declares its claims: the archive keeps them, and the claims table rebuilt from it alone is the one
    built from the run's evaluations, byte for byte; claims on a benchmark the archive does not keep are refused."""
    claims = {"primary": ["1a", "3"], "short": "q2_test", "long": "wikirag_test"}
    _results(tmp_path / "results")
    run = {k: v for k, v in TRAIN.items() if k != "matched_control"}
    main(["study", "claims", "--cfg", json.dumps({"train": run, "claims": claims}), "--eval-dir",
          str(tmp_path / "results/eval"), "--out", str(tmp_path / "own/claims.csv")])
    # 1a on the trained horizon's tasks, 1b on the long minus the short: the means over seeds by a plain loop
    rows = {r["claim"]: r for r in csv.DictReader(open(tmp_path / "own/claims.csv"))}
    for method, column in (("ppo", "base_mean"), ("memopd", "other_mean")):
        f1 = [json.loads((tmp_path / f"results/eval/{method}_seed{s}/q2_test.json").read_text())["f1"]
              for s in OWN[method]]
        assert float(rows["1a"][column]) == pytest.approx(sum(f1) / len(f1))
    assert (rows["1a"]["horizons"], rows["1b"]["horizons"]) == ("q2_test", "wikirag_test - q2_test")
    args = ["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir",
            str(tmp_path / "results/eval"), "--train-dir", str(tmp_path / "results/train"), "--out",
            str(tmp_path / "archive")]
    with pytest.raises(SystemExit):
        main([*args, "--claims", json.dumps({**claims, "long": "q8_test"})])
    with pytest.raises(SystemExit):
        main([*args, "--claims", "{bad"])
    assert "--claims is not valid JSON" in capsys.readouterr().err
    main([*args, "--claims", json.dumps(claims)])
    assert read_archive(tmp_path / "archive")["claims"] == claims
    shutil.rmtree(tmp_path / "results")
    main(["report", "from-archive", "--archive", str(tmp_path / "archive"), "--out-dir", str(tmp_path / "rebuilt")])
    for ext in (".csv", ".md"):
        own, rebuilt = (tmp_path / d / f"claims{ext}" for d in ("own", "rebuilt/tables"))
        assert rebuilt.read_bytes() == own.read_bytes(), ext
    assert "1a" in (tmp_path / "own/claims.csv").read_text()


def test_the_sft_chain_table_rebuilt_from_the_archive_is_the_runs(tmp_path, capsys):
    """A run that chose its student along the SFT chain: the archive keeps the chain's evaluations and what its table
    reads, and from-archive rebuilds sft_chain.json and .txt byte for byte."""
    from dataclasses import asdict

    from test_study import _model, _write

    from memopd.study.chain import Benchmarks
    from memopd.study.commands import chain_table

    _results(tmp_path / "results")
    ev, b = tmp_path / "results/eval", Benchmarks()
    _write(ev, "teacher_sft", b.short, 0.0, 0.5)
    _write(ev, "teacher_sft", b.long, 0.0, 0.4)
    _model(ev, "student_sft_s3", 0.0, 0.0, 0.0)
    _model(ev, "student_sft_s6", 0.1, 0.3, 0.2)
    chain = {"models": ["student_sft_s3", "student_sft_s6"], "teacher": "teacher_sft", "benchmarks": asdict(b)}
    chain_table(chain, ev, tmp_path / "own/sft_chain.json")
    main(["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir", str(ev), "--train-dir",
          str(tmp_path / "results/train"), "--out", str(tmp_path / "archive"), "--chain", json.dumps(chain)])
    manifest = read_archive(tmp_path / "archive")
    assert manifest["chain"] == chain and "eval/student_sft_s6/q8_dev.csv" in manifest["files"]
    shutil.rmtree(tmp_path / "results")
    main(["report", "from-archive", "--archive", str(tmp_path / "archive"), "--out-dir", str(tmp_path / "rebuilt")])
    for ext in (".json", ".txt"):
        own, rebuilt = (tmp_path / d / f"sft_chain{ext}" for d in ("own", "rebuilt/tables"))
        assert rebuilt.read_bytes() == own.read_bytes(), ext
    assert json.loads((tmp_path / "own/sft_chain.json").read_text())["chosen"] == "student_sft_s6"


def test_the_archive_keeps_what_the_tables_read_and_records_its_source(archived):
    tmp = archived
    m = read_archive(tmp / "archive")
    assert m["train"] == TRAIN and m["reward"] == "f1" and m["format"] == 1 and m["label"] == LABEL
    assert len(m["commit"]) >= 7 and m["created"].startswith("20")
    kept = {f for f in m["files"] if f.startswith("train/")}  # each method on its own seeds
    assert kept == {f"train/{k}/seed{s}/metrics.jsonl.gz" for k, ss in OWN.items() for s in ss}
    ev = json.loads((tmp / "archive/eval/memopd_seed3/q2_test.json").read_text())
    own = json.loads((tmp / "results/eval/memopd_seed3/q2_test.json").read_text())
    assert "config" not in ev and "throughput" not in ev and ev["f1"] == own["f1"] and ev["max_new_tokens"] == 64
    with open(tmp / "archive/eval/memopd_seed3/q2_test.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["task_id", "em", "f1"] and len(rows) == 30
    import gzip

    lines = gzip.decompress((tmp / "archive/train/ppo/seed2/metrics.jsonl.gz").read_bytes())
    assert lines == (tmp / "results/train/ppo/seed2/metrics.jsonl").read_bytes()
    before = {p: p.read_bytes() for p in (tmp / "archive").rglob("*") if p.is_file() and p.name != MANIFEST}
    main(["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir", str(tmp / "results/eval"),
          "--train-dir", str(tmp / "results/train"), "--out", str(tmp / "archive")])
    assert all(p.read_bytes() == b for p, b in before.items())  # the same runs, the same bytes
    fewer = {**TRAIN, "seeds": [0, 1, 2, 3, 4], "matched_control": {"seeds": [0, 1], "benchmark": "q2_test"}}
    main(["report", "archive", "--cfg", json.dumps(fewer), "--reward", "f1", "--eval-dir", str(tmp / "results/eval"),
          "--train-dir", str(tmp / "results/train"), "--out", str(tmp / "archive")])
    m = read_archive(tmp / "archive")
    assert not [f for f in m["files"] if "seed5" in f] and not list((tmp / "archive").rglob("*seed5*"))


def test_a_changed_or_missing_file_is_named(archived, capsys):
    tmp = archived
    f = tmp / "archive/eval/ppo_seed1/q2_test.json"
    f.write_text(f.read_text().replace('"f1": 0', '"f1": 1'))
    with pytest.raises(ValueError, match="eval/ppo_seed1/q2_test.json differs"):
        read_archive(tmp / "archive")
    f.unlink()
    with pytest.raises(FileNotFoundError, match="eval/ppo_seed1/q2_test.json is listed"):
        read_archive(tmp / "archive")
    (tmp / "results/train/memopd/seed4/metrics.jsonl").unlink()
    with pytest.raises(SystemExit):
        main(["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir",
              str(tmp / "results/eval"), "--train-dir", str(tmp / "results/train"), "--out", str(tmp / "a2")])
    assert "memopd/seed4/metrics.jsonl" in capsys.readouterr().err
    assert not (tmp / "a2").exists()  # nothing written


def test_an_archive_never_replaces_the_results_it_archives_and_lists_only_what_it_wrote(archived):
    from memopd.report.archive import write_archive

    results = archived / "results"
    before = sorted(p.relative_to(results) for p in results.rglob("*"))
    with pytest.raises(ValueError, match="would replace"):
        write_archive(TRAIN, "f1", results / "eval", results / "train", results, commit="x")
    assert sorted(p.relative_to(results) for p in results.rglob("*")) == before  # nothing deleted
    (archived / "archive" / "notes.txt").write_text("a stray file beside the archive")
    manifest = write_archive(TRAIN, "f1", results / "eval", results / "train", archived / "archive", commit="x")
    assert "notes.txt" not in manifest["files"] and read_archive(archived / "archive")["commit"] == "x"


def _means(path) -> dict:
    """{(row key...): mean} of a table's rows that carry a mean (methods and the SFT models; not increments)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    key = [k for k in ("method", "row", "horizon", "metric") if k in rows[0]]
    return {tuple(r[k] for k in key): float(r["mean"]) for r in rows if r.get("mean")}


ARCHIVES = Path(__file__).resolve().parents[1] / "archive"
STUDIES = ["study_second_edition", "study_design_c"]  # the committed test studies
# Rows with a mean in each study's tables: 6 models x 4 horizons (x 1 for Wiki-RAG) x 6 metrics; 4 methods x EM, F1
ROWS = {"multiobjective": 144, "wikirag": 42, "matched_control": 8}


@pytest.fixture(scope="module")
def rebuilt_study(request, tmp_path_factory):
    """A committed test study's tables rebuilt from its archive alone (every file checked against its SHA-256)."""
    out = tmp_path_factory.mktemp(request.param)
    main(["report", "from-archive", "--archive", str(ARCHIVES / request.param), "--out-dir", str(out)])
    return request.param, out


@pytest.mark.parametrize("rebuilt_study", STUDIES, indirect=True)
@pytest.mark.parametrize("table", ["multiobjective", "wikirag", "matched_control"])
def test_the_committed_study_archives_rebuild_their_runs_means(table, rebuilt_study):
    """The tables rebuilt from a committed study's archive carry the run's own means (its committed tables/, written
    by the run), row for row; the tests beside them are the rebuilding code's."""
    study, out = rebuilt_study
    run, rebuilt = _means(ARCHIVES / study / "tables" / f"{table}.csv"), _means(out / "tables" / f"{table}.csv")
    assert len(run) == ROWS[table] and rebuilt.keys() == run.keys()
    assert all(rebuilt[k] == pytest.approx(run[k], rel=1e-12, abs=1e-15) for k in run), (study, table)


@pytest.mark.parametrize("manifest", sorted(ARCHIVES.rglob("manifest.json")),
                         ids=lambda p: str(p.parent.relative_to(ARCHIVES)))
def test_every_committed_archive_holds_the_files_its_manifest_hashes(manifest):
    """Each dev and test archive's manifest names its files with their SHA-256 (hashlib here, not the writer's)."""
    files = json.loads(manifest.read_text())["files"]
    assert files, manifest
    for name, digest in files.items():
        assert hashlib.sha256((manifest.parent / name).read_bytes()).hexdigest() == digest, (manifest, name)


@pytest.mark.parametrize("tuning", ["study_dev_design_b/tuning_h2", "study_dev_design_c/tuning"])
def test_the_archived_tuning_runs_give_the_verdicts_their_run_printed(tuning):
    """Rule 3's check (workflow/scripts/tuning.py) on an archived grid prints what it printed at the run."""
    d = ARCHIVES / tuning
    res = subprocess.run([sys.executable, str(ARCHIVES.parent / "workflow/scripts/tuning.py"), "check", "--dev",
                          str(d / "student"), "--out", str(d)], capture_output=True, text=True, check=True)
    assert res.stdout == (d / "check.txt").read_text()


SFT = ["student_init", "student_sft", "teacher_sft"]


def _sft_results(root):
    """What the SFT summary reads of each model: held-out loss, model record (the pre-training and SFT seconds), its
    q2_test evaluation (student_sft and teacher_sft's are the runs' own)."""
    rng = random.Random(2)
    for i, m in enumerate(SFT):
        (root / "sft").mkdir(parents=True, exist_ok=True)
        (root / "sft" / f"heldout_{m}.json").write_text(json.dumps({"params": 1000 + i, "heldout_target_loss":
                                                                      rng.random()}))
        (root / "models" / m).mkdir(parents=True, exist_ok=True)
        (root / "models" / m / "memopd_model.json").write_text(json.dumps(
            {"sft": {"train_seconds": rng.random() * 100}, "pretrain": {"train_seconds": rng.random() * 10}}))
    src, dst = root / "eval/student_sft", root / "eval/student_init"  # student_init: the student's tasks, worse
    dst.mkdir(parents=True)
    with open(src / "q2_test.csv", newline="") as f:
        tasks = [{**t, "f1": float(t["f1"]) / 2, "em": 0.0} for t in csv.DictReader(f)]
    with open(dst / "q2_test.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(tasks[0]))
        w.writeheader()
        w.writerows(tasks)
    ev = json.loads((src / "q2_test.json").read_text())
    (dst / "q2_test.json").write_text(json.dumps({**ev, "em": 0.0, "f1": sum(t["f1"] for t in tasks) / len(tasks)}))
    for m in SFT:  # the share of episodes that answered, which only the SFT summary reads
        f = root / "eval" / m / "q2_test.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "answered_rate": rng.random()}))


def _other_tables(root, tiny_lm):
    """The benchmark, recall and alignment outputs of a run, each written by its own step's code."""
    from memopd.data.compose import stats_rows, write
    from memopd.records import save_episodes
    from memopd.synthetic import RULES, random_episode

    rows = {f"q{n}_{split}": [{"task_id": f"q{n}_{split}-{i}", "benchmark": f"q{n}", "split": split, "n": n,
                               "source": "nq", "question": "?", "answer": "!", "questions": ["?"] * n,
                               "answers": [["!"]] * n, "qids": [f"nq:{split}{i}_{j}" for j in range(n)],
                               "sources": (["nq", "hotpotqa"] * n)[:n], "evidence_titles": [[]] * n}
                              for i in range(5 + n)] for n, split in ((2, "train"), (2, "test"), (4, "test"))}
    write(rows, stats_rows(rows), root / "benchmarks", root / "tables/benchmark_stats.csv", {"seed": 1})
    (root / "retrieval").mkdir()
    (root / "retrieval/recall_hits.csv").write_text(  # nq 2 of 3 in the top 5; hotpotqa any 2, all 1 of 2 in 10
        "dataset,qid,k,any,all\r\nnq,a,5,1,1\r\nnq,b,5,0,0\r\nnq,c,5,1,1\r\nhotpotqa,d,10,1,0\r\nhotpotqa,e,10,1,1\r\n")
    (root / "tables/retrieval_recall.csv").write_text(
        "dataset,metric,k,hits,total\r\nnq,answer_in_topk,5,2,3\r\nhotpotqa,support_any_in_topk,10,2,2\r\n"
        "hotpotqa,support_all_in_topk,10,1,2\r\n")
    rng = random.Random(0)
    pool = [rng.randrange(512) for _ in range(4000)]
    (root / "audit").mkdir()
    save_episodes(root / "audit/episodes.parquet", [random_episode(rng, pool, RULES[i], 3, 12, (4, 16), (3, 10),
                                                                   task_id=f"a{i}") for i in range(2)])
    tiny_lm.save_pretrained(root / "models/student_sft")
    main(["audit", "alignment", "--cfg", json.dumps(AUDIT_SCORING), "--model", str(root / "models/student_sft"),
          "--episodes", str(root / "audit/episodes.parquet"), "--out", str(root / "tables/alignment_audit.csv")])


AUDIT_SCORING = {"dtype": "float32", "clip": 0.2, "backends": ["sdpa", "eager"]}
TABLES_KEPT = {"sft_models": SFT, "sft_reference": "student_sft", "sft_benchmark": "q2_test",
               "benchmark_sets": ["q2_train", "q2_test", "q4_test"], "audit": AUDIT_SCORING}


def test_every_table_of_a_run_rebuilds_from_its_archive_or_there_is_no_archive(tmp_path, monkeypatch, capsys,
                                                                               tiny_lm):
    """--tables keeps what the SFT summary, benchmark, recall and alignment tables read; the archive stands only when
    every table it rebuilds equals the run's byte for byte (here 18 files); from-archive then rebuilds them with
    nothing else left. A run table that differs leaves no archive, exit 2, the table named in one line."""
    monkeypatch.setenv("MEMOPD_LABEL", LABEL)
    res = tmp_path / "results"
    _results(res)
    _tables_from_results(res, res)
    _sft_results(res)
    main(["report", "sft", "--names", *SFT, "--heldout", *[str(res / f"sft/heldout_{m}.json") for m in SFT],
          "--eval", *[str(res / f"eval/{m}/q2_test.json") for m in SFT],
          "--info", *[str(res / f"models/{m}/memopd_model.json") for m in SFT], "--out", str(res / "tables/sft_summary.csv")])
    _other_tables(res, tiny_lm)
    args = ["report", "archive", "--cfg", json.dumps(TRAIN), "--reward", "f1", "--eval-dir", str(res / "eval"),
            "--train-dir", str(res / "train"), "--out", str(tmp_path / "archive"), "--results", str(res)]
    main([*args, "--tables", json.dumps(TABLES_KEPT)])
    assert "byte for byte: 16 of the run's tables" in capsys.readouterr().out
    m = read_archive(tmp_path / "archive")
    assert m["tables"] == TABLES_KEPT and "eval/student_init/q2_test.csv" in m["files"]
    assert {"sft/teacher_sft/heldout.json", "benchmarks/q4_test.csv.gz", "retrieval/recall_hits.csv",
            "audit/alignment_audit.json"} <= set(m["files"])
    shutil.copytree(res / "tables", tmp_path / "run_tables")
    (res / "tables/sft_summary.md").write_text((res / "tables/sft_summary.md").read_text() + " ")
    with pytest.raises(SystemExit) as e:
        main([*args[:-4], "--out", str(tmp_path / "archive2"), "--results", str(res), "--tables",
              json.dumps(TABLES_KEPT)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "sft_summary.md rebuilt from the archive differs" in err
    assert not (tmp_path / "archive2" / MANIFEST).exists()
    shutil.rmtree(res)
    monkeypatch.delenv("MEMOPD_LABEL")
    main(["report", "from-archive", "--archive", str(tmp_path / "archive"), "--out-dir", str(tmp_path / "rebuilt")])
    run = sorted(p.name for p in (tmp_path / "run_tables").iterdir())
    assert len(run) == 16 and run == sorted(p.name for p in (tmp_path / "rebuilt/tables").iterdir())
    for name in run:
        assert (tmp_path / "rebuilt/tables" / name).read_bytes() == (tmp_path / "run_tables" / name).read_bytes(), name
