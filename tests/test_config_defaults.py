"""Every default of a typed config section is declared once, in its dataclass: no module reads such a key with a
fallback of its own, and the planner sizes each job with the values its trainer will run with."""
from __future__ import annotations

import ast
import copy
import dataclasses
import sys
import types
from pathlib import Path

import pytest

from memopd.config import (AgentConfig, AuditRollout, AuditScoring, BenchmarksConfig, BM25Config, ClaimsConfig,
                           ColocatedEngineConfig, DenseConfig, EngineConfig, EvalConfig, HubConfig, KBConfig,
                           PackagedModelConfig, PackingAudit, PlanConfig, PretrainedModelConfig, QASourceConfig,
                           QnConfig, QnSetConfig, RCEConfig, RCERolloutsConfig, RecallConfig, RetrievalConfig,
                           RolloutConfig, RULES, StudyConfig, TeacherConfig, TeacherServerConfig, TinyModelConfig,
                           TokenizerConfig, TrainRuns, WikiRagConfig, model_config, rollout_config)
from memopd.sft.trainer import TrainConfig
from memopd.train.config import PPO_FIELD_OF_KEY, RunConfig
from memopd.train.update import PPOConfig

ROOT = Path(__file__).resolve().parents[1]
TYPED = (AgentConfig, RolloutConfig, EngineConfig, ColocatedEngineConfig, RunConfig, PPOConfig, TrainConfig,
         RetrievalConfig, BM25Config, DenseConfig, RecallConfig, PlanConfig, EvalConfig, TeacherConfig,
         TeacherServerConfig, AuditScoring, AuditRollout, PackingAudit, BenchmarksConfig, QASourceConfig, QnConfig,
         QnSetConfig, WikiRagConfig, KBConfig, ClaimsConfig, RCEConfig, RCERolloutsConfig, TokenizerConfig,
         HubConfig, StudyConfig, PretrainedModelConfig, TinyModelConfig, PackagedModelConfig)
# reads of such a key name with a fallback that are not a typed section's: (file, key) -> why
NOT_A_TYPED_SECTION = {
    ("audit/steps.py", "rule"): "an episode file's recorded metadata, '?' when absent",
    ("audit/steps.py", "invalid_action"): "an episode file's recorded metadata",
    ("audit/steps.py", "temperature"): "an episode file's recorded metadata",
    ("audit/steps.py", "max_new_tokens"): "an episode file's recorded metadata",
    ("audit/steps.py", "backend"): "an episode file's recorded metadata",
    ("audit/steps.py", "seed"): "an episode file's recorded metadata",
    ("audit/batch.py", "top_p"): "a ledger's recorded sampling parameters (docs/ledger.md: absent = 1.0)",
    ("audit/batch.py", "top_k"): "a ledger's recorded sampling parameters (docs/ledger.md: absent = 0)",
    ("config.py", "ppo"): "train.per_method's optional ppo overrides",
    ("evaluation/evaluate.py", "vllm"): "the rollout section's optional engine, replaced for one step",
    ("evaluation/evaluate.py", "invalid_action"): "rce_rollouts' override, else the typed agent section's",
    ("sft/trainer.py", "steps"): "sft.pretrain.<role>.steps: no pre-training stage when absent",
    ("study/chain.py", "snapshots"): "read when the Snakefile is parsed (no torch): none when absent",
    ("config.py", "engine"): "teacher.llm.engine: LLM_ENGINES[0], the constant teachers.llm.LLMConfig's default is",
    ("prefetch.py", "model"): "teacher.llm.model: the LLM teacher's model, a required key when kind is llm",
}


def _typed_keys() -> set[str]:
    keys = {f.name for c in TYPED for f in dataclasses.fields(c)}
    return keys | set(PPO_FIELD_OF_KEY) | {"backend"}


def _names_a_typed_default(node: ast.AST) -> bool:
    """`DenseConfig.model`: the fallback is the typed section's own default, not a second spelling of it."""
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in {c.__name__ for c in TYPED})


