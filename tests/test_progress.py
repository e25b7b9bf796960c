"""memopd.progress: the time left from elapsed time and count, against hand computation with an injected clock."""
import io

from memopd.progress import Progress, duration, time_left


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_time_left_by_hand():
    # 40 of 100 in 192 s: 4.8 s a unit, 60 left -> 288 s
    assert time_left(192.0, 40, 100) == 288.0
    # resumed at 10: 30 units in 60 s -> 2 s a unit, 60 left -> 120 s
    assert time_left(60.0, 40, 100, start=10) == 120.0
    assert time_left(5.0, 10, 100, start=10) is None and time_left(0.0, 0, 100) is None
    assert time_left(50.0, 100, 100) == 0.0


def test_duration_by_hand():
    assert [duration(s) for s in (0, 12.4, 59.6, 192, 3725, 7199.6)] == ["0s", "12s", "1m00s", "3m12s", "1h02m",
                                                                         "2h00m"]


def test_plain_lines_in_a_log_file():
    clock, out = Clock(1000.0), io.StringIO()
    p = Progress("eval q2_test", 100, "episodes", stream=out, clock=clock)
    p.update(0)  # before the first unit: no estimate
    clock.t = 1192.0
    p.update(40)
    clock.t = 1200.0
    p.update(1, note="loss 2.5000")
    p.close()
    assert out.getvalue().splitlines() == [
        "eval q2_test: 0/100 episodes, 0s elapsed, ~? left",
        "eval q2_test: 40/100 episodes, 3m12s elapsed, ~4m48s left",
        # 200 s / 41 units x 59 left = 287.8 s
        "eval q2_test: 41/100 episodes, 3m20s elapsed, ~4m48s left, loss 2.5000"]


def test_resumed_job_counts_from_where_it_resumed():
    clock, out = Clock(0.0), io.StringIO()
    p = Progress("sft", 1000, start=400, stream=out, clock=clock)
    clock.t = 90.0
    p.update(30)  # 3 s a step, 570 left -> 1710 s
    assert out.getvalue() == "sft: 430/1000 steps, 1m30s elapsed, ~28m30s left\n"


def test_bar_on_a_terminal_and_nothing_when_disabled():
    clock, tty = Clock(0.0), Terminal()
    p = Progress("audit", 4, "rules", stream=tty, clock=clock)
    clock.t = 10.0
    p.update()
    p.close()
    assert tty.getvalue() == "\r[#####...............] audit: 1/4 rules, 10s elapsed, ~30s left\x1b[K\n"
    quiet = io.StringIO()
    q = Progress("x", 3, stream=quiet, enabled=False)
    q.update()
    q.close()
    assert quiet.getvalue() == "" and q.done == 1
