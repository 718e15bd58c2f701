"""The disk tier's faults on real files and file systems: a writer killed with SIGKILL at a
random moment, a full file system, a read-only one, two processes on one directory.

After every fault, each block reads back exactly as some put stored it, or is a miss; no
call raises. A full file system is a tmpfs of a few MiB the test mounts (as root), and the
file size limit (``RLIMIT_FSIZE``, any user) in a writer process: the two ways a write is
refused for want of room (ENOSPC, EFBIG). Neither is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.tiers import DiskInUseError
from kvoffload_spec.errors import InvalidArgumentError
from tests import disk_writer
from tests.disk_support import assert_accounted, content, disk_store, whose

pytestmark = pytest.mark.slow  # writers killed, file systems filled: the full gate

ROOT = Path(__file__).resolve().parent.parent


def writer(mode: str, path: Path, seed: int = 0, **options: object) -> subprocess.Popen[str]:
    process: subprocess.Popen[str] = subprocess.Popen(
        [sys.executable, "-m", "tests.disk_writer", mode, str(path), str(seed)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **options,  # type: ignore[call-overload]
    )
    assert process.stdout is not None
    if mode != "fill":
        assert process.stdout.readline().strip() == "ready"
    return process


def killed_at_random(path: Path, seed: int, *, tear: bool = False) -> dict[str, int]:
    """Run a writer, SIGKILL it after a random time (or let it tear one of its writes and
    kill itself), reopen: every block exact or a miss."""
    process = writer("tear" if tear else "write", path, seed)
    if tear:
        assert process.wait(timeout=60) == -signal.SIGKILL
    else:
        time.sleep(random.Random(seed).uniform(0.02, 0.25))
        process.send_signal(signal.SIGKILL)
        process.wait()
    store = disk_store(path, blocks=disk_writer.BLOCKS, block_bytes=disk_writer.SIZE)
    keys = list(range(disk_writer.KEYS))
    views = store.get(keys)
    for key, view in zip(keys, views, strict=True):
        if view is not None:
            found = whose(view.tobytes())
            assert found is not None and found[0] == key, (seed, key, view.tobytes()[:16])
    stats = store.stats()
    assert_accounted(stats)
    # What the reopened store holds is the same to the next process.
    assert store.put([999], [content(999, disk_writer.SIZE)]) == [True]
    store.close()
    return {"hits": stats.hits, "rejected": stats.rejected, "opened": stats.opened_blocks}


@pytest.mark.parametrize("seed", range(3))
def test_a_writer_killed_at_a_random_moment_leaves_exact_blocks_or_misses(
    tmp_path: Path, seed: int
) -> None:
    found = killed_at_random(tmp_path / "disk", seed)
    assert found["opened"] > 0


def test_a_write_torn_by_a_crash_is_refused_never_read(tmp_path: Path) -> None:
    """The torn slot's record still names the block it held before (a victim, or the
    previous version of a block written again): that block's read is refused."""
    seen = [killed_at_random(tmp_path / f"disk-{seed}", seed, tear=True) for seed in range(3)]
    assert all(found["opened"] > 0 for found in seen)
    assert sum(found["rejected"] for found in seen) > 0


def test_many_kills_on_one_directory_never_leave_a_wrong_byte(tmp_path: Path) -> None:
    """Twenty kills in a row on one directory, half of them tearing a write: each restart
    finds the blocks the last one left, exact, and refuses the torn ones."""
    seen = [
        killed_at_random(tmp_path / "disk", seed, tear=seed % 2 == 0) for seed in range(100, 120)
    ]
    assert sum(found["hits"] for found in seen) > 0
    assert sum(found["rejected"] for found in seen) > 0  # the tears were there, and refused


# -- a full file system --------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``where``; yields False where mounting is not allowed."""
    where.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_file_system_fails_puts_counted_and_keeps_what_fits(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "1m") as mounted:
        if not mounted:  # not root: the other way to run out of room
            return test_the_file_size_limit_fails_puts_counted(tmp_path)
        store = disk_store(tmp_path / "small" / "disk", blocks=64, block_bytes=64 * 1024)
        answers = [store.put([key], [content(key, 64 * 1024)])[0] for key in range(64)]
        assert answers[0] and not answers[-1]
        stats = store.stats()
        assert stats.disk_full > 0 and stats.keys_not_stored == answers.count(False)
        for key, view in enumerate(store.get(list(range(64)))):
            assert (view is not None) == answers[key]
            assert view is None or view.tobytes() == content(key, 64 * 1024)
        assert_accounted(store.stats())
        store.close()
        reopened = disk_store(tmp_path / "small" / "disk", blocks=64, block_bytes=64 * 1024)
        assert reopened.stats().opened_blocks == answers.count(True)
        reopened.close()
    return None


def test_the_file_size_limit_fails_puts_counted(tmp_path: Path) -> None:
    import resource

    limit = 600 * 1024  # the slot file reaches it after 8 blocks of 64 KiB + a page each

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    process = writer("fill", tmp_path / "disk", preexec_fn=limited)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    seen = json.loads(out)
    answers = seen["answers"]
    assert answers[:8] == [True] * 8 and not any(answers[9:])
    assert seen["disk_full"] > 0 and seen["keys_not_stored"] == answers.count(False)
    assert seen["readable"] == [key for key, ok in enumerate(answers) if ok]
    assert seen["rejected"] == 0


# -- read-only -----------------------------------------------------------------------------


def make_read_only(path: Path) -> contextlib.AbstractContextManager[None]:
    """``path`` read-only: a read-only bind mount as root (who ignores file modes), else
    the modes of the directory and its files."""

    @contextlib.contextmanager
    def bound() -> Iterator[None]:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)

    @contextlib.contextmanager
    def modes() -> Iterator[None]:
        for entry in path.iterdir():
            entry.chmod(0o400)
        path.chmod(0o500)
        try:
            yield
        finally:
            path.chmod(0o700)
            for entry in path.iterdir():
                entry.chmod(0o600)

    return bound() if os.geteuid() == 0 else modes()


def test_a_read_only_directory_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    store = disk_store(tmp_path / "disk")
    store.put([1], [content(1)])
    store.close()
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "disk", empty):
        with make_read_only(path), pytest.raises(InvalidArgumentError, match=r"writable|denied"):
            disk_store(path)
    assert sorted(os.listdir(empty)) == []
    store = disk_store(tmp_path / "disk")  # writable again: the block is still there
    assert bytes(store.get([1])[0] or b"") == content(1)
    store.close()


# -- two processes -------------------------------------------------------------------------


def test_a_second_process_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    holder = writer("hold", tmp_path / "disk")
    try:
        with pytest.raises(DiskInUseError):
            disk_store(tmp_path / "disk")
    finally:
        holder.communicate(timeout=30)  # closes its stdin: it lets go
    disk_store(tmp_path / "disk").close()


def test_a_killed_holder_lets_go_of_the_directory(tmp_path: Path) -> None:
    holder = writer("hold", tmp_path / "disk")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    disk_store(tmp_path / "disk").close()
