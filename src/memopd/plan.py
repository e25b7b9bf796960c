"""Resource plan: every job's peak GPU memory, host memory and disk, estimated from the config and checked
against the job's resources before anything runs (`memopd plan`; the workflow's onstart check).

Units: GB = 1e9 bytes. Limits are read conservatively: plan.gpu_memory_gb per GPU (an "80 GB" H100 holds
85.5e9 bytes), resources mem_mb x 1e6 bytes (SLURM's MB is a MiB), plan.disk_gb for results/ + data/.

Notation: P parameters, b bytes of the job's dtype (fp32 4, bf16 2), h hidden, L layers, i intermediate,
kv = kv heads x head dim, V vocabulary, T tokens of the sequence in flight, W ranks (GPUs) of the job,
S ways a model is sharded (W under FSDP, else 1), G = plan.gpu_memory_gb.

  term                 bytes                          why
  weights              P * b                          a model held for inference in its dtype
  trained (AdamW)      P * 16 / S                     fp32 weights 4 (they are the master weights:
                                                      train/parallel.py, sft/trainer.py) + fp32 grads 4
                                                      + AdamW exp_avg 4 + exp_avg_sq 4
  FSDP gathered        (2 P_layer + P_root) * b_p     FSDP2 (train.shard / sft.shard fsdp): the unit in use and
                                                      the one prefetched (2 decoder layers) all-gathered in the
                                                      param dtype b_p (bf16 2, fp32 4), + the root unit (P_root:
                                                      embeddings, final norm, LM head), which stays gathered from
                                                      the forward through the backward (parallel.shard: FSDP2
                                                      does not reshard the root after forward)
  FSDP root grads      P_root * (b_p + 4)             the root's unsharded gradient (param dtype) and its fp32
                                                      copy for the reduce-scatter (reduce_dtype fp32): the
                                                      largest unit's, at the end of the backward
  DDP buckets          P * 4                          DistributedDataParallel's gradient buckets (default
                                                      gradient_as_bucket_view=False: a second fp32 copy)
  autocast casts       2 * L * P_layer                bf16 autocast over fp32 weights caches a bf16 copy of
                                                      every matmul weight for the backward (measured);
                                                      FSDP2 with param_dtype bf16 gathers bf16, no cast
  activations          T * L * a                      saved for the backward, per token and decoder layer:
                         fp32:  a = 32h + 8kv + 16i   4 B x (8h + 2kv + 4i)
                         bf16:  a = 30h + 4kv + 8i    autocast: the residual stream and RMSNorm stay fp32.
                                                      Structure of Korthikanti et al. 2022 (arXiv 2205.05198,
                                                      sec. 4.1: 34sbh + 5as^2b per GPT layer in fp16) adapted
                                                      to Qwen2: no dropout, SwiGLU keeps 4 i-sized tensors,
                                                      GQA, and no s^2 term (fused attention keeps no scores).
                                                      The coefficients are measured: the tensors autograd
                                                      saves in transformers' Qwen2 (tests/test_plan.py; bf16
                                                      under CPU autocast, which casts the same matmuls as
                                                      CUDA's; GPU kernels not measured here)
  ... checkpointed     T * (L * 4h + a)               per-layer activation checkpointing (train/parallel.py
                                                      checkpoint_activations: non-reentrant checkpoint of each
                                                      decoder layer's forward): autograd keeps only each layer's
                                                      input, the residual stream (4h: fp32 under autocast; bf16
                                                      under FSDP's param_dtype, so an upper bound), and one
                                                      layer's activations a exist at a time, recomputed in its
                                                      backward (Korthikanti et al. 2022, sec. 5: "full
                                                      recomputation" keeps 2sbh per layer in fp16; the rotary
                                                      cos/sin all layers share is T x head_dim x 8 B, omitted)
  attention scores     L * heads * T_q * T_k * 4      only where a kernel keeps them: eager anywhere, sdpa's
                                                      math kernel (a mask on the CPU); measured on the CPU
  loss chunk           n * C * V * 16                 chunked full-vocabulary heads (losses.py, sft/loss.py):
                                                      fp32 logits, log-softmax, softmax and their gradient
                                                      of C rows (an allowance, not measured); n models at
                                                      once (OPD: student + teacher)
  RCE chunk            C * V * (2b + 32)              rce.rce_backend (RCE, the training guard, the context-
                                                      update audit): full-vocabulary logits exist C = rce.CHUNK
                                                      action positions at a time (COMPARE_CHUNK): packed and
                                                      independent logits (b each), their float64 copies,
                                                      difference and |difference| (rce.token_stats); the audits'
                                                      chunks likewise (STATE_BYTES, DIVERGENCE_BYTES)
  compared hidden      (N + N_pack) * h * b           the reference's final hidden states at all N action
                                                      tokens (independent calls, run one at a time) + one
                                                      pack's, from which the chunks' logits are computed
  per-token values     N * 32                         what the statistics are reduced from: |d log p| (4),
                                                      the row's max |d logit| (8), top-1 (1), targets (8), and
                                                      a call's copies (an allowance)
  KV cache             tokens * L * 2 * kv * b        keys and values of every layer
  vLLM engine          util * G                       an engine takes gpu_memory_utilization of the whole GPU
                                                      at start; inside it: weights + KV of one max_model_len
                                                      sequence (vLLM refuses to start otherwise)
  teacher hidden       N * h_T * b                    score_batch keeps the teacher's hidden states at the
                                                      teacher positions of every episode of the rank
  index (host)         N_p * d * 4                    once per job: the memory-mapped float32 embeddings
                                                      (page cache its processes share; passages.arrow is
                                                      mapped too, touched at hit rows only); + per process
                                                      a search block; building: one shard at a time
  checkpoint (host)    W * 4 * (P + P_c) + 8 * (P+P_c) train: every rank gathers whole fp32 policy + critic,
                                                      rank 0 also the AdamW state (train/loop.save_checkpoint)

Sequence bounds come from the limits, not from typical lengths (a plan that holds for the worst episode the
config allows): a call's input is q + the rule's context (capped by agent.max_input_tokens, beyond which the
rollout ends the episode), its response <= max_new_tokens, and a packed episode holds q once + every call's
context and response: T_pack = q + turns * (input - q + max_new). q = plan.prompt_tokens (allowance for the
system prompt + questions), observations = max_observation_tokens + plan.observation_overhead (tags, hint).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from memopd import cost
from memopd.agent.memory import RULES

GB = 1e9
BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "auto": 2}
DEFAULTS = {"gpu_memory_gb": 80, "disk_gb": 1000, "process_gb": 4.0, "cuda_context_gb": 1.0, "prompt_tokens": 512,
            "observation_overhead": 64, "models": {}, "corpus": None}
# The full-vocabulary comparisons run on chunks of COMPARE_CHUNK action positions (= memopd.rce.CHUNK; not imported:
# the plan needs no torch). Bytes per (position of a chunk, vocabulary entry), besides the b-byte logits:
COMPARE_CHUNK = 1024
RCE_BYTES = 32  # rce.token_stats: float64 copies of both logits (8 + 8), then logits - ref (8) and its .abs() (8)
STATE_BYTES = 16  # audit.alignment.state_rows, one side at a time: float64 logits and their float64 log-softmax
DIVERGENCE_BYTES = 56  # teacher_divergence: two float64 logits, two log-softmaxes, exp, difference, product
TOKEN_BYTES = 32  # per-token values the statistics are reduced from (see "per-token values")


# ---------------------------------------------------------------------------------------------- model specs
@dataclass
class Spec:
    """The sizes of a model that memory depends on."""
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    params: int = 0
    head_dim: int = 0
    tied: bool = False
    weights_gb: float | None = None  # stored size when not params x dtype (quantised: gpt-oss MXFP4)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads
        self.params = self.params or qwen2_params(self)

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (embeddings, final norm, untied head): FSDP's root unit."""
        return self.params - self.layers * (self.layer_params + self.heads * self.head_dim + 2 * self.kv + 2 * self.hidden)

    @property
    def layer_params(self) -> int:  # matmul weights of one decoder layer (what autocast casts)
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv + 3 * self.hidden * self.intermediate

    def weights(self, dtype: str) -> float:
        return self.weights_gb * GB if self.weights_gb else self.params * BYTES[dtype]


