"""One planner per group of rules (training, SFT, scoring and audits, rollouts, data), and `plan`: every
modelled job of a config."""
from __future__ import annotations

import math

from memopd.config import RULES, PretrainedModelConfig
from memopd.methods import method as method_spec
from memopd.plan.inputs import PlanInputs
from memopd.plan.jobs import Job, _common, _fsdp, _job, _resources, _retriever, _rollouts, _scoring, _vllm
from memopd.plan.memory import (COMPARE_CHUNK, DIVERGENCE_BYTES, STATE_BYTES, TOKEN_BYTES, _rce_terms, act_per_token,
                                attention_scores, call_input, episode_tokens, new_tokens, resolve_backend)
from memopd.plan.models import BYTES, GB, Spec, model_role, resolve, role_spec


def run_config(p: PlanInputs):
    """The training run's settings as the trainer reads them (train.config.RunConfig), for the first method trained:
    a method's own settings (train.per_method) that change memory are planned as the first method's."""
    from memopd.train.config import RunConfig

    return RunConfig.from_section(p.raw["train"], p.runs.methods[0], 0)


def plan_train(p: PlanInputs) -> list[Job]:
    t, ro, run = p.runs, p.rollout, run_config(p)
    job = _job(p, "train")
    w = max(job.gpus, 1)
    s = w if run.shard == "fsdp" and w > 1 else 1
    dt, ckpt = run.dtype, run.activation_checkpointing
    pol, tea = role_spec(p, "student"), role_spec(p, "teacher")
    k = run.critic_layers or pol.layers  # critic = the policy's first k decoder layers + a scalar head
    pc = pol.params - (pol.layers - k) * pol.layer_params + pol.hidden + 1
    both = 1 + k / pol.layers  # policy + critic, in units of the policy's decoder
    tokens, actions = episode_tokens(p, t.benchmark, ro.max_new_tokens)
    local = math.ceil(run.batch_tasks / w)
    opd = any(method_spec(m).needs_teacher for m in t.methods)
    for ph in ("rollout", "scoring", "update"):
        _common(job, p, ph)
        job.add(ph, "policy + critic (AdamW)", (pol.params + pc) * 16 / s, f"(P + P_critic) x 16 B / {s}")
        job.add(ph, "reference", pol.params * 4 / s, f"P x 4 B / {s}")
        if opd:
            job.add(ph, "teacher replica", tea.weights(dt), f"P_T {tea.params:,} x {BYTES[dt]} B")
    engine = p.rollout
    sleeping = engine.vllm_engine and run.vllm.sleep
    if engine.vllm_engine:
        for ph in ("rollout",) if sleeping else ("rollout", "scoring", "update"):
            _vllm(job, ph, pol, run.vllm.gpu_memory_utilization, engine.vllm.max_model_len)
        for ph in ("scoring", "update") if sleeping else ():  # what sleep mode does not free (CUDA graphs, its pool)
            a = p.plan.vllm_asleep_gb
            job.add(ph, "vLLM asleep", a * GB, f"plan.vllm_asleep_gb {a}")
    else:  # hf: the policy itself generates, gathered whole when sharded
        _rollouts(job, p, "rollout", pol, t.benchmark, ro.max_new_tokens, local, weights=False)
        if s > 1:
            job.add("rollout", "gathered policy", pol.params * BYTES[dt], f"P x {BYTES[dt]} B")
    if s > 1:  # parallel.gathered(policy, ref, critic): three whole models in the FSDP param dtype while scoring
        job.add("scoring", "gathered policy, ref, critic", 3 * pol.params * BYTES[dt], f"3 x P x {BYTES[dt]} B")
    big = tea if opd else pol  # the largest model scored: one layer's activations alive at a time
    job.add("scoring", "forward (no grad)", tokens * act_per_token(big, dt) / big.layers,
            f"T_pack {tokens} x one layer's activations")
    n = min(run.ppo.rce_sample, local)  # the RCE guard before every update (rce.guard -> rce_backend)
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
    q, turns, backend = p.plan.prompt_tokens, p.agent.max_turns(t.benchmark), run.ppo.attention
    own = call_input(p, ro.max_new_tokens) - q + ro.max_new_tokens
    backend = resolve_backend(pol, backend, job.gpus > 0, ckpt, dt, q, turns, own)
    scores = attention_scores(pol, backend, job.gpus > 0, 4, tokens, q, turns, own)
    if scores:
        job.add("update", "attention scores", both * (1 if ckpt else pol.layers) * scores,
                f"(1 + {k}/{pol.layers}) models x {1 if ckpt else 'L'} x {backend} scores (heads x queries x keys x 4 B)")
    if BYTES[dt] == 2 and s == 1:
        job.add("update", "autocast casts", 2 * 2 * pol.layers * pol.layer_params, "2 models x 2 B x L x P_layer")
    if s > 1:
        _fsdp(job, "update", pol, dt, 2, "2 models x ")
    c = run.ppo.chunk_size
    job.add("update", "loss chunk", (2 if opd else 1) * c * pol.vocab * 16, f"{2 if opd else 1} x {c} x V x 16 B")
    if job.gpus > 1:  # a sharded checkpoint: every rank copies what it holds (its shards, or a replica) to host memory
        job.host["checkpoint staging"] = (w * (pol.params + pc) * 12 / s,
                                          f"{w} ranks x (P + P_critic) x (4 + 8) B / {s}, held while written")
    elif job.gpus:  # one process: whole fp32 policy + critic and AdamW's state on the CPU
        job.host["checkpoint gather"] = ((pol.params + pc) * 12, "1 ranks x (P + P_critic) x 4 B + (P + P_critic) x 8 B")
    if sleeping:  # level 2: the weights are dropped, not copied to host memory (the sync rewrites them)
        _train_wake(job, pol)
    if job.gpus:
        _train_load(job, p, pol, s)
        _train_resume(job, pol.params, pc, w, s, pol.vocab * pol.hidden * 4)
    _retriever(job, p, copies=w)
    runs = len(p.runs.runs())
    job.disk["exports"] = (runs * pol.params * BYTES[dt], f"{runs} runs x P x {BYTES[dt]} B")
    if not run.keep_checkpoint:
        job.disk["checkpoints (transient)"] = (runs * (pol.params + pc) * 12, f"{runs} runs at once x 12 B x (P + P_critic)")
    else:
        job.disk["checkpoints"] = (runs * (pol.params + pc) * 12, f"{runs} runs x 12 B x (P + P_critic)")
    return [job]


