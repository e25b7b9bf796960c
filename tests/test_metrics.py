"""Metrics: SQuAD normalisation, EM / F1 against aliases, Q_n multi-answer scoring, cost measures."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memopd.metrics import (dependency, exact_match, f1_score, normalize_answer,
                            peak_context, score_answer, split_answers)


@pytest.mark.parametrize("raw, norm", [
    ("The Beatles!", "beatles"),                  # article + punctuation
    ("  A man, a plan, an  canal ", "man plan canal"),
    ("theory of the atom", "theory of atom"),     # articles only as whole words
    ("U.S.A.", "usa"),
    ("RÖNTGEN", "röntgen"),                       # non-ASCII lowercase, accents kept
    ("Ro\u0308ntgen", "röntgen"),                 # decomposed ö == composed ö (NFC)
    ("ain’t", "aint"),                            # Unicode apostrophe is punctuation
    ("1914–1918", "19141918"),                    # en dash, same as ASCII '1914-1918'
    ("«Les Misérables»", "les misérables"),
    ("", ""),
])
def test_normalize_known_values(raw, norm):
    assert normalize_answer(raw) == norm


def test_normalize_matches_squad_on_ascii():
    # the SQuAD v1.1 script on ASCII: lower, strip string.punctuation, articles, whitespace
    assert normalize_answer("The  quick, brown fox's \"den\" -- an (old) one.") == "quick brown foxs den old one"
    assert normalize_answer("1914-1918") == normalize_answer("1914–1918")


def test_em_against_aliases():
    aliases = ["14 December 1972 UTC", "December 1972"]
    assert exact_match("december 1972", aliases) == 1.0
    assert exact_match("The December, 1972.", aliases) == 1.0
    assert exact_match("1972", aliases) == 0.0
    assert exact_match("Wilhelm Conrad Rontgen", ["Wilhelm Conrad Röntgen"]) == 0.0  # accents count
    assert exact_match("Paris", "paris") == 1.0  # a single gold string works too


def test_f1_known_values():
    assert f1_score("the cat sat", "cat sat down") == pytest.approx(0.8)        # p=1, r=2/3
    assert f1_score("cat cat", "cat") == pytest.approx(2 / 3)                    # multiset: 1 common
    assert f1_score("dog", "cat") == 0.0
    assert f1_score("December 1972", ["14 December 1972 UTC", "1972"]) == pytest.approx(max(2 * (1 * 0.5) / 1.5, 2 / 3))
    assert f1_score("the", "a") == 1.0   # both normalise to nothing (SQuAD v2 convention)
    assert f1_score("", "cat") == 0.0


def test_multi_answer_scoring():
    gold = [["Paris"], ["1972", "December 1972"], ["Röntgen"]]
    s = score_answer("Paris; December 1972; Röntgen", gold)
    assert (s["em"], s["f1"], s["em_sum"]) == (1.0, 1.0, 3.0)
    s = score_answer("Paris; 1972", gold)                       # missing third answer scores 0
    assert s["em_per_question"] == [1.0, 1.0, 0.0] and s["em"] == pytest.approx(2 / 3) and s["em_sum"] == 2.0
    s = score_answer("Paris; 1972; Röntgen; Berlin; x", gold)   # extra answers ignored
    assert s["em"] == 1.0 and s["answers_given"] == 5
    s = score_answer("1972; Paris; Röntgen", gold)              # matched by order, not by content
    assert s["em_per_question"] == [0.0, 0.0, 1.0]
    s = score_answer(None, gold)
    assert s["em"] == s["f1"] == s["em_sum"] == 0.0
    s = score_answer("Paris;; Röntgen", gold)                   # an empty slot keeps positions
    assert s["em_per_question"] == [1.0, 0.0, 1.0]
    s = score_answer("the Paris city; 1972", [["Paris"], ["1972"]])
    assert s["f1_per_question"][0] == pytest.approx(2 * 0.5 / 1.5) and s["f1_sum"] == pytest.approx(1 + 2 / 3)
    with pytest.raises(ValueError):
        score_answer("x", [])


def test_split_answers():
    assert split_answers(" a ;b;  c ") == ["a", "b", "c"]
    assert split_answers("") == [] and split_answers(None) == []


def test_cost_measures():
    assert peak_context([120, 340, 200]) == 340 and peak_context([]) == 0
    assert dependency([(10, 4)]) == (10 + 2) * 4
    assert dependency([(100, 20), (50, 10)]) == (100 + 10) * 20 + (50 + 5) * 10
    assert dependency([]) == 0
    with pytest.raises(ValueError):
        dependency([(-1, 3)])


@given(st.text())
def test_normalize_is_idempotent(s):
    n = normalize_answer(s)
    assert normalize_answer(n) == n


@given(st.text(), st.text())
def test_f1_bounds_and_em_implies_f1(pred, gold):
    f = f1_score(pred, gold)
    assert 0.0 <= f <= 1.0
    if exact_match(pred, gold):
        assert f == 1.0


def test_copy_probe_known_values():
    from memopd.metrics import copy_probe

    q = "Who founded the Dallas Stars?"
    assert copy_probe("search", "who founded the Dallas Stars", q) == {"copy_f1": 1.0, "copy_exact": 1.0}
    half = copy_probe("search", "Dallas Stars", q)  # normalised: 2 of 4 question tokens ("the" is dropped)
    assert half["copy_exact"] == 0.0 and abs(half["copy_f1"] - 2 * (1 * 0.5) / 1.5) < 1e-12
    assert copy_probe("answer", "", q) == {"copy_f1": 0.0, "copy_exact": 0.0}
    assert copy_probe("invalid", "who founded the Dallas Stars", q)["copy_f1"] == 0.0