def qwen2_params(m: Spec) -> int:
    """Qwen2 / Llama parameter count: embeddings, per layer q/k/v (+ biases), o, SwiGLU, two RMSNorms, the final
    norm and an untied head (Qwen2.5-3B: 3,085,938,688; -7B: 7,615,616,512)."""
    q = m.heads * m.head_dim
    layer = m.layer_params + q + 2 * m.kv + 2 * m.hidden
    return m.vocab * m.hidden * (1 if m.tied else 2) + m.layers * layer + m.hidden


def spec_from_config(name: str, c: dict) -> Spec:
    """From a Hugging Face config.json (or a plan.models entry with the same keys)."""
    s = Spec(name, c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
             c.get("num_key_value_heads") or c["num_attention_heads"], c["intermediate_size"], c["vocab_size"],
             params=c.get("params", 0), head_dim=c.get("head_dim") or 0, tied=bool(c.get("tie_word_embeddings")),
             weights_gb=c.get("weights_gb"))
    if c.get("model_type") == "bert" and not c.get("params"):  # e5: embeddings (+ positions, types), 12 layers, pooler
        h, i = s.hidden, s.intermediate
        s.params = (s.vocab + c.get("max_position_embeddings", 512) + c.get("type_vocab_size", 2) + 2) * h \
            + s.layers * (4 * h * h + 2 * h * i + i + 9 * h) + h * h + h
    return s


def cached_config(name: str) -> dict | None:
    """config.json of a local model directory or of a hub name already in the Hugging Face cache (offline)."""
    p = Path(name) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json")
        return json.loads(Path(hit).read_text()) if isinstance(hit, str) else None
    except (ImportError, ValueError, OSError):  # no hub library, not a repo id: the table must have it
        return None


def resolve(name: str, cfg: dict) -> Spec:
    """A model by hub name or directory: its cached config.json, completed by plan.models[name] (params, or the
    stored size of a quantised model, which config.json lacks); plan.models alone when nothing is cached."""
    table = _plan(cfg)["models"].get(name)
    found = cached_config(name)
    if found is None and table is None:
        raise ValueError(f"no config.json for model {name!r} offline: add its sizes to config plan.models")
    return spec_from_config(name, {**(table or {}), **(found or {})})


def role_spec(cfg: dict, role: str) -> Spec:
    """The student or teacher (config models.<role>): pretrained by name/path, or a tiny model from its sizes."""
    m = cfg["models"][role]
    if "pretrained" in m:
        return resolve(m["pretrained"], cfg)
    return spec_from_config(role, {**m, "vocab_size": cfg["tokenizer"]["vocab_size"]})


def model_role(name: str) -> str:
    """results/models/{name}: teacher_* are the teacher; student_* and trained runs ({method}_seed{s}) the student."""
    return "teacher" if name.startswith("teacher") else "student"


# ------------------------------------------------------------------------------------------------ formulas
def act_per_token(m: Spec, dtype: str, checkpointing: bool = False) -> float:
    """Activation bytes saved per token over the whole decoder (see the module docstring)."""
    a = 32 * m.hidden + 8 * m.kv + 16 * m.intermediate if BYTES[dtype] == 4 else \
        30 * m.hidden + 4 * m.kv + 8 * m.intermediate
    return m.layers * 4 * m.hidden + a if checkpointing else m.layers * a


def resolve_backend(m: Spec, backend: str, gpu: bool, ckpt: bool, dtype: str, q: int, calls: int, own: int) -> str:
    """The path a pack of one episode (q, `calls` calls of `own` tokens) runs on: `auto` picks as
    attention.choose_backend does (memopd.cost, forward + backward)."""
    if backend != "auto":
        return backend
    cands = cost.candidates(True, ckpt, "cuda" if gpu else "cpu")
    dims = cost.Dims.of_config(m.hidden, m.layers, m.heads, m.kv_heads, m.intermediate, m.head_dim)
    return cost.choose([(q, [own] * calls)], dims, cands,
                       cost.weights("cuda" if gpu else "cpu", dtype, "forward_backward"), "cuda" if gpu else "cpu")