def test_no_module_reads_a_typed_key_with_its_own_fallback():
    """A `.get("key", default)` of a key some typed section declares, in any module: the default is then spelled
    twice and may drift (each known exception says why it is not a typed section's key)."""
    keys, found, known = _typed_keys(), [], {**NOT_A_TYPED_SECTION, **NOT_THE_CONFIG}
    for rel, n in _gets():
        if (n.args[0].value in keys and not (isinstance(n.args[1], ast.Constant) and n.args[1].value is None)
                and not _names_a_typed_default(n.args[1]) and (rel, n.args[0].value) not in known
                and not (isinstance(n.args[1], ast.Name) and n.args[1].id.isupper())):  # a declared constant
            found.append(f"{rel}:{n.lineno}: .get({n.args[0].value!r}, {ast.unparse(n.args[1])})")
    assert not found, "\n".join(found)


def _gets():
    """(file, call) of every `.get("key", fallback)` in the library."""
    for path in sorted((ROOT / "src/memopd").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "src/memopd"))
        for n in ast.walk(ast.parse(path.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                    and len(n.args) == 2 and isinstance(n.args[0], ast.Constant)):
                yield rel, n


def _schema_keys() -> set[str]:
    """Every key name the config schema declares, at any depth."""
    import yaml

    keys: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for k, v in (node.get("properties") or {}).items():
                keys.add(k)
                walk(v)
            for v in node.values():
                if isinstance(v, (dict, list)):
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text()))
    return keys


def _literal_value(node: ast.AST) -> bool:
    """A number, string or bool, or a container holding something: a value spelled here (None and an empty
    container say "absent", a name points to where the value is declared)."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    return isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and bool(
        node.keys if isinstance(node, ast.Dict) else node.elts)


# reads of a config key's name with a value of their own that are not the config's: (file, key) -> what they read
NOT_THE_CONFIG = {
    ("audit/batch.py", "top_p"): "a ledger's recorded sampling parameters (docs/ledger.md: absent = 1.0)",
    ("audit/batch.py", "top_k"): "a ledger's recorded sampling parameters (docs/ledger.md: absent = 0)",
    ("audit/packing_bench.py", "episodes"): "a result row's episode kind, 'synthetic' for the synthetic sweep's",
    **{("audit/steps.py", k): "an episode file's recorded metadata, '?' when absent"
       for k in ("benchmark", "rule", "invalid_action", "temperature", "max_new_tokens", "backend", "seed")},
    ("plan/jobs.py", "gpu"): "resources.rules.<step>.gpu over resources.default: no GPU when neither names one",
    ("plan/stages.py", "gpu"): "resources.rules.<step>.gpu over resources.default: no GPU when neither names one",
    ("plan/models.py", "params"): "a model's config.json or plan.models entry: 0 = count them from the shapes",
    ("plan/models.py", "max_position_embeddings"): "an encoder's config.json (BERT's default length, 512)",
    ("plan/report.py", "scale"): "the config's label in the plan's title, '?' when it names none",
    ("prefetch.py", "model"): "teacher.llm.model: required when teacher.kind is llm; '' is no hub name",
    ("report/commands.py", "benchmark"): "the training section's benchmark in a caption, '' when absent",
    ("report/curves.py", "benchmark"): "the training section's benchmark in a caption, '?' when absent",
    ("sft/trainer.py", "steps"): "sft.pretrain.<role>.steps: absent means no pre-training stage (0 steps), read here",
}


def test_no_module_reads_a_config_key_with_a_value_of_its_own():
    """Any key of the config schema read with a value spelled at the read (`.get("compose", "same_source")`): the
    default then lives at each read and may drift; it is declared once (a typed section, a named constant) and the
    reads name it. Each exception says why its read is not of the config."""
    keys = _schema_keys()
    found = [f"{rel}:{n.lineno}: {ast.unparse(n)}" for rel, n in _gets()
             if n.args[0].value in keys and _literal_value(n.args[1]) and (rel, n.args[0].value) not in NOT_THE_CONFIG]
    assert not found, "\n".join(found)


def _paper(drop: tuple[tuple[str, ...], ...]) -> dict:
    from memopd.plan import load_config

    cfg = copy.deepcopy(load_config([str(ROOT / "config/paper.yaml")]))
    for *path, key in drop:
        d = cfg
        for p in path:
            d = d[p]
        d.pop(key)
    return cfg


def _job(cfg: dict, rule: str, name: str | None = None):
    from memopd.plan.stages import plan

    return next(j for j in plan(cfg, [rule]) if name is None or j.name == name)


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's LLM as a recorder of its keyword arguments (vLLM needs a GPU; the arguments are what is checked)."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: kw))


def test_the_colocated_engine_the_planner_sizes_is_the_one_the_trainer_starts(fake_vllm):
    """Without train.vllm and rollout.vllm.gpu_memory_utilization, the planned engine's share of the GPU, the one
    weight_sync.colocated_llm passes to vLLM, and ColocatedEngineConfig's default are one number."""
    from memopd.generation.weight_sync import colocated_llm
    from memopd.plan import PlanInputs
    from memopd.plan.stages import run_config

    cfg = _paper((("train", "vllm"), ("rollout", "vllm", "gpu_memory_utilization"), ("train", "ppo", "rce_sample")))
    job = _job(cfg, "train")
    planned = job.phases["rollout"]["vLLM engine"][0] / job.gpu_limit
    run = RunConfig.from_section(cfg["train"], cfg["train"]["methods"][0], 0)
    started = colocated_llm("model", rollout_config(cfg), run.vllm, seed=0)
    assert planned == pytest.approx(started["gpu_memory_utilization"]) == ColocatedEngineConfig().gpu_memory_utilization
    assert started["max_model_len"] == cfg["rollout"]["vllm"]["max_model_len"]
    assert started["enable_sleep_mode"] is False and "vLLM asleep" not in job.phases.get("update", {})
    # the RCE guard: PPOConfig's default number of episodes is planned when the config does not say
    assert run_config(PlanInputs.parse(cfg)).ppo.rce_sample == PPOConfig.rce_sample > 0
    assert any(t.startswith("RCE guard") for t in job.phases["scoring"])


