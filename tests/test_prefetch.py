"""Paper scale without network on the compute nodes: one local step (`prefetch`) downloads every hub repository
the config names at a pinned commit into a shared cache and writes a manifest; every compute job waits for it
and reads that cache offline. No network here: huggingface_hub.snapshot_download (the network boundary) is
replaced by a fake that writes a snapshot directory where the hub client would."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml

from memopd import cli
from memopd.prefetch import hub_repos, localize, snapshot_dir
from workflow_helpers import REPO, snakemake, workflow_copy
from memopd.schema import merge_files

PAPER = merge_files([REPO / "config" / "paper.yaml"])
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
# what the paper config names today (models, e5 encoder, LLM teacher, benchmark data sets, corpus file)
HUB = {("model", "Qwen/Qwen2.5-3B-Instruct"), ("model", "Qwen/Qwen2.5-7B-Instruct"), ("model", "intfloat/e5-base-v2"),
       ("model", "openai/gpt-oss-120b"), ("dataset", "hotpotqa/hotpot_qa"),
       ("dataset", "google-research-datasets/nq_open"), ("dataset", "PeterJinGo/wiki-18-corpus")}
# the steps that read the hub at paper scale
HUB_STEPS = ("model_init", "benchmarks", "fetch_corpus", "retrieval_index", "sft_trajectories")


def test_the_paper_config_pins_every_hub_repository_to_a_commit():
    repos = {(r["type"], r["repo"]): r for r in hub_repos(PAPER)}
    assert set(repos) == HUB
    assert all(re.fullmatch(r"[0-9a-f]{40}", r["revision"]) for r in repos.values())
    assert repos[("dataset", "PeterJinGo/wiki-18-corpus")]["allow"] == ["wiki-18.jsonl.gz"]  # one file, not the repo
    assert repos[("model", "openai/gpt-oss-120b")]["ignore"] == ["original/*", "metal/*"]


def test_the_encoder_the_index_builds_with_by_default_is_prefetched_and_read_offline():
    """retrieval.dense without a model: the builder's default encoder (memopd.retrieval.dense) is downloaded at its
    pin and the index job's config names its snapshot directory, as when the config names it."""
    from memopd.retrieval.dense import _params

    cfg = copy.deepcopy(PAPER)
    named = cfg["retrieval"]["dense"].pop("model")
    default = _params(cfg["retrieval"]["dense"])["model"]
    assert default == named  # the paper names the default: the same download either way
    assert ("model", default) in {(r["type"], r["repo"]) for r in hub_repos(cfg)}
    local = localize(cfg)["retrieval"]["dense"]["model"]
    assert local == str(snapshot_dir(cfg["hub"]["home"], default, "model", cfg["hub"]["revisions"][default]))
    assert "model" not in cfg["retrieval"]["dense"]  # the user's config is left as written


@pytest.mark.parametrize("revision", [None, "main", "a09a354", "A09A35458C702B33EEACC393D103063234E8BC28"])
def test_a_repository_without_a_full_commit_hash_is_refused(revision):
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    cfg = copy.deepcopy(PAPER)
    if revision is None:
        del cfg["hub"]["revisions"]["Qwen/Qwen2.5-7B-Instruct"]
    else:
        cfg["hub"]["revisions"]["Qwen/Qwen2.5-7B-Instruct"] = revision
        with pytest.raises(WorkflowError, match="does not match"):  # the schema, when the workflow is parsed
            validate(copy.deepcopy(cfg), str(SCHEMA))
    with pytest.raises(ValueError, match="Qwen/Qwen2.5-7B-Instruct"):  # the workflow and `memopd prefetch`
        hub_repos(cfg)


def test_online_exactly_with_a_hub_section():
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    no_hub = {k: v for k, v in PAPER.items() if k != "hub"}
    with pytest.raises(WorkflowError, match="'hub' is a required property"):
        validate(copy.deepcopy(no_hub), str(SCHEMA))
    with pytest.raises(WorkflowError):  # pins that nothing would download
        validate({**copy.deepcopy(PAPER), "online": False}, str(SCHEMA))


