"""Progress of a long job, one line per unit of work: `eval q2_test: 40/100 episodes, 3m12s elapsed, ~4m48s left`.

On a terminal the line redraws in place with a bar; into a log file (a pipeline job's stdout) each update is a plain
line of its own. The time left is the mean pace of the units done in this process times the units left (a resumed
job counts from where it resumed). No memopd import: every floor may use it.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

BAR = 20  # characters of the terminal bar


def duration(seconds: float) -> str:
    """12s, 3m12s, 1h05m (rounded to the second)."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def time_left(elapsed: float, done: int, total: int, start: int = 0) -> float | None:
    """Seconds left at the pace so far (elapsed / units done since `start`, times the units left); None before the
    first unit."""
    if done <= start:
        return None
    return elapsed / (done - start) * (total - done)


@dataclass
class Progress:
    label: str
    total: int
    unit: str = "steps"
    start: int = 0  # units already done when this process began (a resumed job)
    enabled: bool = True
    stream: TextIO | None = None  # default: sys.stdout
    clock: Callable[[], float] = time.monotonic
    done: int = field(init=False)

    def __post_init__(self):
        self.done, self.t0 = self.start, self.clock()
        self.stream = self.stream or sys.stdout
        self.bar = self.enabled and getattr(self.stream, "isatty", lambda: False)()

    def text(self, note: str = "") -> str:
        elapsed = self.clock() - self.t0
        left = time_left(elapsed, self.done, self.total, self.start)
        line = (f"{self.label}: {self.done}/{self.total} {self.unit}, {duration(elapsed)} elapsed, "
                f"~{'?' if left is None else duration(left)} left")
        return f"{line}, {note}" if note else line

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar:
            filled = BAR * self.done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * filled}{'.' * (BAR - filled)}] {self.text(note)}\x1b[K")
        else:
            self.stream.write(self.text(note) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar:  # the redrawn line stays; what follows starts below it
            self.stream.write("\n")
            self.stream.flush()
