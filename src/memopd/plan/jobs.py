"""Job accounting: one job's estimate (Job: its phases' GPU terms, host memory, disk and checks against its
resources) and the terms several jobs share (CUDA context, the dense index, a vLLM engine, rollouts, FSDP, scoring)."""
from __future__ import annotations

from dataclasses import dataclass, field

from memopd.config import JobResources
from memopd.inputs import ConfigError
from memopd.plan.inputs import PlanInputs
from memopd.plan.memory import act_per_token, call_input, kv_per_token
from memopd.plan.models import BYTES, GB, Spec, resolve


@dataclass
class Job:
    """One job's estimate. `phases`: per-GPU (or, without GPUs, in-RAM) terms of each phase, the peak is the
    largest phase; `host`: host-only terms of the whole job; `host_phases`: host terms of a moment that replace
    the whole job's (a resume: nothing else is loaded yet), each phase with the job's `processes`; `disk`: what it
    leaves on disk (and transiently); `checks`: further (what, need, limit) constraints, e.g. a vLLM engine
    inside its share."""
    name: str
    rule: str
    gpus: int
    mem_limit: float
    gpu_limit: float
    phases: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    host_phases: dict = field(default_factory=dict)
    disk: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    note: str = ""  # said with each failure: what a site can do about it

    def add(self, phase: str, term: str, nbytes: float, formula: str) -> None:
        self.phases.setdefault(phase, {})[term] = (float(nbytes), formula)

    def peak(self) -> tuple[str, float]:
        if not self.phases:
            return "-", 0.0
        return max(((ph, sum(v for v, _ in t.values())) for ph, t in self.phases.items()), key=lambda x: x[1])

    def add_host(self, phase: str, term: str, nbytes: float, formula: str) -> None:
        self.host_phases.setdefault(phase, {})[term] = (float(nbytes), formula)

    def host_terms(self) -> dict:
        """The host terms of the largest host moment: the whole job's, or a host phase's with the processes."""
        own = {**self.host, **({} if self.gpus else self.phases.get(self.peak()[0], {}))}  # no GPU: the device is RAM
        moments = [own] + [{"processes": self.host["processes"], **t} for t in self.host_phases.values()]
        return max(moments, key=lambda t: sum(v for v, _ in t.values()))

    def host_peak(self) -> float:
        return sum(v for v, _ in self.host_terms().values())

    def failures(self) -> list[str]:
        out = []
        phase, gpu = self.peak()
        if self.gpus and gpu > self.gpu_limit:
            out.append(f"{self.name}: needs {gpu / GB:.1f} GB per GPU ({phase} phase) > {self.gpu_limit / GB:.0f} GB "
                       f"(plan.gpu_memory_gb); largest: {self._largest(self.phases[phase])}")
        host = self.host_peak()
        if host > self.mem_limit:
            out.append(f"{self.name}: needs {host / GB:.1f} GB host memory > mem_mb {self.mem_limit / 1e6:.0f}; "
                       f"largest: {self._largest(self.host_terms())}")
        out += [f"{self.name}: {what} needs {need / GB:.1f} GB > {limit / GB:.1f} GB" for what, need, limit in self.checks
                if need > limit]
        return [f"{line} ({self.note})" for line in out] if self.note else out

    @staticmethod
    def _largest(terms: dict) -> str:
        k, (v, f) = max(terms.items(), key=lambda kv: kv[1][0])
        return f"{k} {v / GB:.1f} GB = {f}"


def _resources(p: PlanInputs, rule: str) -> JobResources:
    return p.resources.of(rule)


def _job(p: PlanInputs, rule: str, instance: str = "", resources_of: str | None = None) -> Job:
    r, pl = _resources(p, resources_of or rule), p.plan
    job = Job(f"{rule}[{instance}]" if instance else rule, rule, r.gpu, r.mem_mb * 1e6, pl.gpu_memory_gb * GB)
    procs = max(job.gpus, 1)
    job.host["processes"] = (procs * pl.process_gb * GB, f"{procs} x plan.process_gb {pl.process_gb}")
    return job


def _common(job: Job, p: PlanInputs, phase: str) -> None:
    if job.gpus:
        c = p.plan.cuda_context_gb
        job.add(phase, "CUDA context", c * GB, f"plan.cuda_context_gb {c}")
    if job.gpus > 1:  # NCCL's own buffers of the job's process group (not the tensors it moves)
        n = p.plan.nccl_gb
        job.add(phase, "NCCL buffers", n * GB, f"plan.nccl_gb {n}")


