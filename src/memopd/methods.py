"""The training methods, named in one place: whether a method scores a frozen teacher, which model that
teacher is, and on which state it is scored. The workflow, the trainer and the report read the list from here
(this module imports nothing heavy, so the Snakefile can).

- `ppo`: PPO, no teacher (lambda 0).
- `memopd`: MemOPD, the teacher (`train.teacher`) scored on the exact state each action was sampled in.
- `memopd_persistent`: the matched control, the same teacher scored on the persistent-history flattening at
  the same tokens.
- `memopd_self`: the regularisation control, MemOPD with the SFT student itself (`train.student`) as the frozen
  teacher on the exact state: a KL anchor to the start policy with no better teacher behind it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    teacher: str | None  # the `train` config key naming the frozen teacher model (teacher / student); None: no teacher
    teacher_state: str | None  # the state the teacher scores: "exact" or "persistent"; None: no teacher
    summary: str

    @property
    def needs_teacher(self) -> bool:
        return self.teacher is not None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ppo", None, None, "PPO, no teacher"),
    Method("memopd", "teacher", "exact", "MemOPD: the teacher on the exact state"),
    Method("memopd_persistent", "teacher", "persistent", "MemOPD with the teacher on the persistent history"),
    Method("memopd_self", "student", "exact", "MemOPD with the SFT student as its own teacher (a KL anchor)"),
)}
# The method every table compares with (its columns: rel_to_ppo_pct, diff_vs_ppo): the one with no teacher.
BASELINE = next(m.name for m in METHODS.values() if not m.needs_teacher)
# The matched control's three runs: no teacher, the teacher on the persistent history, on the exact state.
MATCHED_METHODS = (BASELINE, "memopd_persistent", "memopd")
# The regularisation control: the matched-control table compares `memopd` with it when train.methods has it.
SELF_CONTROL = "memopd_self"
# The order of methods in figures and tables: the paper's, then the controls.
ORDER = ("ppo", "memopd_persistent", "memopd", "memopd_self")


def method(name: str) -> Method:
    """The method called `name`; an unknown name is refused, naming the known ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHODS)}")
    return METHODS[name]


def teacher_model(name: str, train: dict) -> str | None:
    """The model directory name of method `name`'s frozen teacher under the `train` config section (None: none)."""
    m = method(name)
    return train[m.teacher] if m.needs_teacher else None


def control_methods(methods) -> tuple[str, ...]:
    """The matched-control table's methods: MATCHED_METHODS, then SELF_CONTROL when `methods` (train.methods) has it."""
    return MATCHED_METHODS + ((SELF_CONTROL,) if SELF_CONTROL in methods else ())
