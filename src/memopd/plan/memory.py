"""Bytes of each term of a job's memory: per token and layer, per sequence, per comparison chunk, and the
sequence bounds they are taken over.

Notation: P parameters, b bytes of the job's dtype (fp32 4, bf16 2), h hidden, L layers, i intermediate,
kv = kv heads x head dim, V vocabulary, T tokens of the sequence in flight, W ranks (GPUs) of the job,
S ways a model is sharded (W under FSDP, else 1), G = plan.gpu_memory_gb.

  term                 bytes                          why
  weights              P * b                          a model held for inference in its dtype
  trained (AdamW)      P * 16 / S                     fp32 weights 4 (they are the master weights:
                                                      parallel.py, sft/trainer.py) + fp32 grads 4
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
  ... checkpointed     T * (L * 4h + a)               per-layer activation checkpointing (parallel.py
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
  per-token values     N * 56                         what the statistics are reduced from: |d log p| (4),
                                                      the row's max |d logit| (8), top-1 (1), targets (8), the
                                                      row's largest |logit| (8) and the two tolerances it gives
                                                      (16, rce.allowed), and a call's copies (an allowance)
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
  checkpoint (host)    W * 12 * (P + P_c) / S         train, W > 1: every rank copies what it holds (fp32
                                                      weights + AdamW state) to host memory and writes it in the
                                                      background (harness.Harness.save); one
                                                      process: 12 * (P + P_c), whole
  load (train)         2 * P * 4 + P * 4 / S + util*G  models sharded as they are built (train/loop.build_models):
                                                      the fp32 policy whole, the reference's shard and the
                                                      critic's deep copy whole (before it keeps its first layers
                                                      and is sharded), beside the vLLM engine's share, created
                                                      first; the teacher loads last (steady phases)
  load (SFT, S > 1)    P * 4                          every rank loads the fp32 model whole, then shards it
  allocator reserve    0 beyond the live tensors      at the engine's wake-up (weight_sync.WeightSync.sync):
                                                      empty_cache first returns every segment without a live
                                                      tensor; assumed: the segments that hold live tensors hold
                                                      no freed block (no fragmentation). Without empty_cache
                                                      the scoring / update peak stays reserved
  sync tensor          V * h * 4                      a sync gathers one whole fp32 tensor at a time (the
                                                      largest: the embedding)
  vLLM weights         P * 2                          at the wake-up from sleep (level 2: the weights were
                                                      dropped, no host copy): the engine's weights wake
                                                      first, the sync writes them, then its KV cache wakes
  resume (host)        (P + P_c) * 12 (+ W*2*V*h*4/S) train: the checkpoint's files cached once per node
                                                      (one process: mapped; W > 1: each rank reads its pieces
                                                      of the sharded checkpoint, one tensor at a time);
                       P * 12                         SFT: both mapped (checkpoint.read_state), one copy; a
                                                      resume holds nothing else yet (the index loads after it)
  NCCL buffers         plan.nccl_gb                   every phase of a job of several GPUs: NCCL's own buffers
  vLLM asleep          plan.vllm_asleep_gb            scoring and update with sleep mode: what sleep keeps
  load (host)          P * 4                          the loaded model's safetensors pages, once per node:
                                                      models.load_model puts each tensor on its rank's GPU
                                                      from the mapped file, no host copy per rank

Sequence bounds come from the limits, not from typical lengths (a plan that holds for the worst episode the
config allows): a call's input is q + the rule's context (capped by agent.max_input_tokens, beyond which the
rollout ends the episode), its response <= max_new_tokens, and a packed episode holds q once + every call's
context and response: T_pack = q + turns * (input - q + max_new). q = plan.prompt_tokens (allowance for the
system prompt + questions), observations = max_observation_tokens + plan.observation_overhead (tags, hint).
"""
from __future__ import annotations

from memopd import cost
from memopd.config import per_benchmark
from memopd.plan.inputs import PlanInputs
from memopd.plan.models import BYTES, Spec

# The full-vocabulary comparisons run on chunks of COMPARE_CHUNK action positions (= memopd.rce.CHUNK; not imported:
# the plan needs no torch). Bytes per (position of a chunk, vocabulary entry), besides the b-byte logits:
COMPARE_CHUNK = 1024
RCE_BYTES = 32  # rce.token_stats: float64 copies of both logits (8 + 8), then logits - ref (8) and its .abs() (8)
STATE_BYTES = 16  # audit.alignment.state_rows, one side at a time: float64 logits and their float64 log-softmax
DIVERGENCE_BYTES = 56  # teacher_divergence: two float64 logits, two log-softmaxes, exp, difference, product
TOKEN_BYTES = 56  # per-token values the statistics are reduced from (see "per-token values")


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


def _rce_terms(spec: Spec, b: int, n: int, per_pack: int, why: str, c: int = COMPARE_CHUNK) -> list:
    """rce.rce_backend over n action tokens (`why`), packs of up to `per_pack` of them: one chunk of both sides'
    logits, the hidden states they come from, the per-token values."""
    c = min(c, n)
    return [("RCE chunk", c * spec.vocab * (2 * b + RCE_BYTES), f"C {c} x V x (2 x {b} + {RCE_BYTES}) B"),
            ("compared hidden", (n + per_pack) * spec.hidden * b,
             f"({why}: N {n:,} + one pack's {per_pack:,}) x h x {b} B"),
            ("per-token values", n * TOKEN_BYTES, f"N {n:,} x {TOKEN_BYTES} B")]


# ----------------------------------------------------------------------------------------- sequence bounds
def call_input(p: PlanInputs, max_new: int, rule: str | None = None) -> int:
    """Longest input of one call: q + the rule's context (memory.build_input), capped by agent.max_input_tokens
    (a longer input ends the episode); a rule of the user's is sized as one response and one observation."""
    a = p.agent
    q, obs, rule = p.plan.prompt_tokens, a.max_observation_tokens + p.plan.observation_overhead, rule or a.rule
    context = {"suffix_retention": min(a.suffix_tokens, max_new) + obs,
               "sliding_window": a.window * (max_new + obs)}.get(rule, max_new + obs)
    return min(q + context, a.max_input_tokens)


def episode_tokens(p: PlanInputs, benchmark: str, max_new: int, rule: str | None = None) -> tuple[int, int]:
    """(packed tokens, sampled action tokens) of the longest episode the limits allow: q once, then every call's
    context and response."""
    q, turns = p.plan.prompt_tokens, p.agent.max_turns(benchmark)
    return q + turns * (call_input(p, max_new, rule) - q + max_new), turns * max_new


def new_tokens(value, benchmark: str, default: int) -> int:
    """A max_new_tokens setting: null (the default), a number, or {default: n, <benchmark>: m}."""
    value = per_benchmark(value, benchmark)
    return int(value if value is not None else default)
