"""The repository's text speaks of the software, and its pointers into the documentation lead somewhere.

* No development history: no line of a tracked text file (code, configs, tests, documentation) speaks of
  the sessions or issue numbers it was written in. The data samples under data/ are third-party text and
  are not read; this file is left out of the scans (its tests plant such lines on purpose).
* Every pointer of the form README "Heading", README, "Heading" or docs/NAME.md "Heading" names a heading of
  that file; a bare pointer at the README (e.g. "(README)") names none and is refused; every relative link of
  README.md and docs/*.md reaches a file, and an #anchor a heading of it (GitHub's slugs).

Fast: git ls-files and the files' text, no model.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------------------------- the files
def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    return [n for n in out.decode("utf-8").split("\0") if n]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary (a NUL byte, or not UTF-8) or missing file."""
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_files() -> dict[str, str]:
    """Tracked text files, plus docs/*.md on disk (documentation not yet committed is read too); without the
    third-party data samples (data/ except data/README.md) and without this file."""
    names = set(_tracked()) | {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    files = {}
    for name in sorted(names):
        if name == SELF or (name.startswith("data/") and name != "data/README.md"):
            continue
        text = _text(ROOT / name)
        if text is not None:
            files[name] = text
    return files


# ------------------------------------------------------------------------------------ development history
HISTORY = [re.compile(p, re.IGNORECASE) for p in (
    r"\bsessions? \d",                              # a session or sessions and a number
    r"\bissues? #?\d",                              # an issue and its number
    r"\(#\d{1,3}\)",                                # a bracketed tracker reference
    r"\bthis " r"session\b",
    r"\b(earlier|previous|next|later) " r"sessions?\b",
    r"\buntil issue\b",
    r"TODO\(issue",
    r"\bfoundation issue\b",
    r"this project's sessions",
    r"\b(?:the|this|companion) issue's\b",         # the tracker's issue, unnumbered
)]
SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)
# "session" as the name of real things (API identifiers such as start_new_session or pytest_sessionstart do
# not match \bsession\b at all): removed from a line before SESSION is looked for
SESSION_OK = re.compile(
    r"""scope\s*=\s*["']session["']"""               # pytest's session-scoped fixtures
    r"|(?-i:\brequests\.Session\b|\b\w*Session\()"    # HTTP client sessions (the class names)
    r"|\b(?:tmux|screen|ssh|login|shell|terminal|interactive)\s+sessions?\b",
    re.IGNORECASE)


def history_hits(line: str) -> list[str]:
    """The development-history phrases of one line (what each pattern matched)."""
    hits = [m.group(0) for p in HISTORY for m in p.finditer(line)]
    if not hits:
        hits = [m.group(0) for m in SESSION.finditer(SESSION_OK.sub("", line))]
    return hits


def test_history_matcher_catches_planted_lines():
    # written in pieces, so that a plain grep of the repository for such phrases does not find this test
    planted = ["# measured in sess" "ion 9 on 2 cores", "Sess" "ions 5-10 had an Intel CPU", "see iss" "ue 14, item 4",
               "(iss" "ue #" "3)", "fixed in (#" "12)", "as this sess" "ion found", "the previous sess" "ions' figure",
               "kept until iss" "ue 14", "# TODO(iss" "ue 3): wire the index", "the nine configurations of the foundation issue",
               "no GPU was available to this project's sessions", "a new session of the project",
               "measured over two session(s)",
               "0-4 for the two controls (the iss" "ue's budget)"]
    for line in planted:
        assert history_hits(line), line
    clean = ["proc = subprocess.Popen(cmd, start_new_session=True)", '@pytest.fixture(scope="session")',
             "s = requests.Session()", "async with aiohttp.ClientSession() as http:", "def pytest_sessionstart(session_state):", "run it in a tmux session",
             "session_id = uuid4().hex", "issues of the tracker are welcome", "issued 3 requests", "tiss" "ue 4",
             "Q16 tasks took 16-27 min of a core"]
    for line in clean:
        assert not history_hits(line), (line, history_hits(line))


def test_no_development_history():
    found = [f"{name}:{i}: {', '.join(hits)!s}: {line.strip()[:160]}"
             for name, text in text_files().items()
             for i, line in enumerate(text.splitlines(), 1) if (hits := history_hits(line))]
    assert not found, ("development history in the repository's text (say what the software does or what was "
                       "measured, with hardware, config and command):\n" + "\n".join(found))


# ----------------------------------------------------------------------------------------------- pointers
# README "Heading", README, "Heading", README.md "Heading", docs/NAME.md "Heading" (quotes may be escaped, as in a
# Python string literal)
POINTER = re.compile(r"""(?<![\w/.-])(README(?:\.md)?|docs/[\w.-]+\.md),?[ \t]+\\?"([^"\\\n]+)\\?\"""")
# the same opening with no closing quote on the line: a heading broken across lines, which no check can read
BROKEN_POINTER = re.compile(r"""(?<![\w/.-])(README(?:\.md)?|docs/[\w.-]+\.md),?[ \t]+\\?"[^"\n]*$""")
# a pointer at the README that names no heading; README.md (a file name), "the README's ..." do not match
BARE_README = re.compile(r"\(README\)|\bREADME\b[;:)]")