def attention_scores(m: Spec, backend: str, gpu: bool, b: int, tokens: int, q: int, calls: int, own: int) -> float:
    """Attention probabilities one layer keeps for the backward: none with FlexAttention or, on a GPU, sdpa's
    fused kernels (masks included); the math kernel (sdpa with a mask on the CPU) and eager keep heads x
    queries x keys. prefix_shared and segmented run each call over q + its own tokens; calls each over
    q + its own tokens as queries and keys. `backend` is a path, not auto (resolve_backend)."""
    if backend == "eager":
        return m.heads * tokens * tokens * b
    if gpu or backend == "flex":
        return 0.0
    if backend in ("prefix_shared", "segmented"):  # segmented: each call's block over q + its own tokens
        return m.heads * calls * own * (q + own) * b
    if backend == "calls":
        return m.heads * calls * (q + own) ** 2 * b
    return m.heads * tokens * tokens * b


def kv_per_token(m: Spec, b: int = 2) -> float:
    return m.layers * 2 * m.kv * b


def max_turns(agent: dict, benchmark: str) -> int:
    """As agent.rollout.AgentConfig.max_turns: turns[name], else turns[name without _train/_test], else default."""
    t = {k.lower(): v for k, v in agent["turns"].items()}
    b = benchmark.lower()
    return int(t.get(b, t.get(re.sub(r"_(train|test|dev|val)$", "", b), t["default"])))


def call_input(cfg: dict, max_new: int, rule: str | None = None) -> int:
    """Longest input of one call: q + the rule's context (memory.build_input), capped by agent.max_input_tokens
    (a longer input ends the episode)."""
    a, p = cfg["agent"], _plan(cfg)
    q, obs, rule = p["prompt_tokens"], a["max_observation_tokens"] + p["observation_overhead"], rule or a["rule"]
    context = {"suffix_retention": min(a.get("suffix_tokens", 32), max_new) + obs,
               "sliding_window": a.get("window", 2) * (max_new + obs)}.get(rule, max_new + obs)
    return min(q + context, a["max_input_tokens"])


def episode_tokens(cfg: dict, benchmark: str, max_new: int, rule: str | None = None) -> tuple[int, int]:
    """(packed tokens, sampled action tokens) of the longest episode the limits allow: q once, then every call's
    context and response."""
    q, turns = _plan(cfg)["prompt_tokens"], max_turns(cfg["agent"], benchmark)
    return q + turns * (call_input(cfg, max_new, rule) - q + max_new), turns * max_new


def new_tokens(value, benchmark: str, default: int) -> int:
    """A max_new_tokens setting: null (the default), a number, or {default: n, <benchmark>: m}."""
    if isinstance(value, dict):
        value = value.get(benchmark, value.get("default"))
    return int(value if value is not None else default)


# --------------------------------------------------------------------------------------------------- jobs
@dataclass
class Job:
    """One job's estimate. `phases`: per-GPU (or, without GPUs, in-RAM) terms of each phase, the peak is the
    largest phase; `host`: host-only terms of the whole job; `disk`: what it leaves on disk (and transiently);
    `checks`: further (what, need, limit) constraints, e.g. a vLLM engine inside its share."""
    name: str
    rule: str
    gpus: int
    mem_limit: float
    gpu_limit: float
    phases: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    disk: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)

    def add(self, phase: str, term: str, nbytes: float, formula: str) -> None:
        self.phases.setdefault(phase, {})[term] = (float(nbytes), formula)

    def peak(self) -> tuple[str, float]:
        if not self.phases:
            return "-", 0.0
        return max(((ph, sum(v for v, _ in t.values())) for ph, t in self.phases.items()), key=lambda x: x[1])

    def host_peak(self) -> float:
        own = sum(v for v, _ in self.host.values())
        return own if self.gpus else own + self.peak()[1]  # without GPUs the device is the host

    def failures(self) -> list[str]:
        out = []
        phase, gpu = self.peak()
        if self.gpus and gpu > self.gpu_limit:
            out.append(f"{self.name}: needs {gpu / GB:.1f} GB per GPU ({phase} phase) > {self.gpu_limit / GB:.0f} GB "
                       f"(plan.gpu_memory_gb); largest: {self._largest(self.phases[phase])}")
        host = self.host_peak()
        if host > self.mem_limit:
            terms = {**self.host, **({} if self.gpus else self.phases.get(phase, {}))}
            out.append(f"{self.name}: needs {host / GB:.1f} GB host memory > mem_mb {self.mem_limit / 1e6:.0f}; "
                       f"largest: {self._largest(terms)}")
        out += [f"{self.name}: {what} needs {need / GB:.1f} GB > {limit / GB:.1f} GB" for what, need, limit in self.checks
                if need > limit]
        return out

    @staticmethod
    def _largest(terms: dict) -> str:
        k, (v, f) = max(terms.items(), key=lambda kv: kv[1][0])
        return f"{k} {v / GB:.1f} GB = {f}"


def _plan(cfg: dict) -> dict:
    return {**DEFAULTS, **(cfg.get("plan") or {})}


def _resources(cfg: dict, rule: str) -> dict:
    r = dict(cfg["resources"]["default"])
    r.update(cfg["resources"]["rules"].get(rule, {}))
    return r


def _job(cfg: dict, rule: str, instance: str = "", resources_of: str | None = None) -> Job:
    r, p = _resources(cfg, resources_of or rule), _plan(cfg)
    job = Job(f"{rule}[{instance}]" if instance else rule, rule, int(r.get("gpu", 0)), r["mem_mb"] * 1e6,
              p["gpu_memory_gb"] * GB)
    procs = max(job.gpus, 1)
    job.host["processes"] = (procs * p["process_gb"] * GB, f"{procs} x plan.process_gb {p['process_gb']}")
    return job


def _common(job: Job, cfg: dict, phase: str) -> None:
    if job.gpus:
        c = _plan(cfg)["cuda_context_gb"]
        job.add(phase, "CUDA context", c * GB, f"plan.cuda_context_gb {c}")


