"""Paper scale: every Hugging Face hub repository the config names, downloaded once, where the network is.

Compute nodes of a cluster have no internet. The workflow's `prefetch` step (a local rule: it runs on the
machine Snakemake runs on, the login node) downloads each repository at the commit pinned in config
`hub.revisions` into the Hugging Face cache `hub.home` on the shared file system, and writes a manifest
(repository, revision, local path, files, sizes). Every step that reads the hub takes that manifest as an
input, so it runs after the download, and it reads the cache offline: its command runs with
HF_HUB_OFFLINE=1 (any hub request fails at once instead of hanging on a node without network) and its
config names each repository by its local snapshot directory (`localize`), which every loader (transformers,
datasets, vLLM, the e5 encoder) opens as a local path, with no revision to resolve.

The snapshot directory of a pinned commit is known before the download (the cache layout is
`{home}/hub/{type}s--{org}--{name}/snapshots/{commit}`), so the workflow can name it when it is parsed;
`prefetch` checks that the download landed there.

Only the standard library and memopd.config are imported at module level: the workflow imports this module when it
is parsed.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from memopd.config import DenseConfig, HubConfig

# vLLM's gpt-oss (the harmony format) loads tiktoken encodings from the internet when its server starts; they
# are not in the model repository. Fetched here with the sha256 that tiktoken itself expects
# (tiktoken_ext/openai_public.py), into {home}/tiktoken, which the jobs get as TIKTOKEN_ENCODINGS_BASE.
ENCODINGS_URL = "https://openaipublic.blob.core.windows.net/encodings/"
ENCODINGS = {"o200k_base.tiktoken": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
             "cl100k_base.tiktoken": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"}
COMMIT = re.compile(r"[0-9a-f]{40}")  # a full commit hash: a branch or tag can move, a short hash can collide
FETCH_REPO_TYPE = "dataset"  # a corpus entry's `fetch.repo_type` when it names none
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # org/name; results/... and absolute paths are local


def is_hub_name(name: str) -> bool:
    return bool(HUB_NAME.fullmatch(name)) and not name.startswith("results/") and not Path(name).exists()


def _places(cfg: dict):
    """(repo type, repo id, allow patterns or None, section, key) of every hub name in a config: section[key]
    holds the name. The models, the e5 encoder, the LLM teacher, the hub data sets and the fetched corpus files."""
    for role in ("student", "teacher"):
        spec = cfg["models"].get(role, {})
        for key in ("pretrained", "tokenizer"):
            if isinstance(spec.get(key), str) and is_hub_name(spec[key]):
                yield "model", spec[key], None, spec, key
    ret = cfg["retrieval"]
    dense = ret.get("dense") or {}
    if ret.get("backend") == "e5" and is_hub_name(model := dense.get("model", DenseConfig.model)):
        yield "model", model, None, dense, "model"
    llm = cfg.get("teacher", {}).get("llm") or {}
    if cfg.get("teacher", {}).get("kind") == "llm" and not llm.get("url") and is_hub_name(llm.get("model", "")):
        yield "model", llm["model"], None, llm, "model"
    for entries in cfg["benchmarks"]["sources"].values():
        for e in entries:
            if "name" in e:
                yield "dataset", e["name"], None, e, "name"
    for e in ret["corpus"]:
        if "fetch" in e:  # one file of the repository, fetched (copied, gunzipped) into data_dir by fetch_corpus
            f = e["fetch"]
            yield f.get("repo_type", FETCH_REPO_TYPE), f["repo"], [f["file"]], f, "repo"


def hub_repos(cfg: dict) -> list[dict]:
    """Every hub repository `cfg` names, once: {repo, type, revision, allow, ignore}. Refuses a repository
    without a pinned revision in hub.revisions, or one pinned to anything but a full 40-hex commit hash."""
    hub = HubConfig.from_dict(cfg["hub"]) if cfg.get("hub") else HubConfig("", {})  # none: every name refused
    revisions, ignore = hub.revisions, hub.ignore
    repos, bad = {}, []
    for kind, name, allow, section, _ in _places(cfg):
        rev = revisions.get(name)
        if rev is None or not COMMIT.fullmatch(str(rev)):
            bad.append(f"{name}: {rev!r}")
            continue
        if section.get("revision") not in (None, rev):  # an entry's own revision (schema: fetch, qa_source)
            bad.append(f"{name}: the entry pins {section['revision']!r}, hub.revisions {rev!r}")
        r = repos.setdefault((kind, name), {"repo": name, "type": kind, "revision": rev, "allow": allow,
                                            "ignore": ignore.get(name)})
        if r["allow"] is not None:  # several file lists of one repository: their union; None means every file
            r["allow"] = None if allow is None else sorted(set(r["allow"]) | set(allow))
    if bad:
        raise ValueError("config hub.revisions must pin every hub repository the config names to a full 40-hex "
                         "commit hash (`git ls-remote https://huggingface.co/<repo>` or the repository's "
                         "'Files and versions' page); not pinned: " + "; ".join(sorted(set(bad))))
    return list(repos.values())


def snapshot_dir(home: str | Path, repo: str, kind: str, revision: str) -> Path:
    """Where huggingface_hub keeps the files of `repo` at commit `revision` in the cache of HF_HOME `home`."""
    return Path(home) / "hub" / f"{kind}s--{repo.replace('/', '--')}" / "snapshots" / revision


def localize(cfg: dict) -> dict:
    """`cfg` as the compute jobs get it: every hub name replaced by its pinned snapshot directory in hub.home
    (the corpus fetch keeps its repository and gets the pinned revision, which resolves offline from the
    cache). Unchanged without a hub section (the embedded default)."""
    if not cfg.get("hub"):
        return cfg
    home, out = HubConfig.from_dict(cfg["hub"]).home, copy.deepcopy(cfg)
    if out["retrieval"].get("backend") == "e5":  # the encoder by default too: named, so that it is localized
        out["retrieval"]["dense"] = {"model": DenseConfig.model, **(out["retrieval"].get("dense") or {})}
    pins = {(r["type"], r["repo"]): r["revision"] for r in hub_repos(cfg)}
    for kind, name, _, section, key in list(_places(out)):
        rev = pins[(kind, name)]
        if key == "repo":
            section["revision"] = rev
        else:
            section[key] = str(snapshot_dir(home, name, kind, rev))
            section.pop("revision", None)  # a local directory has no revisions
    return out


def encodings_dir(home: str | Path) -> Path:
    """Where the jobs find the tiktoken encodings (TIKTOKEN_ENCODINGS_BASE)."""
    return Path(home) / "tiktoken"


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_encodings(home: str | Path, base_url: str | None = None, expected: dict[str, str] | None = None) -> list[dict]:
    """Download each encoding file (default: ENCODINGS from ENCODINGS_URL) unless it is there with its sha256; a
    download with another hash is refused (and removed). Returns one manifest entry per file."""
    import urllib.request

    from memopd.atomic import atomic_path

    base_url, expected = base_url or ENCODINGS_URL, expected or ENCODINGS
    out_dir = encodings_dir(home)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, sha in expected.items():
        path = out_dir / name
        if not (path.is_file() and _sha256(path) == sha):
            with atomic_path(path) as tmp:
                with urllib.request.urlopen(base_url + name, timeout=120) as r, open(tmp, "wb") as f:
                    f.write(r.read())
                if (got := _sha256(tmp)) != sha:
                    raise RuntimeError(f"{base_url}{name}: sha256 {got}, expected {sha}")
        entries.append({"file": name, "sha256": sha, "path": str(path), "bytes": path.stat().st_size})
        print(f"encoding {name}: sha256 checked -> {path}")
    return entries


def prefetch(home: str | Path, repos: list[dict], out: str | Path) -> dict:
    """Download every repository of `repos` (hub_repos) at its revision into the cache of HF_HOME `home`, and
    write the manifest `out` (JSON): per repository its revision, local snapshot path, files and sizes.
    Files already in the cache are not downloaded again."""
    from huggingface_hub import snapshot_download

    from memopd.atomic import write_text

    entries = []
    for r in repos:
        if not COMMIT.fullmatch(r["revision"]):
            raise ValueError(f"{r['repo']}: revision {r['revision']!r} is not a full 40-hex commit hash")
        # cache_dir, not HF_HOME in the environment: the login's token stays in the user's own HF_HOME
        path = Path(snapshot_download(r["repo"], repo_type=r["type"], revision=r["revision"],
                                      cache_dir=Path(home) / "hub", allow_patterns=r.get("allow"),
                                      ignore_patterns=r.get("ignore")))
        want = snapshot_dir(home, r["repo"], r["type"], r["revision"])
        if path.resolve() != want.resolve():  # the jobs are given `want`: it must be what was filled
            raise RuntimeError(f"{r['repo']}: downloaded to {path}, the jobs read {want}")
        files = sorted(p for p in want.rglob("*") if p.is_file())
        sizes = {p.relative_to(want).as_posix(): p.stat().st_size for p in files}  # stat follows the blob links
        entries.append({**r, "path": str(want), "files": sizes, "bytes": sum(sizes.values())})
        print(f"{r['type']} {r['repo']}@{r['revision']}: {len(sizes)} files, {sum(sizes.values()) / 1e9:.2f} GB -> {want}")
    manifest = {"home": str(home), "repos": entries, "encodings": fetch_encodings(home)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(manifest, indent=2, sort_keys=True))
    return manifest
