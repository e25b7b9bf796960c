"""The MEM1-style agent protocol: task prompt, response parsing, observations.

One call of the agent sees  q + x_t  where q is the task prefix (system text + the questions, through
the tokenizer's chat template, ending with the assistant header) and x_t is the rewritten memory plus
the newest observation, appended raw inside the same assistant turn (as MEM1 does). The model
answers with
    <think> memory: what it still needs to know </think>
    <search> query </search>        or        <answer> a1; a2; ... </answer>
Observations come back as  <information> ... </information>  followed by a turn hint.

Parsing works on the decoded text of the recorded ids and never raises: every malformed response is an
`Action` of kind "invalid" with a reason. Char offsets are mapped back to the recorded token ids by
`token_prefix_len` (memory rules then cut the recorded ids; nothing is ever re-tokenised).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

THINK, THINK_END = "<think>", "</think>"
SEARCH, SEARCH_END = "<search>", "</search>"
ANSWER, ANSWER_END = "<answer>", "</answer>"
INFO, INFO_END = "<information>", "</information>"
TAGS = (THINK, THINK_END, SEARCH, SEARCH_END, ANSWER, ANSWER_END, INFO, INFO_END)
STOP_STRINGS = (SEARCH_END, ANSWER_END)  # generation stops after a complete action

# Reasons an action is invalid (recorded per call; the rollout never raises on them).
INVALID_REASONS = ("too_long", "no_action_tag", "both_tags", "unclosed_think", "unclosed_tag",
                   "tag_in_content", "empty_query", "query_too_long", "empty_answer")

SYSTEM_PROMPT = (
    "You answer questions by searching a Wikipedia index. Earlier turns are not shown to you again: "
    "at every turn, first write your memory inside <think> </think> (everything you have found and "
    "still need). Then either search with <search> query </search>, or, once you know every answer, "
    "reply <answer> answer 1; answer 2; ... </answer> with one answer per question, in order, separated "
    "by ';'. Search results arrive inside <information> </information>."
)


@dataclass
class Generation:
    """What a generation backend (memopd.generation.backends) returns for one prompt: the exact sampled ids."""
    output_ids: list[int]
    logprobs: list[float] | None  # the policy's log-probs of output_ids (None where a backend has none)
    stop_reason: str  # "stop" (stop string), "eos", "length"


@dataclass
class Task:
    """One task: n questions asked together (Q_n) or one question (Wiki-RAG), with alias lists."""

    task_id: str
    questions: list[str]
    answers: list[list[str]]  # gold aliases, one list per question
    benchmark: str = ""

    def __post_init__(self):
        if not self.questions or len(self.questions) != len(self.answers):
            raise ValueError(f"task {self.task_id!r}: {len(self.questions)} questions, {len(self.answers)} alias lists")


def load_tasks(path: str | Path, limit: int | None = None) -> list[Task]:
    """Tasks of a benchmark parquet (memopd.data.compose): n questions with their alias lists."""
    from memopd.data.compose import read_tasks

    rows = read_tasks(path)[:limit]
    return [Task(r["task_id"], list(r["questions"]), [list(a) for a in r["answers"]], r["benchmark"]) for r in rows]


@dataclass(frozen=True)
class Action:
    kind: str  # "search" | "answer" | "invalid"
    query: str = ""
    answers: tuple[str, ...] = ()
    memory: str | None = None  # content of the <think> block; None when there is none
    think_end: int = 0  # char offset just past </think> (0: no think block)
    reason: str = ""  # why the action is invalid

    @property
    def valid(self) -> bool:
        return self.kind != "invalid"


def parse_response(text: str, truncated: bool = False, max_query_chars: int = 512) -> Action:
    """Parse one response. `truncated`: generation hit its token budget (an unfinished action is then
    "too_long"). Never raises."""
    try:
        return _parse(text, truncated, max_query_chars)
    except Exception as e:  # belt and braces: a rollout must never die on model output
        return Action("invalid", reason=f"parse_error:{type(e).__name__}")


def _parse(text: str, truncated: bool, max_query_chars: int) -> Action:
    memory, think_end = None, 0
    i = text.find(THINK)
    if i >= 0:
        j = text.find(THINK_END, i + len(THINK))
        if j < 0:
            return Action("invalid", reason="too_long" if truncated else "unclosed_think")
        memory, think_end = text[i + len(THINK) : j].strip(), j + len(THINK_END)
    rest = text[think_end:]
    s, a = rest.find(SEARCH), rest.find(ANSWER)
    inv = dict(memory=memory, think_end=think_end)
    if s < 0 and a < 0:
        return Action("invalid", reason="too_long" if truncated else "no_action_tag", **inv)
    if s >= 0 and a >= 0:
        return Action("invalid", reason="both_tags", **inv)
    open_tag, close_tag, start = (SEARCH, SEARCH_END, s) if s >= 0 else (ANSWER, ANSWER_END, a)
    end = rest.find(close_tag, start + len(open_tag))
    if end < 0:
        return Action("invalid", reason="too_long" if truncated else "unclosed_tag", **inv)
    content = rest[start + len(open_tag) : end].strip()
    if any(t in content for t in TAGS):
        return Action("invalid", reason="tag_in_content", **inv)
    if open_tag == SEARCH:
        if not content:
            return Action("invalid", reason="empty_query", **inv)
        if len(content) > max_query_chars:
            return Action("invalid", reason="query_too_long", **inv)
        return Action("search", query=content, **inv)
    answers = tuple(p.strip() for p in content.split(";"))
    if not any(answers):
        return Action("invalid", reason="empty_answer", **inv)
    return Action("answer", answers=answers, **inv)


def token_prefix_len(tokenizer, ids: list[int], n_chars: int) -> int:
    """Smallest k such that decode(ids[:k]) covers the first `n_chars` characters of decode(ids).

    Used to cut recorded ids at a char offset found by parsing (e.g. just past </think>). A token that
    straddles the offset is kept whole: memory is a span of recorded tokens, never re-tokenised text."""
    if n_chars <= 0:
        return 0

    def dec(k):
        return tokenizer.decode(ids[:k], skip_special_tokens=False)

    target = dec(len(ids))[:n_chars]
    lo, hi = 1, len(ids)
    while lo < hi:  # binary search on the decoded length (monotone up to partial UTF-8 bytes)
        mid = (lo + hi) // 2
        if len(dec(mid)) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    while lo < len(ids) and dec(lo)[:n_chars] != target:  # a partial multi-byte char fooled the search
        lo += 1
    return lo


# --- prompt and observations ------------------------------------------------------------------------

def questions_text(questions: list[str]) -> str:
    """The question block of the user message (one question, or a numbered list)."""
    if len(questions) == 1:
        return f"Question: {questions[0]}"
    return "Questions:\n" + "\n".join(f"{k + 1}. {q}" for k, q in enumerate(questions))


def task_messages(task: Task, max_turns: int) -> list[dict]:
    user = f"{questions_text(task.questions)}\n{budget_text(max_turns)}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def encode(tokenizer, text: str) -> list[int]:
    """Fresh text (prompt, observation) to ids, without special tokens added around it."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prefix_ids(tokenizer, task: Task, max_turns: int) -> list[int]:
    """The task prefix q: chat template with the generation prompt (q ends with the assistant header)."""
    out = tokenizer.apply_chat_template(task_messages(task, max_turns), add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def budget_text(max_turns: int) -> str:
    return f"You have at most {max_turns} turns."


def turn_hint(turns_left: int) -> str:
    if turns_left <= 1:
        return "This is your last turn: answer now."
    return f"You have {turns_left} turns left."


def invalid_text(reason: str) -> str:
    return (f"Invalid action ({reason}). Write <think> memory </think> then <search> query </search> "
            "or <answer> a1; a2 </answer>.")


@dataclass
class Observation:
    """One observation: an optional notice (invalid action), retrieved passages, the turn hint. The parts
    are tokenised separately so that the passages alone can be cut to a token budget."""

    passages: str
    turns_left: int
    notice: str = ""

    def ids(self, tokenizer, max_passage_tokens: int | None = None) -> list[int]:
        body = encode(tokenizer, self.passages)
        if max_passage_tokens is not None:
            body = body[:max_passage_tokens]  # fresh context: cutting it changes no recorded action
        notice = encode(tokenizer, self.notice + ("\n" if body else "")) if self.notice else []
        tail = encode(tokenizer, INFO_END + "\n" + turn_hint(self.turns_left) + "\n")
        return encode(tokenizer, "\n" + INFO) + notice + body + tail


def protocol_texts() -> list[str]:
    """The protocol's fixed text (system prompt, tags, turn hints, notices), for a tokenizer trained here."""
    tags = " ".join(TAGS)
    hints = [turn_hint(n) for n in (1, 2, 10)] + [budget_text(n) for n in (2, 10)]
    return [SYSTEM_PROMPT, tags, *hints, *(invalid_text(r) for r in INVALID_REASONS),
            questions_text(["?", "?"]), "Searching Q1. Answering. not found (guess: ) unknown Doc 1 (Title: )"]