def _retriever(job: Job, cfg: dict, copies: int = 1, building: bool = False) -> None:
    """The dense index (memopd.retrieval.dense); BM25 (embedded default) is not modelled. Loaded: embeddings.npy
    and passages.arrow are memory-mapped, so the float32 embeddings are page cache the job's processes share
    (counted once: a cgroup is charged for the file pages its processes touch; an exact search touches them
    all), plus per process one search block of scores (queries x search_block x 17 B: float32 scores, int64
    candidates and their merge). Building: one shard at a time (its texts and float32 embeddings, twice while
    encoding and writing, + the encoded text), whatever the corpus size."""
    r, corpus = cfg["retrieval"], _plan(cfg)["corpus"]
    if r["backend"] != "e5" or not corpus:
        return
    dense = r["dense"]
    d = resolve(dense["model"], cfg).hidden
    n = corpus["passages"]
    if building:
        sh = min(dense.get("shard_passages", n), n)
        text = corpus["text_gb"] * GB / n  # bytes per passage
        job.host["index shard"] = (sh * (2 * d * 4 + 2 * text),
                                   f"shard_passages {sh:,} x (2 x {d} x 4 B + 2 x {text:.0f} B of text)")
        return
    block, queries = dense.get("search_block", 65536), 512
    job.host["index (page cache)"] = (n * d * 4, f"{n:,} passages x {d} x 4 B, memory-mapped, shared by the job")
    job.host["search blocks"] = (copies * queries * block * 17,
                                 f"{copies} x {queries} queries x search_block {block:,} x 17 B")


def _vllm(job: Job, cfg: dict, phase: str, spec: Spec, util: float, max_len: int, tp: int = 1) -> float:
    g = job.gpu_limit
    job.add(phase, "vLLM engine", util * g, f"gpu_memory_utilization {util} x {g / GB:.0f} GB")
    need = spec.weights("bfloat16") / tp + max_len * kv_per_token(spec) / tp
    job.checks.append((f"vLLM engine ({spec.name} weights + KV of one {max_len}-token sequence) inside its share",
                       need, util * g))
    return util * g


def _rollouts(job: Job, cfg: dict, phase: str, spec: Spec, benchmark: str, max_new: int, episodes: int,
              weights: bool = True, util: float | None = None) -> None:
    """The agent's generation: a vLLM engine (rollout.backend vllm; its GPU share `util`, else rollout.vllm's, else
    evaluate.make_backend's default 0.85) or the model itself (hf: its weights unless the caller holds them,
    `weights=False`, and the KV cache of the episodes generated together)."""
    ro = cfg["rollout"]
    if ro.get("backend", "hf") == "vllm":
        v = ro.get("vllm", {})
        _vllm(job, cfg, phase, spec, util or v.get("gpu_memory_utilization", 0.85), v.get("max_model_len", 16384))
        return
    dt, n = ro.get("dtype", "float32"), min(episodes, ro["batch_size"])
    tokens = call_input(cfg, max_new) + max_new
    if weights:
        job.add(phase, "weights", spec.weights(dt), f"P {spec.params:,} x {BYTES[dt]} B")
    job.add(phase, "KV cache", n * tokens * kv_per_token(spec, BYTES[dt]),
            f"{n} episodes x {tokens} tokens x L x 2 x kv x {BYTES[dt]} B")


def _fsdp(job: Job, phase: str, m: Spec, dtype: str, models: int = 1, what: str = "") -> None:
    """FSDP2's unsharded memory of `models` trained copies of `m` (see the module docstring)."""
    b = BYTES[dtype]
    job.add(phase, "FSDP gathered", models * (2 * m.layer_params + m.root_params) * b,
            f"{what}(2 x P_layer + P_root {m.root_params:,}) x {b} B")
    job.add(phase, "FSDP root grads", models * m.root_params * (b + 4), f"{what}P_root x ({b} + 4) B")


