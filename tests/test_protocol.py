"""Protocol: parsing never raises (fuzzed), invalid actions carry reasons, char -> token mapping is exact."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_support import nq_tasks, tokenizer
from memopd.agent.protocol import (INFO, INFO_END, INVALID_REASONS, TAGS, THINK_END, Observation, encode,
                                   parse_response, prefix_ids, token_prefix_len)

CASES = [
    ("<think>m</think><search>who is x</search>", "search", "", "who is x"),
    ("<search>  padded query </search>", "search", "", "padded query"),
    ("<think>a; b</think><answer>Paris; 1901 ;x</answer>", "answer", "", ("Paris", "1901", "x")),
    ("<think>m</think><answer>;  ;</answer>", "invalid", "empty_answer", None),
    ("<think>m</think><search> </search>", "invalid", "empty_query", None),
    ("<think>m</think>just text", "invalid", "no_action_tag", None),
    ("", "invalid", "no_action_tag", None),
    ("<think>never closed <search>q</search>", "invalid", "unclosed_think", None),
    ("<think>m</think><search>q", "invalid", "unclosed_tag", None),
    ("<think>m</think><search>q</search><answer>a</answer>", "invalid", "both_tags", None),
    ("<think>m</think><search>a <think> b</search>", "invalid", "tag_in_content", None),
    ("<search>" + "x" * 600 + "</search>", "invalid", "query_too_long", None),
    ("</answer>", "invalid", "no_action_tag", None),
    ("<answer>late</answer><think>m</think>", "invalid", "no_action_tag", None),  # the action must follow the memory
]


@pytest.mark.parametrize("text,kind,reason,content", CASES)
def test_parse_cases(text, kind, reason, content):
    a = parse_response(text)
    assert (a.kind, a.reason) == (kind, reason)
    if kind == "search":
        assert a.query == content
    if kind == "answer":
        assert a.answers == content


def test_truncated_unfinished_action_is_too_long():
    assert parse_response("<think>m</think><search>q", truncated=True).reason == "too_long"
    assert parse_response("<think>still thinking", truncated=True).reason == "too_long"
    assert parse_response("random words", truncated=True).reason == "too_long"
    # a complete action is valid even when the budget was hit on its last token
    assert parse_response("<think>m</think><search>q</search>", truncated=True).kind == "search"


def test_memory_span():
    text = "<think> keep this </think><search>q</search>"
    a = parse_response(text)
    assert a.memory == "keep this" and text[: a.think_end].endswith(THINK_END)
    assert parse_response("<search>q</search>").think_end == 0


protocol_text = st.lists(st.one_of(st.sampled_from(TAGS + (";", " ", "a", "Paris", "é", "\n")), st.text(max_size=6)),
                         max_size=14).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(st.text(), protocol_text), truncated=st.booleans())
def test_parse_never_raises(text, truncated):
    a = parse_response(text, truncated=truncated)
    assert a.kind in ("search", "answer", "invalid")
    assert 0 <= a.think_end <= len(text)
    if a.think_end:
        assert text[: a.think_end].endswith(THINK_END)
    if a.kind == "invalid":
        assert a.reason in INVALID_REASONS
    else:
        assert a.reason == ""
        body = a.query if a.kind == "search" else ";".join(a.answers)
        assert body.strip() and not any(t in body for t in TAGS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=protocol_text)
def test_token_prefix_len_cuts_recorded_ids_at_the_memory(text):
    tok = tokenizer()
    ids = encode(tok, text)
    a = parse_response(tok.decode(ids, skip_special_tokens=False))
    full = tok.decode(ids, skip_special_tokens=False)
    k = token_prefix_len(tok, ids, a.think_end)
    if a.think_end == 0:
        assert k == 0
        return
    assert tok.decode(ids[:k], skip_special_tokens=False).startswith(full[: a.think_end])  # covers the memory
    assert len(tok.decode(ids[: k - 1], skip_special_tokens=False)) < a.think_end  # and is the shortest cut


def test_prefix_is_chat_template_and_stable():
    tok = tokenizer()
    task = nq_tasks(1, n_questions=2)[0]
    q = prefix_ids(tok, task, max_turns=5)
    assert q == prefix_ids(tok, task, max_turns=5)
    text = tok.decode(q, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "1. " + task.questions[0] in text and "2. " + task.questions[1] in text and "at most 5 turns" in text


def test_observation_ids_and_budget():
    tok = tokenizer()
    obs = Observation("Doc 1 (Title: Paris) Paris is the capital of France. " * 20, turns_left=1, notice="Bad.")
    ids = obs.ids(tok, max_passage_tokens=10)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("\n" + INFO + "Bad.\nDoc 1 (Title:") and text.endswith(INFO_END + "\nThis is your last turn: answer now.\n")
    tail = encode(tok, INFO_END + "\n" + "This is your last turn: answer now.\n")
    assert len(ids) == len(encode(tok, "\n" + INFO)) + len(encode(tok, "Bad.\n")) + 10 + len(tail)
    assert tok.decode(Observation("", 3, notice="Bad.").ids(tok), skip_special_tokens=False) == "\n" + INFO + "Bad." + INFO_END + "\nYou have 3 turns left.\n"