def test_prefetch_downloads_each_pinned_snapshot_and_writes_the_manifest(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.file_download import repo_folder_name

    calls = []

    def fake_snapshot_download(repo_id, *, repo_type, revision, cache_dir, allow_patterns=None, ignore_patterns=None):
        calls.append({"repo": repo_id, "type": repo_type, "revision": revision, "cache_dir": str(cache_dir),
                      "allow": allow_patterns, "ignore": ignore_patterns})
        # the hub client's cache layout (huggingface_hub names the folder itself)
        snap = cache_dir / repo_folder_name(repo_id=repo_id, repo_type=repo_type) / "snapshots" / revision
        for name, text in {"config.json": "{}", "sub/data.bin": "x" * 10}.items():
            (snap / name).parent.mkdir(parents=True, exist_ok=True)
            (snap / name).write_text(text)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    import hashlib

    import memopd.prefetch

    served = tmp_path / "encodings"  # no network here: the encodings' server is a directory
    served.mkdir()
    (served / "o200k_base.tiktoken").write_bytes(b"YQ== 0\n")
    monkeypatch.setattr(memopd.prefetch, "ENCODINGS_URL", served.as_uri() + "/")
    monkeypatch.setattr(memopd.prefetch, "ENCODINGS", {"o200k_base.tiktoken": hashlib.sha256(b"YQ== 0\n").hexdigest()})
    home = tmp_path / "hf_home"
    cfg = {**copy.deepcopy(PAPER), "hub": {**PAPER["hub"], "home": str(home)}}
    config = tmp_path / "paper.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "manifest.json"
    cli.main(["prefetch", "--config", str(config), "--out", str(out)])  # by hand, as on a login node

    manifest = json.loads(out.read_text())
    assert [e["file"] for e in manifest["encodings"]] == ["o200k_base.tiktoken"]
    assert (home / "tiktoken/o200k_base.tiktoken").exists()
    entries = {(e["type"], e["repo"]): e for e in manifest["repos"]}
    assert set(entries) == HUB and len(calls) == len(HUB)
    for e in entries.values():
        assert e["revision"] == cfg["hub"]["revisions"][e["repo"]]
        assert e["path"] == str(snapshot_dir(home, e["repo"], e["type"], e["revision"]))
        assert e["files"] == {"config.json": 2, "sub/data.bin": 10} and e["bytes"] == 12
    assert all(c["cache_dir"] == str(home / "hub") and c["revision"] == cfg["hub"]["revisions"][c["repo"]]
               for c in calls)
    by_repo = {c["repo"]: c for c in calls}
    assert by_repo["openai/gpt-oss-120b"]["ignore"] == ["original/*", "metal/*"]
    assert by_repo["PeterJinGo/wiki-18-corpus"]["allow"] == ["wiki-18.jsonl.gz"]

    # what the compute jobs are given: the snapshot directories that were filled, never a hub name
    jobs = localize(cfg)
    local = [jobs["models"]["student"]["pretrained"], jobs["models"]["teacher"]["pretrained"],
             jobs["retrieval"]["dense"]["model"], jobs["teacher"]["llm"]["model"],
             *(e["name"] for es in jobs["benchmarks"]["sources"].values() for e in es)]
    assert set(local) <= {e["path"] for e in manifest["repos"]}
    assert jobs["retrieval"]["corpus"][0]["fetch"]["revision"] == cfg["hub"]["revisions"]["PeterJinGo/wiki-18-corpus"]


def test_a_hub_data_set_loads_from_its_local_snapshot_offline(tmp_path):
    """The benchmarks step is given the data set's snapshot directory: `datasets` reads it (parquet files and
    the README's configs, as on the hub) with HF_HUB_OFFLINE=1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap = tmp_path / "snap"
    row = {"id": ["a1"], "question": ["Who?"], "answer": ["Me"], "type": ["bridge"], "level": ["easy"],
           "supporting_facts": [{"title": ["T"], "sent_id": [0]}], "context": [{"title": ["T"], "sentences": [["S."]]}]}
    (snap / "distractor").mkdir(parents=True)
    pq.write_table(pa.table(row), snap / "distractor" / "validation-00000-of-00001.parquet")
    (snap / "README.md").write_text("---\nconfigs:\n- config_name: distractor\n  data_files:\n  - split: validation\n"
                                    "    path: distractor/validation-*\n---\n")
    code = ("import sys; from memopd.data.hub import load_qa_hub; "
            "print([q.qid for q in load_qa_hub(sys.argv[1], 'distractor', 'validation', 'hotpotqa_hf')])")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-c", code, str(snap)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "['hotpotqa:a1']" in r.stdout


def _jobs(text):
    """(rule, input line, shell command) of every job of a `snakemake -n -p` output."""
    out, cur = [], None
    for line in text.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            cur = {"rule": m.group(1), "input": "", "shell": ""}
            out.append(cur)
        elif cur is not None and line.startswith("    input: "):
            cur["input"] = line.split(": ", 1)[1]
        elif cur is not None and line.startswith("Shell command: ") and line != "Shell command: None":
            cur["shell"] = line.split(": ", 1)[1]
    return out


def test_paper_scale_prefetches_first_and_every_compute_job_runs_offline(tmp_path):
    wd = workflow_copy(tmp_path)
    r = snakemake(wd, "--configfile", "config/paper.yaml", "-n", "-p", "all", timeout=300)
    jobs = _jobs(r.stdout + r.stderr)
    pre = [j for j in jobs if j["rule"] == "prefetch"]
    assert len(pre) == 1 and "HF_HUB_OFFLINE" not in pre[0]["shell"]
    assert "prefetch --cfg" in pre[0]["shell"] and "--out results/prefetch/manifest.json" in pre[0]["shell"]
    block = re.search(r"^rule prefetch:\n(.*?)(?=^\S|\Z)", (REPO / "workflow/rules/prefetch.smk").read_text(), re.M | re.S)
    assert re.search(r"^\s+localrule: True$", block.group(1), re.M)  # runs where Snakemake runs, never submitted
    for step in HUB_STEPS:  # wait for the download: the manifest is an input
        found = [j for j in jobs if j["rule"] == step]
        assert found and all("results/prefetch/manifest.json" in j["input"] for j in found), step
    commands = [j for j in jobs if j["shell"] and j["rule"] != "prefetch"]
    assert len(commands) > 50
    for j in commands:
        assert "HF_HOME=data/hf_home HF_HUB_OFFLINE=1 " in j["shell"] and "--online" not in j["shell"], j
        # gpt-oss's encodings from the prefetched cache; compile caches of the job's own, not a shared ~/.cache
        assert "TIKTOKEN_ENCODINGS_BASE=data/hf_home/tiktoken " in j["shell"], j
        for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            assert re.search(var + r'="\$\{TMPDIR:-/tmp\}/memopd-cache-\$\$/\w+" ', j["shell"]), (var, j)
    # the steps that load a model or data set by name get its local snapshot directory instead
    text = "\n".join(j["shell"] for j in jobs if j["rule"] in HUB_STEPS)
    for kind, repo in HUB - {("dataset", "PeterJinGo/wiki-18-corpus")}:
        rev = PAPER["hub"]["revisions"][repo]
        assert str(snapshot_dir("data/hf_home", repo, kind, rev)) in text, repo
        assert f'"{repo}"' not in text, repo
    assert PAPER["hub"]["revisions"]["PeterJinGo/wiki-18-corpus"] in text  # fetch_corpus: pinned, from the cache
    # the torchrun jobs pass the job's CPUs on (a dry run caps them at its --cores): each rank takes its share
    # (memopd.dist.rank_threads), not torchrun's inherited OMP_NUM_THREADS on every rank
    for rule in ("train", "sft_train"):
        found = [j for j in jobs if j["rule"] == rule]
        assert found and all(re.search(r" --threads \d+ ", j["shell"]) for j in found), rule


def test_the_embedded_default_has_no_prefetch_and_no_hub_settings(tmp_path):
    wd = workflow_copy(tmp_path)
    r = snakemake(wd, "-n", "-p", "-c", "2", "all", timeout=300)
    out = r.stdout + r.stderr
    jobs = _jobs(out)
    assert jobs and "prefetch" not in {j["rule"] for j in jobs}
    assert "HF_HUB_OFFLINE" not in out and "HF_HOME" not in out and "manifest.json" not in out


def test_the_encodings_are_fetched_once_and_checked(tmp_path):
    """gpt-oss's tiktoken encodings (not in its model repository) land in {home}/tiktoken with the sha256 tiktoken
    expects; a file already there with that hash is not fetched again, and a download with another hash is refused
    and removed."""
    import hashlib

    from memopd.prefetch import encodings_dir, fetch_encodings

    src = tmp_path / "server"
    src.mkdir()
    (src / "a.tiktoken").write_bytes(b"YQ== 0\n")
    good = {"a.tiktoken": hashlib.sha256(b"YQ== 0\n").hexdigest()}
    entries = fetch_encodings(tmp_path / "home", src.as_uri() + "/", good)
    assert (encodings_dir(tmp_path / "home") / "a.tiktoken").read_bytes() == b"YQ== 0\n"
    assert entries == [{"file": "a.tiktoken", "sha256": good["a.tiktoken"], "bytes": 7,
                        "path": str(tmp_path / "home/tiktoken/a.tiktoken")}]
    (src / "a.tiktoken").unlink()  # nothing to download: the cached file has the expected hash
    assert fetch_encodings(tmp_path / "home", src.as_uri() + "/", good) == entries
    (src / "b.tiktoken").write_bytes(b"tampered")
    with pytest.raises(RuntimeError, match="b.tiktoken: sha256 .* expected 00"):
        fetch_encodings(tmp_path / "home", src.as_uri() + "/", {"b.tiktoken": "00" * 32})
    assert not list(encodings_dir(tmp_path / "home").glob("b.tiktoken*"))


def test_the_pinned_encodings_are_the_files_and_hashes_tiktoken_expects():
    """The two encodings vLLM's gpt-oss recipe has a site place in TIKTOKEN_ENCODINGS_BASE, each pinned to the
    sha256 that tiktoken checks before use (the expected_hash values of tiktoken_ext/openai_public.py, copied here
    by hand: a missing file or a wrong hash would fail only on an offline compute node)."""
    from memopd.prefetch import ENCODINGS, ENCODINGS_URL

    assert ENCODINGS == {
        "o200k_base.tiktoken": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        "cl100k_base.tiktoken": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    }
    assert ENCODINGS_URL == "https://openaipublic.blob.core.windows.net/encodings/"
