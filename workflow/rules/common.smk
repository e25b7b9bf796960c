# Shared helpers: config validation, the memopd command, job resources and software environments,
# per-step code dependencies (code()).
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.utils import validate


validate(config, schema="../schemas/config.schema.yaml")
# A horizon set to null is not evaluated: Snakemake merges config files mapping by mapping, so a file layered over
# another (config/study/smoke.yaml over config/study/base.yaml) can only remove a horizon this way.
config["train"]["horizons"] = {b: h for b, h in config["train"]["horizons"].items() if h is not None}
if not config["train"]["horizons"]:
    raise ValueError("config train.horizons: every horizon is null; at least one benchmark must be evaluated")

LOGS = "results/logs"

# Every step runs this checkout's src/ (what code() tracks) with `python -m memopd.cli`: under the
# interpreter running Snakemake (the venv, activated or not), or under the step's conda/container env
# when a deployment method is on (those envs hold dependencies only). Both are passed through the
# environment, which jobs inherit (on SLURM too), so that the command, and with it the params Snakemake
# compares to decide reruns, does not change with the venv or checkout path. PYTHONPATH is set inside
# the command because Snakemake clears it when it activates a conda env.
SRC = os.path.join(workflow.basedir, "src")
_deployed = bool(getattr(workflow.deployment_settings, "deployment_method", None))
os.environ.update(MEMOPD_SRC=SRC, MEMOPD_PYTHON="python" if _deployed else sys.executable)
PYTHON_ONLINE = 'PYTHONPATH="$MEMOPD_SRC${PYTHONPATH:+:$PYTHONPATH}" "$MEMOPD_PYTHON"'

# Paper scale (config `hub`, src/memopd/prefetch.py): compute nodes have no network. The local rule `prefetch`
# (workflow/rules/prefetch.smk) downloads every hub repository the config names, at its pinned commit, into the
# cache hub.home on the shared file system; the steps that read the hub take its manifest (HUB_MANIFEST) as an
# input. Every other step runs offline: HF_HUB_OFFLINE=1 (a hub request fails at once instead of hanging) with
# HF_HOME the shared cache, and JOB_CONFIG (what cfg_json passes) names each repository by its local snapshot
# directory. Without a hub section (the embedded default, which never reaches the hub) nothing changes.
sys.path.insert(0, SRC)  # this checkout's library, as the jobs run it
try:
    from memopd.codegraph import command_hash, command_targets, package_hash
    from memopd.config import (RULES, BenchmarksConfig, HubConfig, ResourcesConfig, StudyConfig, TrainRuns,
                               eval_job_config, method_section, plan_config, teacher_config)
    from memopd.data.compose import task_sets
    from memopd.methods import METHODS, teacher_model
    from memopd.prefetch import encodings_dir, hub_repos, localize
    from memopd.report.archive import chain_evals
    from memopd.report.archive import contents as archive_contents
    from memopd.schema import merge_files
    from memopd.study.chain import chain_config
finally:
    sys.path.remove(SRC)
COMMANDS = command_targets(Path(SRC))  # "audit alignment" -> "memopd.audit.commands:cmd_audit_alignment"
HUB = HubConfig.from_dict(config["hub"]) if config.get("hub") else None
RUNS = TrainRuns.from_section(config["train"])  # which runs: each method on its seeds, the matched control's
HUB_REPOS = hub_repos(config) if HUB else []  # refuses an unpinned repository before any job starts
HUB_MANIFEST = ["results/prefetch/manifest.json"] if HUB else []
JOB_CONFIG = localize(config)
# Every job also gets the tiktoken encodings that vLLM's gpt-oss loads at start-up (prefetched into hub.home) and
# compile caches of its own in node-local temporary space: vLLM, Triton and Inductor otherwise share ~/.cache
# among all concurrent engines of a cluster.
_CACHE = '"${TMPDIR:-/tmp}/memopd-cache-$$'
_OFFLINE = (f"HF_HOME={shlex.quote(HUB.home)} HF_HUB_OFFLINE=1 "
            f"TIKTOKEN_ENCODINGS_BASE={shlex.quote(str(encodings_dir(HUB.home)))} "
            f'VLLM_CACHE_ROOT={_CACHE}/vllm" TRITON_CACHE_DIR={_CACHE}/triton" '
            f'TORCHINDUCTOR_CACHE_DIR={_CACHE}/inductor" ') if HUB else ""