def _train_load(job: Job, p: PlanInputs, pol: Spec, s: int) -> None:
    """While the models are built (train/loop.build_models): the vLLM engine is created first and takes its share,
    then the fp32 policy whole, the reference sharded as soon as it is copied, and the critic's copy whole until
    it is sharded (ValueModel keeps its first layers only after the deep copy). The teacher loads after every
    model is sharded: the steady phases hold it."""
    _common(job, p, "load")
    if p.rollout.vllm_engine:
        util = run_config(p).vllm.gpu_memory_utilization
        job.add("load", "vLLM engine", util * job.gpu_limit, f"gpu_memory_utilization {util} x {job.gpu_limit / GB:.0f} GB")
    job.add("load", "policy (fp32, whole)", pol.params * 4, f"P {pol.params:,} x 4 B (load_model)")
    _host_load(job, pol)
    job.add("load", "reference (fp32)", pol.params * 4 / s, f"P x 4 B / {s} (deepcopy, then sharded)")
    job.add("load", "critic's copy (fp32, whole)", pol.params * 4, "P x 4 B (deepcopy, all layers, before its shard)")


def _host_load(job: Job, m: Spec) -> None:
    """Host memory while a node's ranks load a model (models.load_model): every tensor goes from the mapped
    safetensors file to its GPU, so the node holds the file's pages once (shared page cache, fp32 as the SFT
    exports it) and no rank a host copy of the model."""
    job.add_host("load", "model file pages (mapped, shared by the node's ranks)", m.params * 4,
                 f"P {m.params:,} x 4 B once per node (load_model: file -> GPU, no host copy per rank)")