def test_a_rollout_engine_without_max_model_len_is_planned_at_the_models_limit():
    """vLLM takes the model's max_position_embeddings when max_model_len is not given; so does the planner (the
    paper's models state 32768), and a model that states none is a config error naming the key."""
    from memopd.inputs import ConfigError

    cfg = _paper((("rollout", "vllm", "max_model_len"),))
    job = _job(cfg, "train")
    assert any("KV of one 32768-token sequence" in what for what, _, _ in job.checks)
    cfg["plan"]["models"]["Qwen/Qwen2.5-3B-Instruct"].pop("max_position_embeddings")
    with pytest.raises(ConfigError, match="rollout.vllm.max_model_len"):
        _job(cfg, "train")


def test_the_sft_job_is_planned_with_the_roles_own_settings():
    """A role's override (sft.teacher.seq_len) reaches the planned activations as it reaches the trainer
    (sft.commands.train_config), the student keeping the section's."""
    from memopd.plan import load_config
    from memopd.sft.commands import train_config

    cfg = load_config([str(ROOT / "config/config.yaml")])
    cfg["sft"]["teacher"]["seq_len"] = cfg["sft"]["seq_len"] + 512
    for role in ("student", "teacher"):
        job = next(j for j in _plans(cfg, "sft_train") if j.name == f"sft_train[{role}]")
        assert f"seq_len {train_config(cfg['sft'], role).seq_len} " in job.phases["step"]["activations"][1]
    assert train_config(cfg["sft"], "teacher").seq_len == cfg["sft"]["seq_len"] + 512


def _plans(cfg, rule):
    from memopd.plan.stages import plan

    return plan(cfg, [rule])