# config `label` (the controlled study): every table caption starts with it (memopd.outputs.LABEL_VAR)
_LABEL = f"MEMOPD_LABEL={shlex.quote(config['label'])} " if config.get("label") else ""
PYTHON = _LABEL + _OFFLINE + PYTHON_ONLINE
MEMOPD = f"{PYTHON} -m memopd.cli"

# Conda environments by kind of step (paths relative to this folder), used with
# `--software-deployment-method conda`. ENV_GPU marks the steps that run on GPUs at paper scale (vLLM,
# CUDA torch); on the embedded default they run on CPU, so they get the CPU environment.
ENV_CPU = "../../envs/cpu.yaml"
ENV_GPU = "../../envs/gpu.yaml" if config["scale"] in ("small", "paper") else ENV_CPU

# `snakemake --report results/report.html`: every table and figure is an output marked report(...), in a
# category per paper section, with a caption template in workflow/report/ (reST + Jinja; see there).
REPORT_BENCHMARKS, REPORT_SFT, REPORT_AUDITS, REPORT_TRAINING, REPORT_EFFICIENCY, REPORT_STUDY = (
    "1. Benchmarks and retrieval", "2. SFT", "3. Alignment audits", "4. Training", "5. Efficiency",
    "6. Controlled study")


def caption(name):
    """The report caption of a result: workflow/report/{name}.rst (paths are relative to workflow/rules/)."""
    return f"../report/{name}.rst"


def cfg_json(*keys):
    """A config section as a JSON string for `memopd ... --cfg` (quote with {params.cfg:q}), hub names as local
    snapshot directories (JOB_CONFIG)."""
    node = JOB_CONFIG
    for k in keys:
        node = node[k]
    return json.dumps(node, sort_keys=True)


def eval_cfg(benchmark):
    """What one evaluation reads (memopd.config.eval_job_config; params: a job reruns when they change, so adding
    a benchmark or a model must not rerun the evaluations already done)."""
    return json.dumps(eval_job_config(config, benchmark), sort_keys=True)


def code(command):
    """`params: code=code("audit alignment")`: the function that runs the step's `memopd` command and a hash of
    the code it can import (memopd.codegraph: its import closure, read from the source). A change to that code
    changes the param, so Snakemake's params rerun trigger reruns the step and what depends on it; a change to
    code the command never imports reruns nothing. The statements registering the command's arguments are part
    of it (a default the rule does not pass is a setting of the step); the rest of the CLI's assembly (cli.py, the
    other commands' registration) parses arguments and computes nothing."""
    if command not in COMMANDS:
        raise ValueError(f"code({command!r}): no such memopd command")
    return command_hash(command, Path(SRC), targets=COMMANDS)


RESOURCES = ResourcesConfig.from_dict(config["resources"])


def job_threads(name):
    """Threads of step `name` at this scale (config resources: default overlaid by rules.<name>); the
    SLURM executor asks for as many CPUs per task, `-c N` caps them on a local run."""
    return RESOURCES.of(name).threads


def job_resources(name):
    """cpus_per_task, mem_mb, runtime (minutes) and gpu (count) of step `name` at this scale, for
    `resources: **...`. cpus_per_task repeats threads so that a dry run (which caps threads at its
    --cores) still shows what SLURM will be asked for. gpu is always set (0 on CPU steps) so commands
    can read it; gpu_model only with GPUs, since the SLURM executor turns a model alone into a one-GPU
    request. A step with several GPUs also gets nodes=1 (the executor's --nodes=1): its one task runs
    torchrun --standalone (`launcher`), which starts every rank on that task's node, so GPUs SLURM placed
    on another node would be out of reach."""
    spec = RESOURCES.of(name)
    res = {"cpus_per_task": spec.threads, "mem_mb": spec.mem_mb, "runtime": spec.runtime, "gpu": spec.gpu}
    if res["gpu"] and spec.gpu_model:
        res["gpu_model"] = spec.gpu_model
    if res["gpu"] > 1:
        res["nodes"] = 1
    return res


def launcher(wildcards, resources):
    """The memopd command of a multi-GPU step (`params: launch=launcher`, then `{params.launch} ...`):
    torchrun with one worker per GPU inside the job's single SLURM task (the executor starts one task
    per job), the plain CLI with one GPU or none."""
    n = int(resources.get("gpu", 0) or 0)
    if n > 1:
        return f"{PYTHON} -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node {n} -m memopd.cli"
    return MEMOPD