def plan_train(cfg: dict) -> list[Job]:
    t, ro = cfg["train"], cfg["rollout"]
    job = _job(cfg, "train")
    w = max(job.gpus, 1)
    s = w if t.get("shard", "none") == "fsdp" and w > 1 else 1
    dt, ckpt = t.get("dtype", "float32"), bool(t.get("activation_checkpointing", False))
    pol, tea = role_spec(cfg, "student"), role_spec(cfg, "teacher")
    k = t.get("critic_layers") or pol.layers  # critic = the policy's first k decoder layers + a scalar head
    pc = pol.params - (pol.layers - k) * pol.layer_params + pol.hidden + 1
    both = 1 + k / pol.layers  # policy + critic, in units of the policy's decoder
    tokens, actions = episode_tokens(cfg, t["benchmark"], ro["max_new_tokens"])
    local = math.ceil(t["batch_tasks"] / w)
    opd = any(m != "ppo" for m in t["methods"])
    for ph in ("rollout", "scoring", "update"):
        _common(job, cfg, ph)
        job.add(ph, "policy + critic (AdamW)", (pol.params + pc) * 16 / s, f"(P + P_critic) x 16 B / {s}")
        job.add(ph, "reference", pol.params * 4 / s, f"P x 4 B / {s}")
        if opd:
            job.add(ph, "teacher replica", tea.weights(dt), f"P_T {tea.params:,} x {BYTES[dt]} B")
    v = t.get("vllm", {})
    sleeping = ro.get("backend", "hf") == "vllm" and v.get("sleep", False)
    if ro.get("backend", "hf") == "vllm":
        for ph in ("rollout",) if sleeping else ("rollout", "scoring", "update"):
            _vllm(job, cfg, ph, pol, v.get("gpu_memory_utilization", 0.9), ro.get("vllm", {}).get("max_model_len", 16384))
    else:  # hf: the policy itself generates, gathered whole when sharded
        _rollouts(job, cfg, "rollout", pol, t["benchmark"], ro["max_new_tokens"], local, weights=False)
        if s > 1:
            job.add("rollout", "gathered policy", pol.params * BYTES[dt], f"P x {BYTES[dt]} B")
    if s > 1:  # parallel.gathered(policy, ref, critic): three whole models in the FSDP param dtype while scoring
        job.add("scoring", "gathered policy, ref, critic", 3 * pol.params * BYTES[dt], f"3 x P x {BYTES[dt]} B")
    big = tea if opd else pol  # the largest model scored: one layer's activations alive at a time
    job.add("scoring", "forward (no grad)", tokens * act_per_token(big, dt) / big.layers,
            f"T_pack {tokens} x one layer's activations")
    n = min(t["ppo"].get("rce_sample", 0), local)  # the RCE guard before every update (rce.guard -> rce_backend)
    if n:
        for term, nbytes, formula in _rce_terms(pol, BYTES[dt], n * actions, actions,
                                                f"{n} episodes x {actions} actions"):
            job.add("scoring", f"RCE guard: {term}", nbytes, formula)
    for ph in ("scoring", "update"):
        if opd:
            job.add(ph, "teacher hidden", local * actions * tea.hidden * BYTES[dt],
                    f"{local} episodes x {actions} actions x h_T x {BYTES[dt]} B")
    job.add("update", "activations (policy + critic)", both * tokens * act_per_token(pol, dt, ckpt),
            f"(1 + {k}/{pol.layers}) models x T_pack {tokens} x {'checkpointed ' if ckpt else ''}a({dt}) x L")
    q, turns, backend = _plan(cfg)["prompt_tokens"], max_turns(cfg["agent"], t["benchmark"]), t["ppo"]["backend"]
    own = call_input(cfg, ro["max_new_tokens"]) - q + ro["max_new_tokens"]
    backend = resolve_backend(pol, backend, job.gpus > 0, ckpt, dt, q, turns, own)
    scores = attention_scores(pol, backend, job.gpus > 0, 4, tokens, q, turns, own)
    if scores:
        job.add("update", "attention scores", both * (1 if ckpt else pol.layers) * scores,
                f"(1 + {k}/{pol.layers}) models x {1 if ckpt else 'L'} x {backend} scores (heads x queries x keys x 4 B)")
    if BYTES[dt] == 2 and s == 1:
        job.add("update", "autocast casts", 2 * 2 * pol.layers * pol.layer_params, "2 models x 2 B x L x P_layer")
    if s > 1:
        _fsdp(job, "update", pol, dt, 2, "2 models x ")
    c = t["ppo"]["chunk_size"]
    job.add("update", "loss chunk", (2 if opd else 1) * c * pol.vocab * 16, f"{2 if opd else 1} x {c} x V x 16 B")
    if job.gpus:  # a checkpoint: every rank gathers whole fp32 policy + critic on the CPU, rank 0 also AdamW's state
        job.host["checkpoint gather"] = (w * (pol.params + pc) * 4 + (pol.params + pc) * 8,
                                         f"{w} ranks x (P + P_critic) x 4 B + (P + P_critic) x 8 B")
    if sleeping:
        job.host["vLLM sleep offload"] = (w * pol.weights("bfloat16"), f"{w} x P x 2 B (sleep level 1)")
    _retriever(job, cfg, copies=w)
    runs = len(t["methods"]) * len(t["seeds"])
    job.disk["exports"] = (runs * pol.params * BYTES[dt], f"{runs} runs x P x {BYTES[dt]} B")
    if not t.get("keep_checkpoint", False):
        job.disk["checkpoints (transient)"] = (runs * (pol.params + pc) * 12, f"{runs} runs at once x 12 B x (P + P_critic)")
    else:
        job.disk["checkpoints"] = (runs * (pol.params + pc) * 12, f"{runs} runs x 12 B x (P + P_critic)")
    return [job]