def test_the_typed_engines_take_only_the_keys_the_schema_declares():
    """rollout.vllm and train.vllm: the schema's keys are the dataclasses' fields, and an unknown key is refused."""
    import yaml

    from memopd.inputs import ConfigError

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())["properties"]
    for section, cls in (("rollout", EngineConfig), ("train", ColocatedEngineConfig)):
        assert set(schema[section]["properties"]["vllm"]["properties"]) == {f.name for f in dataclasses.fields(cls)}
        with pytest.raises(ConfigError, match=f"unknown {section}.vllm keys \\['gpu_mem'\\]"):
            cls.from_dict({"gpu_mem": 0.5})


def test_the_typed_sections_take_the_schemas_keys_and_defaults():
    """benchmarks (and its sources, qn, wiki_rag), kb, claims, rce, rce_rollouts, retrieval (and its bm25, dense,
    recall), plan, eval, teacher and its LLM's server, tokenizer, hub, study, a model (pretrained, tiny, packaged):
    the schema's keys are the dataclasses' fields and the defaults it states theirs; an unknown key is refused
    naming its place, and a value outside the schema's enum too."""
    import yaml

    from memopd.inputs import ConfigError

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    props, bench = schema["properties"], schema["properties"]["benchmarks"]["properties"]
    ret = props["retrieval"]["properties"]
    pairs = [(bench, BenchmarksConfig), (schema["$defs"]["qa_source"]["properties"], QASourceConfig),
             (bench["qn"]["properties"], QnConfig),
             (bench["qn"]["properties"]["sets"]["items"]["properties"], QnSetConfig),
             (bench["wiki_rag"]["properties"], WikiRagConfig), (props["kb"]["properties"], KBConfig),
             (props["claims"]["properties"], ClaimsConfig), (props["rce"]["properties"], RCEConfig),
             (props["rce_rollouts"]["properties"], RCERolloutsConfig), (ret, RetrievalConfig),
             (ret["bm25"]["properties"], BM25Config), (ret["dense"]["properties"], DenseConfig),
             (ret["recall"]["properties"], RecallConfig), (props["plan"]["properties"], PlanConfig),
             (props["eval"]["properties"], EvalConfig), (props["teacher"]["properties"], TeacherConfig),
             (props["teacher"]["properties"]["llm"]["properties"]["server"]["properties"], TeacherServerConfig),
             (props["tokenizer"]["properties"], TokenizerConfig), (props["hub"]["properties"], HubConfig),
             (props["study"]["properties"], StudyConfig),
             (schema["$defs"]["pretrained_model"]["properties"], PretrainedModelConfig),
             (schema["$defs"]["tiny_model"]["properties"], TinyModelConfig),
             (schema["$defs"]["packaged_model"]["properties"], PackagedModelConfig)]
    for keys, cls in pairs:
        assert set(keys) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
        for f in dataclasses.fields(cls):
            if "default" in keys[f.name]:
                assert keys[f.name]["default"] == getattr(cls(), f.name), f"{cls.__name__}.{f.name}"
    assert set(props["teacher"]["properties"]["kind"]["enum"]) == {"scripted", "llm"}
    with pytest.raises(ConfigError, match="teacher.kind must be one of"):
        TeacherConfig.from_dict({"kind": "human"})
    with pytest.raises(ConfigError, match=r"unknown teacher.llm.server keys \['gpus'\]"):
        TeacherConfig.from_dict({"kind": "llm", "llm": {"model": "m", "server": {"gpus": 2}}}).server
    assert set(ret["backend"]["enum"]) == {"bm25", "e5"}
    with pytest.raises(ConfigError, match=r"unknown retrieval.dense keys \['shards'\]"):
        RetrievalConfig.from_dict({"backend": "e5", "dense": {"shards": 4}})
    with pytest.raises(ConfigError, match="retrieval.backend: unknown backend 'splade'"):
        RetrievalConfig.from_dict({"backend": "splade"})
    with pytest.raises(ConfigError, match=r"unknown plan keys \['gpu_gb'\]"):
        PlanConfig.from_dict({"gpu_gb": 80})
    with pytest.raises(ConfigError, match=r"unknown eval keys \['tasks'\]"):
        EvalConfig.from_dict({"tasks": 10})
    with pytest.raises(ConfigError, match=r"unknown benchmarks.sources.nq\[1\] keys \['file'\]"):
        BenchmarksConfig.from_dict({"sources": {"nq": [{"format": "nq_open", "path": "a"}, {"file": "b"}]}})
    with pytest.raises(ConfigError, match=r"config section 'benchmarks.qn.sets\[0\]' has no 'tasks'"):
        BenchmarksConfig.from_dict({"qn": {"sets": [{"n": 2, "split": "test"}]}})
    with pytest.raises(ConfigError, match=r"unknown kb keys \['persons'\]"):
        KBConfig.from_dict({"persons": 10})
    with pytest.raises(ConfigError, match=r"unknown hub keys \['revision'\]"):
        HubConfig.from_dict({"home": "hf", "revision": {}})
    with pytest.raises(ConfigError, match="config section 'hub' has no 'revisions'"):
        HubConfig.from_dict({"home": "hf"})
    with pytest.raises(ConfigError, match=r"unknown models.student keys \['hidden'\]"):
        model_config({"hidden": 8}, "models.student")
    with pytest.raises(ConfigError, match=r"unknown models.<role> keys \['hidden_size'\]"):  # pretrained: no sizes
        model_config({"pretrained": "org/m", "hidden_size": 8})
    with pytest.raises(ConfigError, match="config section 'models.base' has no 'sha256'"):
        PackagedModelConfig.from_dict({"package": "p", "version": "1", "module": "m", "file": "f"})
    with pytest.raises(ConfigError, match="study.configs names no config file"):
        StudyConfig.from_dict({"configs": []})
    with pytest.raises(ConfigError, match="config section 'claims' has no 'long'"):
        ClaimsConfig.from_dict({"primary": ["1a"], "short": "q2_test"})
    for cls in (RCEConfig, RCERolloutsConfig):  # the schema's required keys, and every rule where none is listed
        key = cls.__name__[:-6].lower().replace("rollouts", "_rollouts")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        assert set(props[key]["required"]) == required
        given = {k: ["sdpa"] if k == "backends" else [1, 2] if k.endswith("_tokens") and cls is RCEConfig else 1
                 for k in props[key]["required"]}
        assert cls.from_dict({**given, "rules": []}).rules == tuple(RULES)
        with pytest.raises(ConfigError, match=f"config section '{key}' has no 'dtype'"):
            cls.from_dict({k: v for k, v in given.items() if k != "dtype"})
    with pytest.raises(ConfigError, match=r"rce.response_tokens: a range \[low, high\], not 4"):
        RCEConfig.from_dict({"dtype": "float32", "backends": ["sdpa"], "episodes": 1, "calls": 1, "prefix_tokens": 4,
                             "observation_tokens": [1, 2], "response_tokens": 4})