def check_resources_config():
    """Fail early on resource entries for steps that do not exist (a typo would silently fall back
    to the defaults). Called at the end of the Snakefile, once every step is defined."""
    # rule kb and rule study exist only when config `kb` / `study` is given; a config may keep their
    # resources while leaving them out (config.yaml keeps the study's for the documented study command)
    conditional = {"kb", "study"}
    unknown = set(RESOURCES.rules) - {r.name for r in workflow.rules} - conditional
    if unknown:
        raise ValueError(f"config resources.rules names unknown steps: {sorted(unknown)}")


def check_eval_config():
    """The eval step writes one file per benchmark of eval.benchmarks: the trained runs' horizons, the
    matched control's benchmark and the SFT summary's q2_test must be among them (else no rule could
    make their evaluations)."""
    needed = set(RUNS.horizons) | {RUNS.matched_control.benchmark, "q2_test"}
    missing = needed - set(config["eval"]["benchmarks"])
    if missing:
        raise ValueError(f"config eval.benchmarks lacks {sorted(missing)} (train.horizons, "
                         "train.matched_control.benchmark and the SFT summary read them)")


def check_tokenizers_config():
    """Refuse, before any job starts, a student and a teacher (config models) whose tokenizers differ: OPD
    compares their distributions id by id. Offline and cheap (memopd.vocab reads tokenizer.json from a
    local directory or the Hugging Face cache); a tokenizer not available yet (a hub name never downloaded,
    a model this pipeline builds) is checked by the train step before it loads any model."""
    sys.path.insert(0, SRC)  # this checkout's library, as the jobs run it
    try:
        from memopd.vocab import check_model_specs
    finally:
        sys.path.remove(SRC)
    check_model_specs(JOB_CONFIG["models"])  # paper scale: the prefetched snapshots, once they are there


def check_plan():
    """The onstart check (workflow/rules/plan.smk): with plan.enforce, refuse a run whose jobs do not fit their
    resources (memopd.plan), before any job starts; it plans the rules of the jobs Snakemake is about to run
    (every modelled job if the DAG is not available)."""
    if not plan_config(config).enforce:
        return
    from snakemake.exceptions import WorkflowError

    sys.path.insert(0, SRC)  # this checkout's library, as the jobs run it
    try:
        from memopd.plan import failures, plan
    finally:
        sys.path.remove(SRC)
    try:
        rules = {job.rule.name for job in workflow.dag.needrun_jobs()}
    except AttributeError:
        rules = None
    bad = failures(config, plan(config, rules))
    if bad:
        raise WorkflowError("resource plan: these jobs do not fit their resources (`memopd plan --config ...` "
                            "prints every term; set plan.enforce: false to run anyway):\n  " + "\n  ".join(bad))


def sft_init(wildcards):
    """SFT starts from the model sft.{role}.init names (e.g. the teacher from student_sft), else from the
    role's LM pre-training when sft.pretrain gives it a budget, else from its init."""
    if config["sft"][wildcards.role].get("init"):
        return f"results/models/{config['sft'][wildcards.role]['init']}/model.safetensors"
    stage = "lm" if (config["sft"].get("pretrain") or {}).get(wildcards.role) else "init"
    return f"results/models/{wildcards.role}_{stage}/model.safetensors"


def train_teacher(wildcards):
    """The frozen teacher, for the methods that score it (memopd.methods; `ppo` does not: its runs need not wait
    for it). `memopd_self`'s teacher is the SFT student itself."""
    model = teacher_model(wildcards.method, config["train"])
    return {"teacher": f"results/models/{model}/model.safetensors"} if model else {}


def model_init_inputs(w):
    """Tiny models need the tokenizer trained here; pretrained ones bring their own (so the tokenizer step
    is not part of the paper-scale DAG), and one built by this pipeline (results/models/...) is an input."""
    spec = config["models"][w.role]
    if "pretrained" not in spec:
        return {"tokenizer": "results/models/tokenizer/tokenizer.json"}
    if spec["pretrained"].startswith("results/"):
        return {"base": os.path.join(spec["pretrained"], "model.safetensors")}
    return {}