def _train_wake(job: Job, pol: Spec) -> None:
    """The engine's wake-up before a rollout (weight_sync.WeightSync.sync): what lives through the step, the
    allocator's reserve, the engine's weights (woken first; its KV cache only after the load) and the one whole
    tensor a sync gathers at a time (the largest: the embedding, fp32). `free_cached_memory` (empty_cache) runs
    first, so the allocator keeps only segments that hold live tensors: assumed to hold no freed block beside
    them (no fragmentation); without it the allocator would keep the scoring / update peak's reserve, stated in
    the formula. The rollout phase holds the engine's whole share after the wake-up."""
    live = {term: value for term, value in job.phases["rollout"].items() if term != "vLLM engine"}
    job.phases.setdefault("wake-up", {}).update(live)
    job.add("wake-up", "vLLM weights (woken first)", pol.weights("bfloat16"), "P x 2 B (the KV cache wakes after the sync)")
    held = max(sum(v for v, _ in job.phases[ph].values()) for ph in ("scoring", "update")) - sum(v for v, _ in live.values())
    job.add("wake-up", "allocator reserve beyond live tensors", 0.0,
            f"0 after empty_cache (no fragmentation assumed); without it max(scoring, update) - live = {held / GB:.1f} GB")
    job.add("wake-up", "sync: one whole tensor", pol.vocab * pol.hidden * 4, "V x h x 4 B (the fp32 embedding, gathered)")


def _train_resume(job: Job, p: int, pc: int, w: int, s: int, largest: float) -> None:
    """A resume (harness.Harness.resume), before the index loads. One process: safetensors maps policy and critic
    and checkpoint.read_state maps state.pt. Several: each rank reads the pieces it holds of the sharded checkpoint,
    one tensor at a time (its bytes, then the tensor, copied to the GPU). Either way the files' pages are cached once
    for the node."""
    if w == 1:
        job.add_host("resume", "weights (mapped)", (p + pc) * 4, "(P + P_critic) x 4 B, page cache")
        job.add_host("resume", "AdamW state (mapped)", (p + pc) * 8, "(P + P_critic) x 8 B: state.pt, page cache")
        return
    job.add_host("resume", "checkpoint files (page cache)", (p + pc) * 12,
                 "(P + P_critic) x (4 + 8) B, cached once for the ranks")
    job.add_host("resume", "tensor being read", w * 2 * largest / s, f"{w} ranks x 2 x V x h x 4 B / {s}")


