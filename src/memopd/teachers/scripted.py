"""Teachers that generate SFT trajectories through the student's own rollout loop.

A teacher is a generation backend (`generate(prompts, seeds) -> list[Generation]`, the interface of
generation/backends.py), so its episodes come out of `rollout()` with the same environment, memory rules and
recorder as the student's: ordinary `Episode` records in the student's token ids.

ScriptedTeacher (embedded default) knows each task's gold aliases but nothing else: it sees only the
prompt the rollout gives it, exactly as a model would, and keeps its whole state in the `<think>`
memory it writes (under the default summary_replacement rule nothing else survives a turn). Per call it
  1. finds the task from the question block of the prompt, and its turn budget from the turn hints;
  2. reads the memory (last <think> block of the context) and the passages of the newest observation;
  3. if the memory says it was searching question i, looks for a gold alias in those passages and
     writes `Qi: <the alias as the passage spells it> (Doc k)`; when none is there it retries once with
     a reformulated query (budget permitting), then writes `Qi: not found (guess: <Doc 1 title>)` or
     `Qi: not found`; with `evidence` a finding's turn first quotes its sentence (`Doc k: "..."`, that
     turn only: the memory it rewrites next keeps just the `Qi:` lines);
  4. searches the next unsearched question (`Searching Qi.` in memory, the question as query), or
     answers `<answer>a1; a2; ...</answer>` when all are done or the last turn has come.
So it claims only what a passage it saw supports; wrong answers come from retrieval failures (the
guess, or 'unknown'), and a score filter drops them. Each response goes through the tokenizer once;
the recorded ids are those (never decoded and re-tokenised). The LLM teacher is in llm_teacher.py.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from memopd.agent.protocol import (ANSWER, ANSWER_END, INFO, INFO_END, SEARCH, SEARCH_END, THINK, THINK_END, Generation,
                                   Task, encode, questions_text)
from memopd.metrics import exact_match

# Function words dropped from a question to make a keyword query (the reformulation of a retry).
_STOP = set("""a an the of in on at to for from by with about as into over under and or but nor is are was were be
been being do does did has have had what which who whom whose when where why how that this these those it its
their there name named called""".split())
_DOC = re.compile(r"(?:^|\n)Doc (\d+) \(Title: ((?:[^()\n]|\([^()\n]*\))*)\) ")
_BLOCK = re.compile(r"\n(Questions?:.*?)\nYou have at most (\d+) turns\.", re.S)
_TURNS_LEFT = re.compile(r"You have (\d+) turns left\.|(This is your last turn)")
_LINE = re.compile(r"^Q(\d+): (.*)$", re.M)
_SEARCHING = re.compile(r"^Searching Q(\d+)\.$", re.M)
_GUESS = re.compile(r"^not found \(guess: (.*)\)$")
NOT_YET, NOT_FOUND, UNKNOWN = "not found yet", "not found", "unknown"
_OTHER = {"question": "keywords", "keywords": "question"}


@dataclass
class ScriptedConfig:
    """Knobs of the scripted teacher (config `teacher.scripted`)."""

    query: str = "question"  # first query of a question: "question" (copied verbatim) or "keywords"
    keywords_prob: float = 0.0  # chance (seeded per call) that a first query uses the other style
    retries: int = 1  # reformulated searches of a question whose first search found no alias (0 or 1)
    unsupported: str = "guess"  # unanswered question: "guess" (title of Doc 1 of its last search) or "unknown"
    cite: bool = True  # write "(Doc k)" after a finding
    evidence: int = 0  # > 0: a finding is preceded, in the memory of that turn only, by a quote of at most
    # this many words of its sentence (`Doc k: "..."`): the reading shown before the answer it gives
    max_new_tokens: int | None = None  # response budget in tokens (None: unlimited); see _fit

    def __post_init__(self):
        if self.query not in ("question", "keywords") or self.unsupported not in ("guess", "unknown"):
            raise ValueError(f"bad scripted teacher config {self}")
        if self.retries not in (0, 1) or not 0 <= self.keywords_prob <= 1:
            raise ValueError(f"scripted teacher: retries must be 0 or 1, keywords_prob in [0, 1] ({self})")
        if self.evidence < 0:
            raise ValueError(f"scripted teacher: evidence must be >= 0 words ({self})")


def split_prompt(text: str) -> tuple[str, int, str]:
    """A decoded agent prompt -> (question block, turn budget, context after the user message): the
    context is the rest of the template plus the rewritten memory and observations."""
    m = _BLOCK.search(text)
    if not m:
        raise ValueError("not an agent prompt: no question block followed by the turn budget")
    return m.group(1), int(m.group(2)), text[m.end():]


def keywords(question: str) -> str:
    """The question without function words and punctuation: a shorter, reformulated query."""
    words = [w.strip(".,;:!?\"'()") for w in question.split()]
    kept = [w for w in words if w and w.lower() not in _STOP]
    return " ".join(kept) or question.strip()


def passages(observation: str) -> list[tuple[int, str, str]]:
    """(k, title, text) of every `Doc k (Title: t) text` in an observation (format_passages's layout);
    the last passage may be cut short by the observation's token budget."""
    heads = list(_DOC.finditer(observation))
    return [(int(m.group(1)), m.group(2), observation[m.end(): heads[j + 1].start() if j + 1 < len(heads) else None])
            for j, m in enumerate(heads)]


def _spelled(m: re.Match) -> str:
    """A match as the passage spells it."""
    return " ".join(m.group(0).split())


def _find(aliases: list[str], docs: list[tuple[int, str, str]]) -> tuple[re.Match, int, int] | None:
    """The first gold alias found in the passages, best-ranked passage first: (the match in `title + " " + text` of
    passage k, k, len(title)). Matching ignores case and punctuation between words; the span must still be an exact
    match of an alias after SQuAD normalisation, so a claim never says more than the passage does."""
    for k, title, text in docs:
        body = f"{title} {text}"
        for alias in aliases:
            words = re.findall(r"\w+", alias)
            if not words:
                continue
            # between words: up to 3 separators, never ';' (it splits answers) nor a line break (memory lines)
            m = re.search(r"(?<!\w)" + r"[^\w;\n]{0,3}".join(map(re.escape, words)) + r"(?!\w)", body, re.I)
            if m and exact_match(m.group(0), aliases):
                return m, k, len(title)
    return None


def evidence(m: re.Match, words: int, title_len: int) -> str:
    """The sentence of the passage around the match `m` (of `_find`, in `title + " " + text`; the title is
    the first `title_len` characters), at most `words` whitespace-separated words that contain the whole
    span: the whole sentence when it fits, else up to 3 words after the span and the words just before it
    (those that tie it to the question), the room they leave going to the words after. A span found in the
    title is quoted from the text when the text has it too, else the title is the quote. Whole words, as
    the passage spells them."""
    lo, hi = (title_len + 1 if m.start() > title_len else 0), len(m.string)
    if m.start() < title_len:
        in_text = m.re.search(m.string, title_len + 1)
        if in_text:
            m, lo = in_text, title_len + 1
        else:
            hi = title_len
    body, a, b = m.string[:hi], m.start(), m.end()
    ends = [e.end() for e in re.finditer(r"[.!?][\"')\]]*\s+", body[lo:a])]
    s = lo + ends[-1] if ends else lo
    e = re.search(r"[.!?][\"')\]]*(?=\s|$)", body[b:])
    e = b + e.end() if e else len(body)
    toks = [(t.start() + s, t.end() + s) for t in re.finditer(r"\S+", body[s:e])]
    inside = [j for j, (u, v) in enumerate(toks) if u < b and v > a]
    i, j = inside[0], inside[-1] + 1
    room = max(words - (j - i), 0)
    after = min(len(toks) - j, room, 3)
    start = max(i - (room - after), 0)  # the words before the span get what 3 after it leave
    after = min(len(toks) - j, room - (i - start))  # ... and any room they leave goes after it
    return " ".join(body[toks[start][0]: toks[j + after - 1][1]].split()).replace(";", ",")


@dataclass
class _View:
    """What the teacher reads from one prompt."""

    task: Task
    turns_left: int  # calls left, this one included
    memory: dict[int, str]  # question number (1-based) -> status line content
    searching: int | None  # the question whose search produced the newest observation
    docs: list[tuple[int, str, str]]


class ScriptedTeacher:
    """A gold-informed policy behind the backend interface; see the module docstring."""

    name = "scripted"

    def __init__(self, tokenizer, tasks: list[Task], cfg: ScriptedConfig | None = None):
        self.tok, self.cfg = tokenizer, cfg or ScriptedConfig()
        self.tasks: dict[str, Task] = {}
        for t in tasks:
            key = questions_text(t.questions)
            if key in self.tasks and self.tasks[key].answers != t.answers:
                raise ValueError(f"tasks {self.tasks[key].task_id!r} and {t.task_id!r}: same questions, other answers")
            self.tasks[key] = t
        self.fits = {"full": 0, "no_cite": 0, "short": 0, "truncated": 0}  # how responses met the budget

    # --- reading the prompt ------------------------------------------------------------------------
    def view(self, text: str) -> _View:
        block, turns_left, ctx = split_prompt(text)  # ctx: rewritten memory + observations
        if block not in self.tasks:
            raise ValueError("scripted teacher: the prompt's question block matches none of its tasks")
        task = self.tasks[block]
        i, j = ctx.rfind(INFO), ctx.rfind(INFO_END)
        obs, tail = (ctx[i + len(INFO): j], ctx[j:]) if 0 <= i < j else ("", "")
        hint = _TURNS_LEFT.search(tail)
        if hint:
            turns_left = 1 if hint.group(2) else int(hint.group(1))
        memory, searching = {}, None
        a = ctx.rfind(THINK)
        b = ctx.find(THINK_END, a) if a >= 0 else -1
        if b >= 0:  # the newest complete memory block
            think = ctx[a + len(THINK): b]
            memory = {int(n): s.strip() for n, s in _LINE.findall(think) if 1 <= int(n) <= len(task.questions)}
            s = _SEARCHING.search(think)
            searching = int(s.group(1)) if s and 1 <= int(s.group(1)) <= len(task.questions) else None
        return _View(task, turns_left, memory, searching if obs else None, passages(obs))

    # --- the policy ----------------------------------------------------------------------------------
    def respond(self, text: str, seed: int = 0) -> str:
        """The response text for a decoded prompt (deterministic given the seed)."""
        return self._compose(self.view(text), random.Random(seed), cite=self.cfg.cite)[0]

    def _decide(self, v: _View) -> tuple[dict[int, str], int | None, bool, str]:
        """Update the memory from the newest observation; pick (memory, question to search, is_retry,
        the evidence line of a finding or "")."""
        mem, n, quote = dict(v.memory), len(v.task.questions), ""
        unsearched = [q for q in range(1, n + 1) if q not in mem or mem[q] == ""]
        i = v.searching
        if i is not None:
            retry = mem.get(i) == NOT_YET
            unsearched = [q for q in unsearched if q != i]
            hit = _find(v.task.answers[i - 1], v.docs)
            if hit:
                mem[i] = f"{_spelled(hit[0])} (Doc {hit[1]})"
                if self.cfg.evidence:
                    quote = f'Doc {hit[1]}: "{evidence(hit[0], self.cfg.evidence, hit[2])}"'
            elif not retry and self.cfg.retries and v.turns_left >= len(unsearched) + 2:
                mem[i] = NOT_YET  # retry now: this call + the unsearched + the answer fit the budget
                return mem, i, True, quote
            else:
                guess = v.docs[0][1].strip().replace(";", ",") if v.docs and self.cfg.unsupported == "guess" else ""
                mem[i] = f"{NOT_FOUND} (guess: {guess})" if guess else NOT_FOUND
        if v.turns_left > 1 and unsearched:
            return mem, unsearched[0], False, quote
        return mem, None, False, quote  # answer: all searched, or the last turn

    def _compose(self, v: _View, rng: random.Random, cite: bool = True, max_words: int | None = None) -> tuple[str, bool]:
        """(response text, is it a search). `max_words`: the budget is tight, so the memory drops its
        citations and the query keeps its first `max_words` keywords (an answer's memory becomes
        "Answering.")."""
        mem, target, retry, quote = self._decide(v)
        lines = [f"Q{q}: " + (mem[q] if cite else re.sub(r" \(Doc \d+\)$", "", mem[q])) for q in sorted(mem)]
        if quote and cite:  # a citation: shown only with them (a tight budget drops both); the next turn drops it
            lines = [quote] + lines
        if target is None:
            answers = [_answer(mem.get(q, "")) for q in range(1, len(v.task.questions) + 1)]
            think = "Answering." if max_words is not None or not lines else "\n".join(lines)
            return f"{THINK}{think}{THINK_END}{ANSWER}{'; '.join(answers)}{ANSWER_END}", False
        question = v.task.questions[target - 1].strip()
        style = self.cfg.query
        if rng.random() < self.cfg.keywords_prob:  # drawn on every call, so the stream does not depend on retries
            style = _OTHER[style]
        if retry:  # the reformulation: the other style
            style = _OTHER[style]
        query = question if style == "question" and max_words is None else keywords(question)
        if max_words is not None:
            query = " ".join(query.split()[:max_words])
        think = "\n".join(lines + [f"Searching Q{target}."])
        return f"{THINK}{think}{THINK_END}{SEARCH}{query}{SEARCH_END}", True

    def _fit(self, text_prompt: str, seed: int) -> Generation:
        """Tokenise the response once. Over the token budget, shorter variants are tried in order:
        without citations; then with the query cut to its first n keywords (n = 32 .. 1), or an answer
        whose memory is just "Answering.". If none fits, the response is cut at the budget and recorded
        as a "length" stop, as a model's would be (the rollout then sees an invalid action)."""
        v, budget = self.view(text_prompt), self.cfg.max_new_tokens
        variants = [("full", self.cfg.cite, None)] + ([("no_cite", False, None)] if self.cfg.cite else [])
        variants += [("short", False, n) for n in range(32, 0, -1)]
        ids: list[int] = []
        for kind, cite, max_words in variants:
            text, is_search = self._compose(v, random.Random(seed), cite, max_words)
            ids = encode(self.tok, text)
            if budget is None or len(ids) <= budget:
                self.fits[kind] += 1
                return Generation(ids, None, "stop")
            if max_words is not None and not is_search:
                break  # an answer has no query to cut further
        self.fits["truncated"] += 1
        return Generation(ids[:budget], None, "length")

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        return [self._fit(self.tok.decode(p, skip_special_tokens=False), s) for p, s in zip(prompts, seeds)]


def _answer(status: str) -> str:
    if not status or status == NOT_YET or status == NOT_FOUND:
        return UNKNOWN
    g = _GUESS.match(status)
    return g.group(1) if g else re.sub(r" \(Doc \d+\)$", "", status)


def memory_claims(think: str) -> list[tuple[int, str]]:
    """(question, claimed text) for every finding or guess in a memory block: what must appear in a
    passage the agent saw (used by the tests and the trajectory stats)."""
    out = []
    for n, s in _LINE.findall(think):
        s = s.strip()
        g = _GUESS.match(s)
        if g:
            out.append((int(n), g.group(1)))
        elif not s.startswith(NOT_FOUND):
            out.append((int(n), re.sub(r" \(Doc \d+\)$", "", s)))
    return out