def test_an_eval_setting_per_benchmark_resolves_by_name_then_default():
    """eval's settings for one benchmark, by a plain lookup: its own name's value, else `default`, else the value
    given once; None where unset (the rollout's value is used)."""
    ev = EvalConfig.from_dict({"models": ["m"], "benchmarks": ["q2_test", "q8_test"], "max_tasks": 7,
                               "max_new_tokens": {"default": 96, "q8_test": 320}, "temperature": {"default": 0.0}})
    for bench, new in (("q2_test", 96), ("q8_test", 320), ("wikirag_test", 96)):
        got = ev.at(bench)
        assert (got.max_tasks, got.max_new_tokens, got.temperature) == (7, new, 0.0)
        assert got.sampling() == {"temperature": 0.0, "max_new_tokens": new}
    assert EvalConfig.from_dict({"max_tasks": None}).at("q2_test").sampling() == {}


def test_the_dense_index_the_planner_sizes_is_the_one_the_builder_builds():
    """Without retrieval.dense's shard size, batch and length, the planned index build and search use the values
    memopd.retrieval.dense builds with (its parameters of the same section), not numbers of the planner's own."""
    from memopd.retrieval.dense import _params

    cfg = _paper((("retrieval", "dense", "shard_passages"), ("retrieval", "dense", "batch_size"),
                  ("retrieval", "dense", "max_length")))
    built = _params(cfg["retrieval"]["dense"])
    job = _job(cfg, "retrieval_index")
    n = cfg["plan"]["corpus"]["passages"]
    assert built["shard_passages"] < n  # the builder's shards, not the whole corpus at once
    assert f"shard_passages {built['shard_passages']:,} x" in job.host["index shard"][1]
    assert f"{built['batch_size']} x {built['max_length']} tokens" in job.phases["encode"]["batch"][1]
    search = _job(cfg, "train")
    assert f"search_block {built['search_block']:,} x" in search.host["search blocks"][1]


