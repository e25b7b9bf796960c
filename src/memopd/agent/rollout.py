"""The rollout loop: batched over episodes, seeded, recording every call exactly.

Each step generates one call for every active episode (up to `batch_size`; a finished episode's slot
is refilled from the queue). Per call: build the input (prefix + rewritten memory + newest
observation), generate, record an `Invocation` (exact ids, behaviour log-probs, stop reason, provenance
of retained spans), parse the response, step the retrieval environment, rewrite memory.

Seeds: call t of task i is sampled with a seed derived from (seed, i, task_id, t), so a rollout is
reproducible and does not depend on how episodes were batched together.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

from memopd.agent.memory import Turn, build_input, refreshes_observation
from memopd.agent.protocol import (Action, Observation, Task, invalid_text, parse_response,
                                   prefix_ids, token_prefix_len)
from memopd import metrics
from memopd.config import AgentConfig
from memopd.progress import Progress
from memopd.records import Episode, Invocation, Retained, flatten_history
from memopd.retrieval.base import Retriever, format_passages

def call_seed(seed: int, index: int, task_id: str, call: int) -> int:
    digest = hashlib.sha256(f"{seed}/{index}/{task_id}/{call}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class _State:
    index: int
    task: Task
    prefix: list[int]
    max_turns: int
    next_input: list[int]  # what the model is shown at the next call (AgentConfig.view)
    next_retained: list[Retained] = field(default_factory=list)
    states: list[list[int]] = field(default_factory=list)  # persistent view: the memory rule's exact state of every call so far
    invocations: list[Invocation] = field(default_factory=list)
    history: list[Turn] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    latest_query: str = ""
    end_reason: str = ""


class _Env:
    """Observations: retrieved passages, invalid-action notices, turn hints (as ids)."""

    def __init__(self, tokenizer, retriever: Retriever, cfg: AgentConfig):
        self.tok, self.retriever, self.cfg = tokenizer, retriever, cfg
        self.refresh = refreshes_observation(cfg.rule)  # resolves the rule: a bad one fails before any call

    def observations(self, items: list[tuple[_State, Action]]) -> list[list[int]]:
        queries = []
        for s, a in items:  # the query whose passages this observation shows ("" = none)
            q = a.query if a.kind == "search" else (s.latest_query if self.refresh else "")
            queries.append(q)
        todo = [q for q in queries if q]
        found = iter(self.retriever.search(todo, self.cfg.top_k) if todo else [])
        out = []
        for (s, a), q in zip(items, queries):
            obs = Observation(format_passages(next(found)) if q else "", turns_left=s.max_turns - len(s.invocations),
                              notice="" if a.valid else invalid_text(a.reason))
            out.append(obs.ids(self.tok, self.cfg.max_observation_tokens))
        return out


def _finish(s: _State, cfg: AgentConfig) -> Episode:
    last = s.actions[-1]
    preds = list(last.answers) if last.kind == "answer" else []
    scores = metrics.score_answers(preds, s.task.answers)
    em, f1 = scores["em"], scores["f1"]
    invalid = [a.reason for a in s.actions if not a.valid]
    ep = Episode(task_id=s.task.task_id, prefix_len=len(s.prefix), invocations=s.invocations)
    ep.reward = (em if cfg.reward == "em" else f1) - cfg.invalid_penalty * len(invalid)
    ep.metrics = {
        "benchmark": s.task.benchmark, "rule": cfg.rule, "em": em, "f1": f1, "answered": last.kind == "answer",
        "end_reason": s.end_reason, "calls": len(s.invocations), "max_turns": s.max_turns,
        "searches": sum(a.kind == "search" for a in s.actions), "invalid_actions": len(invalid),
        "invalid_reasons": invalid, "actions": [a.kind if a.valid else f"invalid:{a.reason}" for a in s.actions],
        "queries": [a.query for a in s.actions if a.kind == "search"], "predictions": preds,
        "questions": s.task.questions, "gold": s.task.answers,
        "peak_context_tokens": metrics.peak_context(len(i.input_ids) + len(i.output_ids) for i in s.invocations),
        "dependency": metrics.dependency((len(i.input_ids), len(i.output_ids)) for i in s.invocations),
        "generated_tokens": sum(len(inv.output_ids) for inv in s.invocations),
        "retained_spans": sum(len(inv.retained) for inv in s.invocations),
        **metrics.copy_probe(s.actions[0].kind, s.actions[0].query, s.task.questions[0]),
    }
    return ep.validate()


def _shown(s: _State, state: list[int], retained: list[Retained], view: str) -> tuple[list[int], list[Retained]]:
    """The next call's input as the model is shown it, and its provenance: the memory rule's `state` itself, or
    (view "persistent") the transcript of every exact state and response so far, `state` at its end."""
    if view == "exact":
        return state, retained
    s.states.append(state)
    ids, spans = flatten_history(len(s.prefix), s.states, [inv.output_ids for inv in s.invocations])
    shift = len(ids) - len(state)  # the exact state's tokens after the prefix sit at the end of the transcript
    return ids, spans + [Retained(r.src_call, r.src_start, r.dst_start + shift, r.length) for r in retained]


def rollout(tasks: list[Task], backend, tokenizer, retriever: Retriever, cfg: AgentConfig, seed: int = 0,
            progress: bool = True, stats: dict | None = None, indices: list[int] | None = None,
            label: str = "") -> list[Episode]:
    """Roll out every task once; returns the episodes in task order. `stats` (if given) receives the
    wall-clock split: generation, retrieval, total seconds, calls and generated tokens. `indices[i]` is
    task i's index in the sampling seeds (default i): a rank rolling out its share of a larger batch
    passes the tasks' batch positions, so that every episode is sampled as in a single-process run. `progress`:
    a line per finished episode under `label` (default rollout[rule])."""
    env = _Env(tokenizer, retriever, cfg)
    queue = deque(range(len(tasks)))
    active: list[_State] = []
    done: dict[int, Episode] = {}
    t_gen = t_ret = 0.0
    n_calls = n_tokens = 0
    t0 = time.perf_counter()
    bar = Progress(label or f"rollout[{cfg.rule}]", len(tasks), "episodes", enabled=progress)
    while queue or active:
        while queue and len(active) < cfg.batch_size:
            i = queue.popleft()
            budget = cfg.max_turns(tasks[i].benchmark)
            q = prefix_ids(tokenizer, tasks[i], budget)
            active.append(_State(i, tasks[i], q, budget, next_input=list(q), states=[list(q)]))
        t = time.perf_counter()
        gens = backend.generate([s.next_input for s in active],
                                [call_seed(seed, s.index if indices is None else indices[s.index], s.task.task_id,
                                           len(s.invocations)) for s in active])
        t_gen += time.perf_counter() - t
        need_obs: list[tuple[_State, Action]] = []
        for s, g in zip(active, gens):
            s.invocations.append(Invocation(s.next_input, g.output_ids, g.logprobs, g.stop_reason, s.next_retained))
            n_calls, n_tokens = n_calls + 1, n_tokens + len(g.output_ids)
            text = tokenizer.decode(g.output_ids, skip_special_tokens=False)
            a = parse_response(text, truncated=g.stop_reason == "length", max_query_chars=cfg.max_query_chars)
            s.actions.append(a)
            if a.kind == "search":
                s.latest_query = a.query
            if a.kind == "answer":
                s.end_reason = "answer"
            elif not a.valid and cfg.invalid_action == "end":
                s.end_reason = "invalid"
            elif len(s.invocations) >= s.max_turns:
                s.end_reason = "turn_budget"
            else:
                need_obs.append((s, a))
        t = time.perf_counter()
        obs = env.observations(need_obs)
        t_ret += time.perf_counter() - t
        for (s, a), o in zip(need_obs, obs):
            out = s.invocations[-1].output_ids
            think_len = token_prefix_len(tokenizer, out, a.think_end) if a.think_end else 0
            s.history.append(Turn(out, think_len, o))
            s.next_input, s.next_retained = _shown(s, *build_input(s.prefix, s.history, cfg.memory), cfg.view)
            if len(s.next_input) > cfg.max_input_tokens:
                s.end_reason = "context_overflow"  # never truncate a state: end the episode instead
        still = []
        for s in active:
            if s.end_reason:
                done[s.index] = _finish(s, cfg)
                bar.update(1)
            else:
                still.append(s)
        active = still
    bar.close()
    if stats is not None:
        stats.update(total_s=time.perf_counter() - t0, generate_s=t_gen, retrieval_s=t_ret, calls=n_calls,
                     generated_tokens=n_tokens, episodes=len(tasks))
    return [done[i] for i in range(len(tasks))]