def pointers(line: str) -> list[tuple[str, str]]:
    """(file, heading) of every pointer of one line; file is README.md or docs/NAME.md."""
    return [("README.md" if f.startswith("README") else f, h.strip()) for f, h in POINTER.findall(line)]


def _lines_outside_fences(text: str):
    fence = None
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(```+|~~~+)", line)
        if m:
            if fence is None:
                fence = m.group(1)[0] * 3
            elif m.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            yield i, line


def headings(text: str) -> list[str]:
    """The ATX headings of a Markdown text (outside fenced code), without the #s and the surrounding space."""
    out = []
    for _, line in _lines_outside_fences(text):
        m = re.match(r" {0,3}#{1,6}(?:[ \t]+(.*?))?[ \t]*#*[ \t]*$", line)
        if m:
            out.append((m.group(1) or "").strip())
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lowercased, punctuation except - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of the Markdown links and images of a text, outside code."""
    out = []
    for i, line in _lines_outside_fences(text):
        line = re.sub(r"`[^`]*`", "", line)
        out += [(i, t) for t in LINK.findall(line)] + [(i, t) for t in REF_LINK.findall(line)]
    return out


def test_pointer_parser():
    assert pointers('# each pack on its path (memopd.cost; docs/results.md "Packing benchmark")') == [
        ("docs/results.md", "Packing benchmark")]
    assert pointers('see README, "Run the tests" and README "Repository layout".') == [
        ("README.md", "Run the tests"), ("README.md", "Repository layout")]
    assert pointers(r'"before submitting (docs/tracking.md \"On a SLURM cluster\")")') == [
        ("docs/tracking.md", "On a SLURM cluster")]
    assert pointers('readme = "README.md"') == [] and pointers("results/README.md holds nothing") == []
    assert BROKEN_POINTER.search('# the figures (docs/results.md "Training runs on') and not BROKEN_POINTER.search(
        '# the figures (docs/results.md "Training runs on the embedded default")')
    for bare in ("a step time (README)", "see the README; it says", "(cheaper; README)", "README: minutes per task"):
        assert BARE_README.search(bare), bare
    for fine in ('readme = "README.md"', "!results/README.md", "data/README.md lists them",
                 "the README's test command", 'README "Run the tests"'):
        assert not BARE_README.search(fine), fine
    md = "# Top\n\n## Where F1 is lost: reading, not retrieval\n```\n# not a heading\n```\n## `memopd plan` & co ##\n## Top\n"
    assert headings(md) == ["Top", "Where F1 is lost: reading, not retrieval", "`memopd plan` & co", "Top"]
    assert anchors(md) == {"top", "where-f1-is-lost-reading-not-retrieval", "memopd-plan--co", "top-1"}
    assert links("see [the plan](docs/cluster.md#the-resource-plan), ![fig](a.png) and `[x](not/a/link)`\n"
                 "[ref]: docs/testing.md") == [(1, "docs/cluster.md#the-resource-plan"), (1, "a.png"),
                                               (2, "docs/testing.md")]


def test_pointers_name_existing_headings():
    files = text_files()
    docs = {}  # file -> its headings, None when the file does not exist

    def heads(name):
        if name not in docs:
            text = _text(ROOT / name)
            docs[name] = None if text is None else set(headings(text))
        return docs[name]

    bad = []
    for name, text in files.items():
        for i, line in enumerate(text.splitlines(), 1):
            for target, heading in pointers(line):
                have = heads(target)
                if have is None:
                    bad.append(f"{name}:{i}: {target} does not exist (pointer to \"{heading}\")")
                elif heading not in have:
                    bad.append(f"{name}:{i}: {target} has no heading \"{heading}\"")
            if BROKEN_POINTER.search(line):
                bad.append(f"{name}:{i}: a pointer's heading is broken across lines: {line.strip()[:120]}")
            if BARE_README.search(line):
                bad.append(f"{name}:{i}: a bare README pointer (name the file and heading: "
                           f"docs/NAME.md \"Heading\" or README \"Heading\"): {line.strip()[:120]}")
    for name in ["README.md", *sorted(n for n in files if n.startswith("docs/") and n.endswith(".md"))]:
        text = files.get(name)
        if text is None:
            continue
        for i, target in links(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (ROOT / name).parent / path if path else ROOT / name
            try:
                rel = dest.resolve().relative_to(ROOT).as_posix()
            except ValueError:
                bad.append(f"{name}:{i}: link {target} leaves the repository")
                continue
            if not dest.exists():
                bad.append(f"{name}:{i}: link {target}: no file {rel}")
            elif anchor and dest.is_file():
                if anchor not in anchors(_text(dest) or ""):
                    bad.append(f"{name}:{i}: link {target}: {rel} has no heading with the anchor #{anchor}")
    assert not bad, "pointers into the documentation that lead nowhere:\n" + "\n".join(bad)