def test_the_teachers_server_the_planner_sizes_is_the_one_the_step_starts():
    """teacher.llm without its server's GPU share, length and parallelism (or its engine): the planned serving
    share is the one teachers.llm.VLLMServer is started with from the same section (its command line)."""
    from memopd.teachers.llm import VLLMServer, server_kwargs

    cfg = _paper((("teacher", "llm", "server", "gpu_memory_utilization"), ("teacher", "llm", "server", "max_model_len"),
                  ("teacher", "llm", "server", "tensor_parallel_size"), ("teacher", "llm", "engine")))
    from memopd.inputs import ConfigError

    with pytest.raises(ConfigError, match="teacher.llm.server.max_model_len: null"):  # gpt-oss's sizes state none
        _job(cfg, "sft_trajectories")
    cfg["plan"]["models"]["openai/gpt-oss-120b"]["max_position_embeddings"] = 131072
    job = _job(cfg, "sft_trajectories")
    started = VLLMServer("m", "log", **server_kwargs(cfg["teacher"]["llm"]["server"])).cmd
    share = float(started[started.index("--gpu-memory-utilization") + 1])
    assert job.phases["serving"]["vLLM engine"][0] / job.gpu_limit == pytest.approx(share)
    assert "--max-model-len" not in started  # the model's own limit, as planned
    assert any("KV of one 131072-token sequence" in what for what, _, _ in job.checks), job.checks
    cfg["teacher"]["llm"]["url"] = "http://127.0.0.1:8000"  # a running server: nothing to start, nothing planned
    assert "serving" not in _job(cfg, "sft_trajectories").phases


def test_the_audit_section_is_its_typed_parts():
    """audit's keys are its scoring and rollout parts' fields, audit.packing's PackingAudit's; each part refuses an
    unknown key and names a missing one (the tables' jobs get the scoring part only)."""
    import yaml

    from memopd.inputs import ConfigError

    props = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())["properties"]["audit"]
    names = {f.name for c in (AuditScoring, AuditRollout) for f in dataclasses.fields(c)}
    assert set(props["properties"]) - {"teacher", "packing"} == names
    assert set(props["properties"]["packing"]["properties"]) == {f.name for f in dataclasses.fields(PackingAudit)}
    with pytest.raises(ConfigError, match="config section 'audit' has no 'clip'"):
        AuditScoring.from_dict({"dtype": "float32", "backends": ["sdpa"]})
    with pytest.raises(ConfigError, match=r"unknown audit keys \['episode'\]"):
        AuditRollout.from_dict({"episode": 4})
    whole = {"model": "m", "benchmark": "b", "episodes": 4, "rule_episodes": 2, "dtype": "float32", "clip": 0.2,
             "backends": ["sdpa"], "teacher": "t", "packing": {}}  # each part takes its own keys of the section
    assert AuditScoring.from_dict(whole) == AuditScoring("float32", 0.2, ("sdpa",))
    assert AuditRollout.from_dict(whole).episodes == 4
    with pytest.raises(ConfigError, match="config section 'audit.packing' has no 'repeats', 'real'"):
        PackingAudit.from_dict({"synthetic": {}})
    rollout = AuditRollout.from_dict({"model": "m", "benchmark": "b", "episodes": 4, "rule_episodes": 2,
                                      "temperature": 0.0})
    assert rollout.sampling() == {"temperature": 0.0}


