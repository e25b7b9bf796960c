"""memopd.atomic: a target is replaced whole once the block ends, and an error leaves it as it was, with no
temporary sibling behind."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from memopd.atomic import atomic_path, write_text


class Planted(Exception):
    pass


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_the_block_writes_the_temporary_sibling_and_the_target_appears_at_the_end(tmp_path):
    target = tmp_path / "out.json"
    with atomic_path(target) as tmp:
        assert tmp == tmp_path / "out.json.tmp"
        tmp.write_text("first half ")
        assert not target.exists()  # a reader sees nothing while the block writes
        with open(tmp, "a") as f:
            f.write("second half")
    assert target.read_text() == "first half second half"
    assert _siblings(target) == ["out.json"]


def test_a_string_path_and_an_existing_file_are_replaced(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    inode = target.stat().st_ino
    with atomic_path(str(target)) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"
    assert target.read_text() == "new" and target.stat().st_ino != inode  # a new file renamed in, not rewritten
    assert _siblings(target) == ["out.txt"]


@pytest.mark.parametrize("old", ["old content", None])
def test_an_exception_in_the_block_keeps_the_target_and_removes_the_temporary(tmp_path, old):
    target = tmp_path / "out.csv"
    if old is not None:
        target.write_text(old)
    with pytest.raises(Planted):
        with atomic_path(target) as tmp:
            tmp.write_text("half a fil")
            raise Planted
    if old is None:
        assert _siblings(target) == []
    else:
        assert target.read_text() == old and _siblings(target) == ["out.csv"]


def test_an_interrupt_cleans_up_as_an_error_does(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"\0" * 10)
            raise KeyboardInterrupt
    assert _siblings(target) == []


def test_a_block_that_writes_nothing_fails_and_leaves_the_target(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(FileNotFoundError):
        with atomic_path(target):
            pass
    assert target.read_text() == "old"


def test_a_failed_move_removes_the_temporary(tmp_path):
    """A file cannot replace a directory: the move fails, the directory stays, the temporary goes."""
    target = tmp_path / "out"
    (target / "inner").mkdir(parents=True)
    with pytest.raises(OSError):
        with atomic_path(target) as tmp:
            tmp.write_text("a file")
    assert target.is_dir() and (target / "inner").is_dir()
    assert _siblings(target) == ["out"]


def test_a_directory_replaces_the_directory_at_the_target(tmp_path):
    """What an index directory needs: a new tree in place of the old one, none of the old files left."""
    target = tmp_path / "index"
    (target / "sub").mkdir(parents=True)
    (target / "old.bin").write_text("old")
    (target / "sub" / "deep.txt").write_text("old")
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "meta.json").write_text("{}")
        assert (target / "old.bin").exists()  # the old tree is whole until the block ends
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == ["meta.json"]
    assert _siblings(target) == ["index"]


def test_a_directory_lands_where_there_was_none(tmp_path):
    target = tmp_path / "a" / "index"
    target.parent.mkdir()
    with atomic_path(target) as tmp:
        (tmp / "x").mkdir(parents=True)
    assert (target / "x").is_dir() and _siblings(target) == ["index"]


def test_an_exception_while_a_directory_is_written_removes_its_tree_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "index"
    target.mkdir()
    (target / "meta.json").write_text("old")
    with pytest.raises(Planted):
        with atomic_path(target) as tmp:
            (tmp / "sub").mkdir(parents=True)
            (tmp / "sub" / "part.bin").write_bytes(b"12")
            raise Planted
    assert (target / "meta.json").read_text() == "old"
    assert _siblings(target) == ["index"]


def test_write_text_replaces_whole_and_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "state.json"
    write_text(target, '{"sent": 1}')
    assert target.read_text() == '{"sent": 1}'
    write_text(str(target), '{"sent": 2}\n')
    assert target.read_bytes() == b'{"sent": 2}\n'
    with pytest.raises(UnicodeEncodeError):
        write_text(target, "x" * 100 + "\ud800")  # no encoding takes a lone surrogate: fails once the file is open
    assert target.read_text() == '{"sent": 2}\n'
    assert _siblings(target) == ["state.json"]


def test_a_reader_never_sees_a_partial_file(tmp_path):
    """A reader polling the target while large files are written over it sees only whole ones."""
    target = tmp_path / "big.txt"
    texts = [str(i) * 200_000 for i in range(1, 6)]
    write_text(target, texts[0])
    seen, stop = set(), threading.Event()

    def read():
        while True:
            seen.add(target.read_text())
            if stop.is_set():
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for t in texts[1:]:
            write_text(target, t)
            os.sched_yield()
    finally:
        stop.set()
        reader.join()
    assert seen and seen <= set(texts)
