"""memopd.methods: the one list of training methods, and everything that reads it agrees with it."""
from pathlib import Path

import pytest
import yaml

from memopd.methods import MATCHED_METHODS, METHODS, ORDER, method, teacher_model

ROOT = Path(__file__).resolve().parents[1]


def test_each_method_says_which_teacher_it_scores_and_on_which_state():
    assert [m.name for m in METHODS.values() if not m.needs_teacher] == ["ppo"]
    assert {n: (m.teacher, m.teacher_state) for n, m in METHODS.items()} == {
        "ppo": (None, None), "memopd": ("teacher", "exact"), "memopd_persistent": ("teacher", "persistent"),
        "memopd_self": ("student", "exact")}
    train = {"student": "student_sft", "teacher": "teacher_sft"}
    assert [teacher_model(n, train) for n in ("ppo", "memopd", "memopd_persistent", "memopd_self")] == [
        None, "teacher_sft", "teacher_sft", "student_sft"]
    assert set(ORDER) == set(METHODS) and set(MATCHED_METHODS) <= set(METHODS)
    with pytest.raises(ValueError, match="unknown method 'grpo'; choose from"):
        method("grpo")


def test_the_config_schema_and_the_train_command_allow_exactly_these_methods():
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert schema["properties"]["train"]["properties"]["methods"]["items"]["enum"] == list(METHODS)
    help_text = (ROOT / "tests/data/cli_help/train.txt").read_text()
    assert "{" + ",".join(METHODS) + "}" in help_text