def test_the_train_section_is_its_runs_and_a_runs_settings():
    """train's keys are TrainRuns' (which runs: models, methods, seeds, horizons, the matched control) and RunConfig's
    (how one run trains; dtype its PPOConfig's); the matched control's default benchmark is the schema's; each method
    runs on its own seeds; a missing or misspelt key is a ConfigError naming its place."""
    import yaml

    from memopd.config import MatchedControlConfig
    from memopd.inputs import ConfigError

    props = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())["properties"]["train"]
    names = {f.name for c in (TrainRuns, RunConfig) for f in dataclasses.fields(c)} | {"dtype"}
    assert set(props["properties"]) == names
    mc = props["properties"]["matched_control"]["properties"]
    assert set(mc) == {f.name for f in dataclasses.fields(MatchedControlConfig)}
    assert mc["benchmark"]["default"] == MatchedControlConfig().benchmark
    train = {"student": "s", "teacher": "t", "methods": ["ppo", "memopd", "memopd_persistent", "memopd_self"],
             "seeds": [0, 1, 2], "benchmark": "q2_train", "horizons": {"q2_test": "Q2", "q8_test": None},
             "steps": 4, "batch_tasks": 2, "lr_actor": 1e-4,
             "per_method": {"memopd_self": {"seeds": [5], "lr_actor": 3e-4}}}
    runs = TrainRuns.from_section(train)
    assert runs.runs() == [("ppo", 0), ("ppo", 1), ("ppo", 2), ("memopd", 0), ("memopd", 1), ("memopd", 2),
                           ("memopd_persistent", 0), ("memopd_persistent", 1), ("memopd_persistent", 2),
                           ("memopd_self", 5)]
    assert runs.horizons == {"q2_test": "Q2"}  # a null label drops its benchmark
    assert runs.control() == ({"ppo": [0, 1, 2], "memopd_persistent": [0, 1, 2], "memopd": [0, 1, 2],
                               "memopd_self": [5]}, "q2_test")
    fixed = TrainRuns.from_section({**train, "matched_control": {"seeds": [7], "benchmark": "q2_dev"}})
    assert fixed.control() == ({m: [7] for m in ("ppo", "memopd_persistent", "memopd", "memopd_self")}, "q2_dev")
    with pytest.raises(ConfigError, match="config section 'train' has no 'student'"):
        TrainRuns.from_section({k: v for k, v in train.items() if k != "student"})
    with pytest.raises(ConfigError, match=r"unknown train.matched_control keys \['seed'\]"):
        TrainRuns.from_section({**train, "matched_control": {"seed": [1]}})
    with pytest.raises(ConfigError, match=r"train.per_method.ppo: unknown keys \['lr'\]"):
        TrainRuns.from_section({**train, "per_method": {"ppo": {"lr": 1e-3}}})


def test_a_steps_resources_are_the_default_overlaid_by_its_own():
    """resources.of(step): the embedded default's `default` overlaid key by key with `rules.<step>` (a plain dict
    merge here), the gpu 0 where neither names it; an unknown key is refused naming its place."""
    import yaml

    from memopd.config import JobResources, ResourcesConfig
    from memopd.inputs import ConfigError

    section = yaml.safe_load((ROOT / "config/config.yaml").read_text())["resources"]
    res = ResourcesConfig.from_dict(section)
    assert section["rules"], "the embedded default overlays some steps"
    for step in [*section["rules"], "a_step_with_no_entry"]:
        merged = dict(section["default"])
        for k, v in section["rules"].get(step, {}).items():
            merged[k] = v
        assert dataclasses.asdict(res.of(step)) == {"gpu": 0, "gpu_model": None, **merged}, step
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert set(schema["$defs"]["job"]["properties"]) == {f.name for f in dataclasses.fields(JobResources)}
    with pytest.raises(ConfigError, match=r"unknown resources.rules.sft keys \['cpus'\]"):
        ResourcesConfig.from_dict({**section, "rules": {"sft": {"cpus": 4}}})