def _sft_job(cfg: dict, rule: str, role: str, seq_len: int) -> Job:
    sft = cfg["sft"]
    job = _job(cfg, rule, role)
    m, w = role_spec(cfg, role), max(job.gpus, 1)
    s = w if sft.get("shard", "none") == "fsdp" and w > 1 else 1
    dt = "bfloat16" if sft.get("precision") == "bf16" else "float32"
    ckpt = bool(sft.get("activation_checkpointing", False))
    _common(job, cfg, "step")
    job.add("step", "model (AdamW)", m.params * 16 / s, f"P {m.params:,} x 16 B / {s}")
    if w > 1 and s == 1:
        job.add("step", "DDP buckets", m.params * 4, "P x 4 B")
    if BYTES[dt] == 2 and s == 1:
        job.add("step", "autocast casts", 2 * m.layers * m.layer_params, "2 B x L x P_layer")
    if s > 1:
        _fsdp(job, "step", m, dt)
    job.add("step", "activations", seq_len * act_per_token(m, dt, ckpt),
            f"seq_len {seq_len} x {'checkpointed ' if ckpt else ''}a({dt}) x L")
    if sft.get("backend") != "segmented":  # segmented: sdpa per example with is_causal, no mask, no scores kept
        scores = attention_scores(m, sft.get("backend", "sdpa"), job.gpus > 0, 4, seq_len, 0, 1, seq_len)
        if scores:
            job.add("step", "attention scores", (1 if ckpt else m.layers) * scores, "L x heads x seq_len^2 x 4 B")
    job.add("step", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B (sft/loss.py _CHUNK)")
    if job.gpus:  # copied off the GPU to be written
        job.host["checkpoint"] = (m.params * 12, "P x (4 + 8) B: model + AdamW state serialised by rank 0")
    job.disk[f"{role} model"] = (m.params * 4, "P x 4 B (fp32 export) + transient checkpoint P x 12 B")
    return job


def plan_sft(cfg: dict) -> list[Job]:
    sft, jobs = cfg["sft"], []
    for role in ("student", "teacher"):
        jobs.append(_sft_job(cfg, "sft_train", role, sft["seq_len"]))
        if ((sft.get("pretrain") or {}).get(role) or {}).get("steps"):  # as sft.trainer.pretrain_steps
            jobs.append(_sft_job(cfg, "sft_pretrain", role, sft["seq_len"]))
    m = role_spec(cfg, "teacher")  # sft_eval: fp32 forward of the largest model, no grad
    job = _job(cfg, "sft_eval", "teacher_sft")
    jobs.append(job)
    _common(job, cfg, "forward")
    job.add("forward", "weights", m.weights("float32"), "P x 4 B")
    job.add("forward", "forward (no grad)", sft["seq_len"] * act_per_token(m, "float32") / m.layers,
            f"seq_len {sft['seq_len']} x one layer's activations")
    job.add("forward", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B")
    m = role_spec(cfg, "student")  # bench_sft: a fp32 AdamW copy per path (sft/bench.py PATHS) of student_init
    job = _job(cfg, "bench_sft")
    _common(job, cfg, "step")
    job.add("step", "model + 3 path copies (AdamW)", m.params * 4 + 3 * m.params * 16, "P x 4 B + 3 x P x 16 B")
    job.add("step", "activations", sft["seq_len"] * act_per_token(m, "float32"), f"seq_len {sft['seq_len']} x a(fp32) x L")
    job.add("step", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B")
    return jobs + [job]


def _scoring(job: Job, cfg: dict, spec: Spec, dtype: str, tokens: int, terms: list[tuple[str, float, str]]) -> None:
    """A no-grad scoring job: weights, one layer's activations at a time, and the comparison's `terms`."""
    _common(job, cfg, "scoring")
    job.add("scoring", "weights", spec.weights(dtype), f"P {spec.params:,} x {BYTES[dtype]} B")
    job.add("scoring", "forward (no grad)", tokens * act_per_token(spec, dtype) / spec.layers,
            f"T_pack {tokens} x one layer's activations")
    for term, nbytes, formula in terms:
        job.add("scoring", term, nbytes, formula)


def _rce_terms(spec: Spec, b: int, n: int, per_pack: int, why: str, c: int = COMPARE_CHUNK) -> list:
    """rce.rce_backend over n action tokens (`why`), packs of up to `per_pack` of them: one chunk of both sides'
    logits, the hidden states they come from, the per-token values."""
    c = min(c, n)
    return [("RCE chunk", c * spec.vocab * (2 * b + RCE_BYTES), f"C {c} x V x (2 x {b} + {RCE_BYTES}) B"),
            ("compared hidden", (n + per_pack) * spec.hidden * b,
             f"({why}: N {n:,} + one pack's {per_pack:,}) x h x {b} B"),
            ("per-token values", n * TOKEN_BYTES, f"N {n:,} x {TOKEN_BYTES} B")]


def plan_scoring(cfg: dict) -> list[Job]:
    """RCE smoke, RCE of rollouts and the alignment audits (no grad, full-vocabulary comparisons)."""
    jobs, ro = [], cfg["rollout"]
    rc = cfg["rce"]
    st = role_spec(cfg, "student")
    b = BYTES[rc["dtype"]]
    calls, resp = rc["calls"], max(rc["response_tokens"])
    tokens = rc["prefix_tokens"] + calls * (max(rc["observation_tokens"]) + 2 * resp)  # a retained copy per call
    job = _job(cfg, "rce_smoke")
    _scoring(job, cfg, st, rc["dtype"], tokens, _rce_terms(st, b, rc["episodes"] * calls * resp, calls * resp,
                                                           f"{rc['episodes']} episodes x {calls} calls x {resp}"))
    jobs.append(job)
    rr = cfg["rce_rollouts"]  # rollouts (the engine stays up), then RCE of each rule's episodes at once
    audit = cfg["audit"]
    am = role_spec(cfg, model_role(audit["model"]))
    max_new = new_tokens(rr.get("max_new_tokens"), rr["benchmark"], ro["max_new_tokens"])
    tokens, actions = max(episode_tokens(cfg, rr["benchmark"], max_new, r) for r in rr.get("rules") or RULES)
    job = _job(cfg, "rce_rollouts")
    _rollouts(job, cfg, "scoring", am, rr["benchmark"], max_new, rr["tasks"], util=rr.get("gpu_memory_utilization"))
    b, n = BYTES[rr["dtype"]], rr["tasks"] * actions
    terms = _rce_terms(am, b, n, actions, f"{rr['tasks']} tasks x {actions} action tokens")
    # agent.evaluate.behaviour_mismatch: rce.independent_token_logprobs, the LM head COMPARE_CHUNK tokens at a time
    c = min(COMPARE_CHUNK, n)
    terms.append(("behaviour chunk", c * am.vocab * (b + 8), f"evaluate.behaviour_mismatch: C {c} x V x ({b} + 4 + 4) B"))
    _scoring(job, cfg, am, rr["dtype"], tokens, terms)
    _retriever(job, cfg)
    jobs.append(job)
    dt, bench = audit["dtype"], audit["benchmark"]
    b = BYTES[dt]
    max_new = new_tokens(audit.get("max_new_tokens"), bench, ro["max_new_tokens"])
    tokens, actions = episode_tokens(cfg, bench, max_new, audit.get("rule"))
    for rule, n in (("audit_episodes", audit["episodes"]), ("audit_rule_episodes", audit["rule_episodes"])):
        job = _job(cfg, rule, resources_of="audit_episodes")  # `use rule audit_episodes as audit_rule_episodes`
        _common(job, cfg, "rollout")
        _rollouts(job, cfg, "rollout", am, bench, max_new, n)
        _retriever(job, cfg)
        jobs.append(job)
    n = min(8, audit["episodes"]) * actions  # audit.alignment.state_rows: 8 episodes at a time
    c = min(COMPARE_CHUNK, n)
    for rule in ("audit_alignment", "audit_state_corruption"):
        job = _job(cfg, rule)
        _scoring(job, cfg, am, dt, tokens, [
            ("state chunk", c * am.vocab * (b + STATE_BYTES), f"C {c} x V x ({b} + {STATE_BYTES}) B"),
            ("compared hidden", 2 * n * am.hidden * b,
             f"reference + state: 2 x {min(8, audit['episodes'])} episodes x {actions} action tokens x h x {b} B"),
            ("per-token values", n * TOKEN_BYTES, f"N {n:,} x {TOKEN_BYTES} B")])
        jobs.append(job)
    job = _job(cfg, "audit_teacher_divergence")  # one episode at a time, exact and flattened teacher logits
    te, c = role_spec(cfg, model_role(audit["teacher"])), min(COMPARE_CHUNK, actions)
    _scoring(job, cfg, te, dt, tokens, [
        ("teacher chunk", c * te.vocab * (b + DIVERGENCE_BYTES), f"C {c} x V x ({b} + {DIVERGENCE_BYTES}) B"),
        ("compared hidden", 2 * actions * te.hidden * b, f"exact + flattened: 2 x {actions} action tokens x h_T x {b} B"),
        ("per-token values", actions * TOKEN_BYTES, f"N {actions:,} x {TOKEN_BYTES} B")])
    jobs.append(job)
    tokens, actions = max(episode_tokens(cfg, bench, max_new, r) for r in RULES)
    job = _job(cfg, "audit_context_updates")
    _scoring(job, cfg, am, dt, tokens, _rce_terms(am, b, audit["rule_episodes"] * actions, actions,
                                                  f"{audit['rule_episodes']} episodes x {actions} action tokens"))
    jobs.append(job)
    jobs.append(_packing_job(cfg, am))
    return jobs


def _packing_job(cfg: dict, am: Spec) -> Job:
    """audit_packing_efficiency on the real audit episodes (audit.packing.real: `episodes` episodes cut to T calls,
    T up to the largest of `calls`, null = agent turns), the audit model in fp32; the synthetic sweep's tiny model
    is negligible. Scoring (no grad, all episodes at once): every path's hidden states at the sampled tokens, log-probs
    and RCE error `COMPARE_CHUNK` positions at a time. Timed forward+backward (packing_bench.measure, one episode at a
    time): weights, gradients, and the largest timed path's activations and attention scores over one episode, the
    longest the limits allow (q + T calls of input + response): independent_batched pads T calls of L tokens,
    `calls` runs each call over q + its own tokens, the other packed paths hold T_pack tokens. With
    audit.packing.activation_checkpointing each layer keeps its input and one layer's activations and scores exist
    at a time; prefix_shared then runs forward only."""
    audit, ro, pk = cfg["audit"], cfg["rollout"], cfg["audit"]["packing"]
    bench, rule, gpu = audit["benchmark"], audit.get("rule"), _resources(cfg, "audit_packing_efficiency").get("gpu", 0) > 0
    max_new = new_tokens(audit.get("max_new_tokens"), bench, ro["max_new_tokens"])
    turns, q = max_turns(cfg["agent"], bench), _plan(cfg)["prompt_tokens"]
    T = min(turns, max(c or turns for c in pk["real"]["calls"]))
    L = call_input(cfg, max_new, rule) + max_new  # one call: its input and response
    own, dt = L - q, "float32"
    tokens, actions = q + T * own, T * max_new
    real, b = pk["real"]["episodes"], BYTES[dt]
    n, c = real * actions, min(COMPARE_CHUNK, real * actions)
    job = _job(cfg, "audit_packing_efficiency")
    _scoring(job, cfg, am, dt, tokens, [
        ("logits chunk", c * am.vocab * (4 * b + 8),
         f"RCE error: C {c} x V x (2 x {b} logits + 2 x 4 log-softmax + 2 x {b} difference) B"),
        ("compared hidden", 2 * n * am.hidden * b, f"reference + path: 2 x {real} episodes x {actions} x h x {b} B")])
    ph = "timed forward+backward"
    _common(job, cfg, ph)
    job.add(ph, "weights + gradients", 2 * am.weights(dt), f"2 x P {am.params:,} x {b} B")
    ckpt = bool(pk.get("activation_checkpointing", False))
    untimed = {"eager", "flex"} | ({"prefix_shared"} if ckpt else set())  # packing_bench.measure: RCE or forward only
    paths = [("independent_batched", T * L, attention_scores(am, "calls", gpu, 4, T * L, 0, T, L),
              f"{T} calls x L {L} (padded)")]
    for name in dict.fromkeys(resolve_backend(am, x, gpu, ckpt, dt, q, T, own)
                              for x in (pk.get("backends") or audit["backends"])):
        if name not in untimed:
            paths.append((f"packed_{name}", T * L if name == "calls" else tokens,
                          attention_scores(am, name, gpu, 4, tokens, q, T, own),
                          f"{T} calls x (q {q} + {own})" if name == "calls" else f"T_pack {tokens}"))
    a, layers = act_per_token(am, dt, ckpt), 1 if ckpt else am.layers
    name, toks, scores, what = max(paths, key=lambda x: x[1] * a + layers * x[2])
    job.add(ph, "activations", toks * a, f"{name}: {what} tokens x {'checkpointed ' if ckpt else ''}a(fp32) x L")
    if scores:
        job.add(ph, "attention scores", layers * scores,
                f"{name}: {1 if ckpt else 'L'} x heads x queries x keys x 4 B")
    c = min(COMPARE_CHUNK, actions)
    job.add(ph, "log-prob chunk", c * am.vocab * 16, f"rce.chunked_token_logprobs: C {c} x V x 16 B")
    return job


def plan_rollouts(cfg: dict) -> list[Job]:
    """Evaluation of the largest evaluated model, and the LLM teacher's trajectories."""
    ev, t, ro = cfg["eval"], cfg["train"], cfg["rollout"]
    names = list(ev["models"]) + [f"{m}_seed{s}" for m in t["methods"] for s in t["seeds"]]
    role = max({model_role(n) for n in names}, key=lambda r: role_spec(cfg, r).params)
    m = role_spec(cfg, role)
    job = _job(cfg, "eval", role)
    _common(job, cfg, "rollout")
    bench = max(ev["benchmarks"], key=lambda b: new_tokens(ev.get("max_new_tokens"), b, ro["max_new_tokens"]))
    _rollouts(job, cfg, "rollout", m, bench, new_tokens(ev.get("max_new_tokens"), bench, ro["max_new_tokens"]),
              ro["batch_size"])
    _retriever(job, cfg)
    jobs = [job]
    te = cfg["teacher"]
    job = _job(cfg, "sft_trajectories")
    if te["kind"] == "llm" and te["llm"].get("engine") == "server" and not te["llm"].get("url"):
        sv = te["llm"]["server"]
        _common(job, cfg, "serving")
        _vllm(job, cfg, "serving", resolve(te["llm"]["model"], cfg), sv["gpu_memory_utilization"], sv["max_model_len"],
              sv.get("tensor_parallel_size", 1))
        job.host["vLLM server process"] = (_plan(cfg)["process_gb"] * GB, "plan.process_gb")
    _retriever(job, cfg)
    return jobs + [job]


def plan_data(cfg: dict) -> list[Job]:
    """Model downloads and the dense index (host memory and disk)."""
    jobs = []
    for role in ("student", "teacher"):
        spec = cfg["models"][role]
        if "pretrained" in spec and not spec["pretrained"].startswith("results/"):
            m, b = role_spec(cfg, role), BYTES[spec.get("dtype", "bfloat16")]
            job = _job(cfg, "model_init", role)  # the loaded model + safetensors' serialisation buffer
            job.host["model"] = (2 * m.params * b, f"2 x P x {b} B")
            job.disk[f"{role}_init"] = (m.params * b, f"P x {b} B")
            jobs.append(job)
    r, corpus = cfg["retrieval"], _plan(cfg)["corpus"]
    if r["backend"] == "e5" and corpus:
        e5, d = resolve(r["dense"]["model"], cfg), r["dense"]
        job = _job(cfg, "retrieval_index")
        _common(job, cfg, "encode")
        job.add("encode", "weights", e5.weights("float16"), "P x 2 B")
        bt, lt = d["batch_size"], d["max_length"]
        job.add("encode", "batch", bt * lt * (4 * e5.hidden + 2 * (e5.intermediate + 4 * e5.hidden) + 2 * e5.heads * lt),
                f"{bt} x {lt} tokens x (fp32 output 4h + one layer 2(i + 4h) + scores 2 heads x {lt}) B")
        _retriever(job, cfg, building=True)
        emb = corpus["passages"] * e5.hidden * 4
        job.disk["index"] = (emb + corpus["text_gb"] * GB, f"{corpus['passages']:,} x {e5.hidden} x 4 B + passages")
        job.disk["corpus (download + parquet)"] = (2 * corpus["text_gb"] * GB, "2 x text_gb")
        jobs.append(job)
        job = _job(cfg, "retrieval_recall")
        _retriever(job, cfg)
        jobs.append(job)
    return jobs


PLANNERS = (plan_data, plan_rollouts, plan_sft, plan_scoring, plan_train)


def plan(cfg: dict, rules=None) -> list[Job]:
    """Every modelled job of `cfg` (only those of `rules` when given)."""
    jobs = [j for f in PLANNERS for j in f(cfg)]
    return [j for j in jobs if rules is None or j.rule in rules]


def disk_need(jobs: list[Job]) -> float:
    return sum(v for j in jobs for v, _ in j.disk.values())


def failures(cfg: dict, jobs: list[Job]) -> list[str]:
    out = [f for j in jobs for f in j.failures()]
    disk, limit = disk_need(jobs), _plan(cfg)["disk_gb"] * GB
    if disk > limit:
        out.append(f"disk: results + data need {disk / GB:.0f} GB > plan.disk_gb {limit / GB:.0f}")
    return out


def rows(jobs: list[Job]) -> list[dict]:
    out = []
    for j in jobs:
        phase, gpu = j.peak()
        out.append({"job": j.name, "gpus": j.gpus, "peak_phase": phase,
                    "gpu_gb": round(gpu / GB, 1) if j.gpus else "", "gpu_limit_gb": round(j.gpu_limit / GB) if j.gpus else "",
                    "host_gb": round(j.host_peak() / GB, 1), "host_limit_gb": round(j.mem_limit / GB, 1),
                    "disk_gb": round(sum(v for v, _ in j.disk.values()) / GB, 1), "fits": not j.failures()})
    return out


def markdown(cfg: dict, jobs: list[Job]) -> str:
    r = rows(jobs)
    keys = list(r[0]) if r else []
    lines = [f"Resource plan ({cfg.get('scale', '?')} scale; GB = 1e9 B; GPU figures per GPU, host per job)", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(x[k]) for k in keys) + " |" for x in r]
    lines += ["", f"disk (all jobs): {disk_need(jobs) / GB:.0f} GB of plan.disk_gb {_plan(cfg)['disk_gb']}", ""]
    for j in jobs:
        phase = j.peak()[0]
        totals = ", ".join(f"{ph} {sum(v for v, _ in t.values()) / GB:.1f}" for ph, t in j.phases.items())
        lines += [f"### {j.name}", "", f"{j.gpus} GPU(s); GB per {'GPU' if j.gpus else 'job'} by phase: {totals or '-'}",
                  "", "| where | term | GB | formula |", "|---|---|---|---|"]
        terms = [(f"{'GPU' if j.gpus else 'RAM'} {phase}", k, v) for k, v in j.phases.get(phase, {}).items()]
        terms += [("host", k, v) for k, v in j.host.items()] + [("disk", k, v) for k, v in j.disk.items()]
        lines += [f"| {w} | {k} | {v / GB:.2f} | {f} |" for w, k, (v, f) in terms]
        lines += [f"| check | {what} | {need / GB:.2f} | <= {lim / GB:.1f} |" for what, need, lim in j.checks] + [""]
    return "\n".join(lines)


def load_config(paths: list[str]) -> dict:
    """YAML config files merged in order, as Snakemake merges --configfile (later keys win, dicts deep)."""
    import yaml

    def merge(a, b):
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}

    cfg: dict = {}
    for p in paths:
        cfg = merge(cfg, yaml.safe_load(Path(p).read_text()))
    return cfg


def cmd_plan(args, cfg):
    import sys

    cfg = cfg or load_config(args.config or ["config/config.yaml"])
    if args.gpu_memory_gb is not None:
        cfg = {**cfg, "plan": {**(cfg.get("plan") or {}), "gpu_memory_gb": args.gpu_memory_gb}}
    jobs = plan(cfg, set(args.rules) if args.rules else None)
    text = markdown(cfg, jobs)
    print(text)
    if args.out:
        from memopd.report.tables import write_csv

        write_csv(args.out, rows(jobs))
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    bad = failures(cfg, jobs)
    if bad:
        msg = "plan: does not fit:\n  " + "\n  ".join(bad)
        if args.no_refuse:
            print(msg)
        else:
            sys.exit(msg)
    else:
        print(f"plan: all {len(jobs)} modelled jobs fit")


def add_parser(add, sub) -> None:
    """`memopd plan` (registered by memopd.cli)."""
    sp = add("plan", cmd_plan, "estimate every job's peak GPU / host memory and disk; refuse what does not fit", sub)
    sp.add_argument("--config", nargs="+", help="config YAML file(s), merged in order (default config/config.yaml); "
                    "--cfg JSON (the whole config) takes precedence")
    sp.add_argument("--rules", nargs="+", help="only the jobs of these rules")
    sp.add_argument("--gpu-memory-gb", type=float, help="override plan.gpu_memory_gb (what-if)")
    sp.add_argument("--out", help="CSV of the summary (the Markdown plan is written beside it)")
    sp.add_argument("--no-refuse", action="store_true", help="report jobs that do not fit, exit 0")
