"""memopd.outputs: every figure carries the run's label in its title and PNG Title, the audit figures included."""
from PIL import Image

from memopd.outputs import LABEL_VAR, pyplot, save_figure


def test_a_figure_is_titled_with_the_runs_label(tmp_path, monkeypatch):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    monkeypatch.setenv(LABEL_VAR, "Controlled study")
    drawn = save_figure(fig, tmp_path / "a.png", "reward by step")
    assert drawn == "Controlled study: reward by step" == Image.open(tmp_path / "a.png").text["Title"]
    assert ax.get_title() == drawn and not (tmp_path / "a.tmp.png").exists()
    monkeypatch.delenv(LABEL_VAR)
    fig, ax = plt.subplots()
    save_figure(fig, tmp_path / "b.png", "reward by step", suptitle=True)
    assert Image.open(tmp_path / "b.png").text["Title"] == "reward by step"
    assert fig._suptitle.get_text() == "reward by step" and ax.get_title() == ""


def test_the_audit_figures_carry_the_label(tmp_path, monkeypatch):
    from memopd.audit.steps import _packing_figure, _teacher_figure

    monkeypatch.setenv(LABEL_VAR, "Controlled study")
    rows = [{"invocation": str(i), "top1_agreement": 1.0 - 0.1 * i, "p99_abs_dlogp": 0.5 * i, "mean_kl": 0.1 * i}
            for i in range(3)]
    meta = {"episodes": 4, "benchmark": "q2_test", "model": "student_sft", "rule": "summary_replacement"}
    _teacher_figure(rows, str(tmp_path / "teacher.png"), "teacher_sft", meta)
    assert Image.open(tmp_path / "teacher.png").text["Title"].startswith("Controlled study: teacher teacher_sft on 4")
    _packing_figure([], str(tmp_path / "packing.png"))
    assert Image.open(tmp_path / "packing.png").text["Title"] == (
        "Controlled study: fastest exact packed path per\nconfiguration")
