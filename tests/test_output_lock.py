"""The output-folder lock against real processes and real files: a live holder is refused by name, a killed one's
file is taken over with a note, another host's is left to the user, and a released lock is gone.

Whole train.py runs sharing a folder (a busy one refused, a killed one's lock taken over): tests/test_mutations.py.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import time

import pytest

from lavis_ds.common.errors import InputError
from lavis_ds.runners import output_lock
from lavis_ds.runners.output_lock import LOCK_FILE, Holder, acquire


def _hold(folder, ready) -> None:
    """A process that takes the lock and keeps it until it is killed (as a training run's rank 0 does)."""
    acquire(folder)
    ready.set()
    time.sleep(600)


@pytest.fixture
def holder(tmp_path):
    """A live process holding ``tmp_path``'s lock (forked: it shares nothing with this one but the file)."""
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    process = context.Process(target=_hold, args=(tmp_path, ready), daemon=True)
    process.start()
    assert ready.wait(60), "the holder did not take the lock"
    yield process
    process.kill()
    process.join()


def test_a_live_holder_is_refused_by_pid_host_and_start_time(tmp_path, holder):
    written = json.loads((tmp_path / LOCK_FILE).read_text())
    assert written["pid"] == holder.pid and written["host"] == socket.gethostname()
    with pytest.raises(InputError, match=rf"^run\.output_dir: {re.escape(str(tmp_path))} is in use by another run: "
                                         rf"process {holder.pid} on host {re.escape(socket.gethostname())}, started "
                                         rf"{re.escape(written['started'])} \(lock file .*{LOCK_FILE}\)\. .*another "
                                         r"run\.output_dir$"):
        acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == written  # the holder's file is left as it was


def test_a_killed_holder_is_taken_over_with_a_note(tmp_path, holder, capsys):
    holder.kill()
    holder.join()  # reaped: its pid names no process now
    lock = acquire(tmp_path)
    note = capsys.readouterr().err
    assert re.search(rf"lavis_ds: run\.output_dir: took over .*{LOCK_FILE} from process {holder.pid} on host "
                     r"\S+, started .*, which no longer runs", note), note
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_released_lock_is_gone_and_the_next_run_takes_it_without_a_note(tmp_path, capsys):
    acquire(tmp_path).release()
    assert not (tmp_path / LOCK_FILE).exists()
    lock = acquire(tmp_path)
    assert "took over" not in capsys.readouterr().err
    lock.release()
    lock.release()  # a second release (an error path after the first) does nothing


def test_one_process_cannot_take_its_own_folder_twice(tmp_path):
    """POSIX locks do not conflict within one process: the file's contents still tell (this process runs)."""
    lock = acquire(tmp_path)
    with pytest.raises(InputError, match=rf"is in use by another run: process {os.getpid()} on host"):
        acquire(tmp_path)
    lock.release()


def test_a_lock_from_another_host_is_left_to_the_user(tmp_path):
    other = Holder(pid=4242, host="node-b.cluster", started="2026-11-24 21:03:11 +0000")
    (tmp_path / LOCK_FILE).write_text(json.dumps(other.__dict__))
    with pytest.raises(InputError, match=r"is locked by process 4242 on host node-b\.cluster, started 2026-11-24 "
                                         r"21:03:11 \+0000 .*This host cannot tell whether that run still goes on\. "
                                         rf".*delete {re.escape(str(tmp_path / LOCK_FILE))} and start again"):
        acquire(tmp_path)
    assert Holder.parse((tmp_path / LOCK_FILE).read_text()) == other


def test_a_reused_pid_is_not_the_holder(tmp_path, capsys):
    """The pid a killed run had may belong to another process now (here: this one, started at another tick)."""
    me = Holder.me()
    left = Holder(pid=me.pid, host=me.host, started="2026-11-24 21:03:11 +0000", boot_id=me.boot_id,
                  proc_start=me.proc_start - 1)
    (tmp_path / LOCK_FILE).write_text(json.dumps(left.__dict__))
    acquire(tmp_path).release()
    assert f"took over {tmp_path / LOCK_FILE} from process {me.pid}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "{\"pid\": ", "[1, 2]", "{\"pid\": \"12\", \"host\": 3}"])
def test_a_file_that_names_nobody_is_taken(tmp_path, text):
    (tmp_path / LOCK_FILE).write_text(text)
    lock = acquire(tmp_path)
    assert Holder.parse((tmp_path / LOCK_FILE).read_text()).pid == os.getpid()
    lock.release()


def test_a_zombie_is_not_a_running_holder(tmp_path):
    """A killed run's process that its parent has not reaped yet (state Z in /proc) runs no more."""
    context = multiprocessing.get_context("fork")
    child = context.Process(target=os._exit, args=(0,))
    child.start()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has exited and is not reaped
    assert output_lock._proc_start(child.pid) is None
    child.join()