def _sft_job(p: PlanInputs, stage: str, role: str) -> Job:
    from memopd.sft.trainer import TrainConfig, stage_section

    rule = f"sft_{'train' if stage == 'sft' else stage}"
    sft = TrainConfig.from_section(stage_section(p.raw["sft"], stage), role)  # as the stage's trainer reads it
    job = _job(p, rule, role)
    m, w, seq_len = role_spec(p, role), max(job.gpus, 1), sft.seq_len
    s = w if sft.shard == "fsdp" and w > 1 else 1
    dt, ckpt = sft.dtype, sft.activation_checkpointing
    _common(job, p, "step")
    job.add("step", "model (AdamW)", m.params * 16 / s, f"P {m.params:,} x 16 B / {s}")
    if w > 1 and s == 1:
        job.add("step", "DDP buckets", m.params * 4, "P x 4 B")
    if BYTES[dt] == 2 and s == 1:
        job.add("step", "autocast casts", 2 * m.layers * m.layer_params, "2 B x L x P_layer")
    if s > 1:
        _fsdp(job, "step", m, dt)
    job.add("step", "activations", seq_len * act_per_token(m, dt, ckpt),
            f"seq_len {seq_len} x {'checkpointed ' if ckpt else ''}a({dt}) x L")
    if sft.attention != "segmented":  # segmented: sdpa per example with is_causal, no mask, no scores kept
        scores = attention_scores(m, sft.attention, job.gpus > 0, 4, seq_len, 0, 1, seq_len)
        if scores:
            job.add("step", "attention scores", (1 if ckpt else m.layers) * scores, "L x heads x seq_len^2 x 4 B")
    job.add("step", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B (sft/loss.py _CHUNK)")
    if job.gpus and s > 1:  # sft/commands: every rank loads the fp32 model whole, then shards it (sft/trainer)
        _common(job, p, "load")
        job.add("load", "model (fp32, whole)", m.params * 4, "P x 4 B, before fully_shard")
        _host_load(job, m)
    if job.gpus:  # copied off the GPU to be written
        job.host["checkpoint"] = (m.params * 12, "P x (4 + 8) B: model + AdamW state serialised by rank 0")
        # resume (sft/trainer.load_sharded_checkpoint): weights and state mapped (checkpoint.read_state), the page
        # cache shared by the ranks; a rank copies mapped tensors straight to its GPU, keeping no host copy
        job.add_host("resume", "weights + AdamW state (mapped)", m.params * 12, "P x (4 + 8) B, page cache shared")
    job.disk[f"{role} model"] = (m.params * 4, "P x 4 B (fp32 export) + transient checkpoint P x 12 B")
    return job


def plan_sft(p: PlanInputs) -> list[Job]:
    from memopd.sft.trainer import pretrain_steps

    sft, jobs = p.raw["sft"], []
    for role in ("student", "teacher"):
        jobs.append(_sft_job(p, "sft", role))
        if pretrain_steps(sft, role):
            jobs.append(_sft_job(p, "pretrain", role))
    m = role_spec(p, "teacher")  # sft_eval: fp32 forward of the largest model, no grad
    job = _job(p, "sft_eval", "teacher_sft")
    jobs.append(job)
    _common(job, p, "forward")
    job.add("forward", "weights", m.weights("float32"), "P x 4 B")
    job.add("forward", "forward (no grad)", sft["seq_len"] * act_per_token(m, "float32") / m.layers,
            f"seq_len {sft['seq_len']} x one layer's activations")
    job.add("forward", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B")
    m = role_spec(p, "student")  # bench_sft: a fp32 AdamW copy per path (sft/bench.py PATHS) of student_init
    job = _job(p, "bench_sft")
    job.note = ("a benchmark outside `all`: the student and three AdamW copies of it on one GPU; run it with "
                "config/small.yaml's model, or leave it out with --rules")
    _common(job, p, "step")
    job.add("step", "model + 3 path copies (AdamW)", m.params * 4 + 3 * m.params * 16, "P x 4 B + 3 x P x 16 B")
    job.add("step", "activations", sft["seq_len"] * act_per_token(m, "float32"), f"seq_len {sft['seq_len']} x a(fp32) x L")
    job.add("step", "loss chunk", 2048 * m.vocab * 16, "2048 x V x 16 B")
    return jobs + [job]


def plan_scoring(p: PlanInputs) -> list[Job]:
    """RCE smoke, RCE of rollouts and the alignment audits (no grad, full-vocabulary comparisons)."""
    jobs, ro = [], p.rollout
    rc = p.rce
    st = role_spec(p, "student")
    b = BYTES[rc.dtype]
    calls, resp = rc.calls, max(rc.response_tokens)
    tokens = rc.prefix_tokens + calls * (max(rc.observation_tokens) + 2 * resp)  # a retained copy per call
    job = _job(p, "rce_smoke")
    _scoring(job, p, st, rc.dtype, tokens, _rce_terms(st, b, rc.episodes * calls * resp, calls * resp,
                                                        f"{rc.episodes} episodes x {calls} calls x {resp}"))
    jobs.append(job)
    rr = p.rce_rollouts  # rollouts (the engine stays up), then each rule's RCE
    audit, sc = p.audit, p.audit_scoring
    am = role_spec(p, model_role(audit.model))
    max_new = new_tokens(rr.max_new_tokens, rr.benchmark, ro.max_new_tokens)
    tokens, actions = max(episode_tokens(p, rr.benchmark, max_new, r) for r in rr.rules)
    job = _job(p, "rce_rollouts")
    _rollouts(job, p, "scoring", am, rr.benchmark, max_new, rr.tasks, util=rr.gpu_memory_utilization)
    b, n = BYTES[rr.dtype], rr.tasks * actions
    terms = _rce_terms(am, b, n, actions, f"{rr.tasks} tasks x {actions} action tokens")
    # evaluation.evaluate.behaviour_mismatch: rce.independent_token_logprobs, the LM head COMPARE_CHUNK tokens at a time
    c = min(COMPARE_CHUNK, n)
    terms.append(("behaviour chunk", c * am.vocab * (b + 8), f"evaluate.behaviour_mismatch: C {c} x V x ({b} + 4 + 4) B"))
    _scoring(job, p, am, rr.dtype, tokens, terms)
    _retriever(job, p)
    jobs.append(job)
    dt, bench = sc.dtype, audit.benchmark
    b = BYTES[dt]
    max_new = new_tokens(audit.max_new_tokens, bench, ro.max_new_tokens)
    tokens, actions = episode_tokens(p, bench, max_new, audit.rule)
    for rule, n in (("audit_episodes", audit.episodes), ("audit_rule_episodes", audit.rule_episodes)):
        job = _job(p, rule, resources_of="audit_episodes")  # `use rule audit_episodes as audit_rule_episodes`
        _common(job, p, "rollout")
        _rollouts(job, p, "rollout", am, bench, max_new, n)
        _retriever(job, p)
        jobs.append(job)
    n = min(8, audit.episodes) * actions  # audit.alignment.state_rows: 8 episodes at a time
    c = min(COMPARE_CHUNK, n)
    for rule in ("audit_alignment", "audit_state_corruption"):
        job = _job(p, rule)
        _scoring(job, p, am, dt, tokens, [
            ("state chunk", c * am.vocab * (b + STATE_BYTES), f"C {c} x V x ({b} + {STATE_BYTES}) B"),
            ("compared hidden", 2 * n * am.hidden * b,
             f"reference + state: 2 x {min(8, audit.episodes)} episodes x {actions} action tokens x h x {b} B"),
            ("per-token values", n * TOKEN_BYTES, f"N {n:,} x {TOKEN_BYTES} B")])
        jobs.append(job)
    job = _job(p, "audit_teacher_divergence")  # one episode at a time, exact and flattened teacher logits
    te, c = role_spec(p, model_role(p.audit_teacher)), min(COMPARE_CHUNK, actions)
    _scoring(job, p, te, dt, tokens, [
        ("teacher chunk", c * te.vocab * (b + DIVERGENCE_BYTES), f"C {c} x V x ({b} + {DIVERGENCE_BYTES}) B"),
        ("compared hidden", 2 * actions * te.hidden * b, f"exact + flattened: 2 x {actions} action tokens x h_T x {b} B"),
        ("per-token values", actions * TOKEN_BYTES, f"N {actions:,} x {TOKEN_BYTES} B")])
    jobs.append(job)
    tokens, actions = max(episode_tokens(p, bench, max_new, r) for r in RULES)
    job = _job(p, "audit_context_updates")
    _scoring(job, p, am, dt, tokens, _rce_terms(am, b, audit.rule_episodes * actions, actions,
                                                f"{audit.rule_episodes} episodes x {actions} action tokens"))
    jobs.append(job)
    jobs.append(_packing_job(p, am))
    return jobs


def _packing_job(p: PlanInputs, am: Spec) -> Job:
    """audit_packing_efficiency on the real audit episodes (audit.packing.real: `episodes` episodes cut to T calls,
    T up to the largest of `calls`, null = agent turns), the audit model in fp32; the synthetic sweep's tiny model
    is negligible. Scoring (no grad, all episodes at once): every path's hidden states at the sampled tokens, log-probs
    and RCE error `COMPARE_CHUNK` positions at a time. Timed forward+backward (packing_bench.measure, one episode at a
    time): weights, gradients, and the largest timed path's activations and attention scores over one episode, the
    longest the limits allow (q + T calls of input + response): independent_batched pads T calls of L tokens,
    `calls` runs each call over q + its own tokens, the other packed paths hold T_pack tokens. With
    audit.packing.activation_checkpointing each layer keeps its input and one layer's activations and scores exist
    at a time; prefix_shared then runs forward only."""
    audit, ro, pk = p.audit, p.rollout, p.packing
    bench, rule, gpu = audit.benchmark, audit.rule, _resources(p, "audit_packing_efficiency").gpu > 0
    max_new = new_tokens(audit.max_new_tokens, bench, ro.max_new_tokens)
    turns, q = p.agent.max_turns(bench), p.plan.prompt_tokens
    T = min(turns, max(c or turns for c in pk.real["calls"]))
    L = call_input(p, max_new, rule) + max_new  # one call: its input and response
    own, dt = L - q, "float32"
    tokens, actions = q + T * own, T * max_new
    real, b = pk.real["episodes"], BYTES[dt]
    n, c = real * actions, min(COMPARE_CHUNK, real * actions)
    job = _job(p, "audit_packing_efficiency")
    _scoring(job, p, am, dt, tokens, [
        ("logits chunk", c * am.vocab * (4 * b + 8),
         f"RCE error: C {c} x V x (2 x {b} logits + 2 x 4 log-softmax + 2 x {b} difference) B"),
        ("compared hidden", 2 * n * am.hidden * b, f"reference + path: 2 x {real} episodes x {actions} x h x {b} B")])
    ph = "timed forward+backward"
    _common(job, p, ph)
    job.add(ph, "weights + gradients", 2 * am.weights(dt), f"2 x P {am.params:,} x {b} B")
    ckpt = pk.activation_checkpointing
    untimed = {"eager", "flex"} | ({"prefix_shared"} if ckpt else set())  # packing_bench.measure: RCE or forward only
    paths = [("independent_batched", T * L, attention_scores(am, "calls", gpu, 4, T * L, 0, T, L),
              f"{T} calls x L {L} (padded)")]
    for name in dict.fromkeys(resolve_backend(am, x, gpu, ckpt, dt, q, T, own)
                              for x in (pk.backends or p.audit_scoring.backends)):
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


def plan_rollouts(p: PlanInputs) -> list[Job]:
    """Evaluation of the largest evaluated model, and the LLM teacher's trajectories."""
    ev, ro = p.eval, p.rollout
    names = list(ev.models) + [f"{m}_seed{s}" for m, s in p.runs.runs()]
    role = max(sorted({model_role(n) for n in names}), key=lambda r: role_spec(p, r).params)
    m = role_spec(p, role)
    job = _job(p, "eval", role)
    _common(job, p, "rollout")
    bench = max(ev.benchmarks, key=lambda b: new_tokens(ev.max_new_tokens, b, ro.max_new_tokens))
    _rollouts(job, p, "rollout", m, bench, new_tokens(ev.max_new_tokens, bench, ro.max_new_tokens),
              ro.batch_size)
    _retriever(job, p)
    jobs = [job]
    te = p.teacher
    job = _job(p, "sft_trajectories")
    if (sv := te.server) is not None:  # the vLLM server this job starts, at the settings it starts with
        _common(job, p, "serving")
        _vllm(job, "serving", resolve(te.llm["model"], p), sv.gpu_memory_utilization, sv.max_model_len,
              sv.tensor_parallel_size, where="teacher.llm.server")
        job.host["vLLM server process"] = (p.plan.process_gb * GB, "plan.process_gb")
    _retriever(job, p)
    return jobs + [job]


def plan_data(p: PlanInputs) -> list[Job]:
    """Model downloads and the dense index (host memory and disk)."""
    jobs = []
    for role in ("student", "teacher"):
        spec = p.models[role]
        if isinstance(spec, PretrainedModelConfig) and not spec.pretrained.startswith("results/"):
            m, b = role_spec(p, role), BYTES[spec.dtype]
            job = _job(p, "model_init", role)  # the loaded model + safetensors' serialisation buffer
            job.host["model"] = (2 * m.params * b, f"2 x P x {b} B")
            job.disk[f"{role}_init"] = (m.params * b, f"P x {b} B")
            jobs.append(job)
    r, corpus = p.retrieval, p.plan.corpus
    if r.backend == "e5" and corpus:
        e5, d = resolve(r.dense.model, p), r.dense
        job = _job(p, "retrieval_index")
        _common(job, p, "encode")
        job.add("encode", "weights", e5.weights("float16"), "P x 2 B")
        bt, lt = d.batch_size, d.max_length
        job.add("encode", "batch", bt * lt * (4 * e5.hidden + 2 * (e5.intermediate + 4 * e5.hidden) + 2 * e5.heads * lt),
                f"{bt} x {lt} tokens x (fp32 output 4h + one layer 2(i + 4h) + scores 2 heads x {lt}) B")
        _retriever(job, p, building=True)
        emb = corpus["passages"] * e5.hidden * 4
        job.disk["index"] = (emb + corpus["text_gb"] * GB, f"{corpus['passages']:,} x {e5.hidden} x 4 B + passages")
        job.disk["corpus (download + parquet)"] = (2 * corpus["text_gb"] * GB, "2 x text_gb")
        jobs.append(job)
        job = _job(p, "retrieval_recall")
        _retriever(job, p)
        jobs.append(job)
    return jobs


PLANNERS = (plan_data, plan_rollouts, plan_sft, plan_scoring, plan_train)


def plan(cfg: dict, rules=None) -> list[Job]:
    """Every modelled job of `cfg` (only those of `rules` when given), each section of it parsed once."""
    p = PlanInputs.parse(cfg)
    jobs = [j for f in PLANNERS for j in f(p)]
    return [j for j in jobs if rules is None or j.rule in rules]