def _retriever(job: Job, p: PlanInputs, copies: int = 1, building: bool = False) -> None:
    """The dense index (memopd.retrieval.dense); BM25 (embedded default) is not modelled. Loaded: embeddings.npy
    and passages.arrow are memory-mapped, so the float32 embeddings are page cache the job's processes share
    (counted once: a cgroup is charged for the file pages its processes touch; an exact search touches them
    all), plus per process one search block of scores (queries x search_block x 17 B: float32 scores, int64
    candidates and their merge). Building: one shard at a time (its texts and float32 embeddings, twice while
    encoding and writing, + the encoded text), whatever the corpus size."""
    r, corpus = p.retrieval, p.plan.corpus
    if r.backend != "e5" or not corpus:
        return
    dense = r.dense
    d = resolve(dense.model, p).hidden
    n = corpus["passages"]
    if building:
        sh = min(dense.shard_passages, n)
        text = corpus["text_gb"] * GB / n  # bytes per passage
        job.host["index shard"] = (sh * (2 * d * 4 + 2 * text),
                                   f"shard_passages {sh:,} x (2 x {d} x 4 B + 2 x {text:.0f} B of text)")
        return
    block, queries = dense.search_block, 512
    job.host["index (page cache)"] = (n * d * 4, f"{n:,} passages x {d} x 4 B, memory-mapped, shared by the job")
    job.host["search blocks"] = (copies * queries * block * 17,
                                 f"{copies} x {queries} queries x search_block {block:,} x 17 B")


def _vllm(job: Job, phase: str, spec: Spec, util: float, max_len: int | None, tp: int = 1,
          where: str = "rollout.vllm") -> float:
    """An engine's share of the GPU, checked against its weights and the KV cache of one sequence of max_len tokens
    (None: the model's max_position_embeddings, the length vLLM takes by default); `where` names its settings."""
    max_len = max_len or spec.max_positions
    if max_len is None:
        raise ConfigError(f"{where}.max_model_len: null, and model {spec.name} states no max_position_embeddings:"
                          " set it")
    g = job.gpu_limit
    job.add(phase, "vLLM engine", util * g, f"gpu_memory_utilization {util} x {g / GB:.0f} GB")
    need = spec.weights("bfloat16") / tp + max_len * kv_per_token(spec) / tp
    job.checks.append((f"vLLM engine ({spec.name} weights + KV of one {max_len}-token sequence) inside its share",
                       need, util * g))
    return util * g


def _rollouts(job: Job, p: PlanInputs, phase: str, spec: Spec, benchmark: str, max_new: int, episodes: int,
              weights: bool = True, util: float | None = None) -> None:
    """The agent's generation: a vLLM engine (rollout.backend vllm; its GPU share `util`, else rollout.vllm's:
    config.EngineConfig) or the model itself (hf: its weights unless the caller holds them,
    `weights=False`, and the KV cache of the episodes generated together)."""
    ro = p.rollout
    if ro.vllm_engine:
        _vllm(job, phase, spec, util or ro.vllm.gpu_memory_utilization, ro.vllm.max_model_len)
        return
    dt, n = ro.dtype, min(episodes, ro.batch_size)
    tokens = call_input(p, max_new) + max_new
    if weights:
        job.add(phase, "weights", spec.weights(dt), f"P {spec.params:,} x {BYTES[dt]} B")
    job.add(phase, "KV cache", n * tokens * kv_per_token(spec, BYTES[dt]),
            f"{n} episodes x {tokens} tokens x L x 2 x kv x {BYTES[dt]} B")


def _fsdp(job: Job, phase: str, m: Spec, dtype: str, models: int = 1, what: str = "") -> None:
    """FSDP2's unsharded memory of `models` trained copies of `m` (see memopd.plan.memory)."""
    b = BYTES[dtype]
    job.add(phase, "FSDP gathered", models * (2 * m.layer_params + m.root_params) * b,
            f"{what}(2 x P_layer + P_root {m.root_params:,}) x {b} B")
    job.add(phase, "FSDP root grads", models * m.root_params * (b + 4), f"{what}P_root x ({b} + 4) B")


def _scoring(job: Job, p: PlanInputs, spec: Spec, dtype: str, tokens: int,
             terms: list[tuple[str, float, str]]) -> None:
    """A no-grad scoring job: weights, one layer's activations at a time, and the comparison's `terms`."""
    _common(job, p, "scoring")
    job.add("scoring", "weights", spec.weights(dtype), f"P {spec.params:,} x {BYTES[dtype]} B")
    job.add("scoring", "forward (no grad)", tokens * act_per_token(spec, dtype) / spec.layers,
            f"T_pack {tokens} x one layer's activations")
    for term, nbytes, formula in terms:
        job.add("scoring", term, nbytes, formula)
