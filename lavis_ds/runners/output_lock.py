"""One run per output folder: rank 0 holds ``<output_dir>/lavis_ds.lock`` from before config.yaml is written until
the run ends.

A second train.py on a folder where a run is training would resume from that run's newest checkpoint, and both
would then write checkpoints and metrics.jsonl side by side. So the second one is refused, naming the first.

How it holds: the file says who took it (process id, host, start time, the machine's boot id and the process's
start tick in /proc), and rank 0 keeps an exclusive POSIX lock (``fcntl``) on it. The kernel drops that lock when
its process ends, however it ends (SIGKILL included), and forked children (DataLoader workers) do not inherit it,
unlike a ``flock``. A run that ends normally, by an error, a signal or Ctrl-C also deletes the file (train.py
releases it in a ``finally``). A file whose lock is free was therefore left by a run that was killed; on the same
host that is confirmed by the process being gone (or the machine restarted), and the file is taken over with a note.

Several nodes: only rank 0 takes the lock (the other ranks belong to the same run). NFS arbitrates POSIX locks
between hosts on the server, so a live run on another host is refused like one on this host; but some
filesystems and mount options keep locks per host (Lustre with ``-o localflock``, NFS with ``local_lock`` or
``nolock``), and a process on another host cannot be probed from here. A file left by another host is therefore
never taken over: the message says to delete it once that run is known to be over.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lavis_ds.common.errors import InputError, report

LOCK_FILE = "lavis_ds.lock"
_HOLDER_WRITE_WAIT = 2.0  # s: a run that has just taken the lock writes who it is within this


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: enough to name the run and to tell on its host whether it still runs."""

    pid: int
    host: str
    started: str  # local time the lock was taken, for people
    boot_id: str | None = None  # this boot of the host: a pid from before a restart is nobody now
    proc_start: int | None = None  # the process's start tick (/proc/<pid>/stat): a reused pid is someone else

    @classmethod
    def me(cls) -> "Holder":
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %z"), _boot_id(),
                   _proc_start(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        """The holder a lock file names; None if it names nobody (empty, cut short, not ours)."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not (isinstance(data, dict) and isinstance(data.get("pid"), int)
                and all(isinstance(data.get(key), str) for key in ("host", "started"))):
            return None
        return cls(**{key: data.get(key) for key in cls.__dataclass_fields__ if key in data})

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host}, started {self.started}"

    def runs_here(self) -> bool:
        """Whether this process still runs (only meaningful when ``host`` is this host)."""
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return False  # the machine restarted since
        if _proc_start(os.getpid()) is not None:  # /proc: the pid, started when the holder was
            start = _proc_start(self.pid)
            return start is not None and self.proc_start in (None, start)
        try:  # no /proc (not Linux): whether the pid exists at all
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class OutputLock:
    """The lock rank 0 holds for the life of a run; ``release()`` on every way out."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Delete the file, then drop the lock (a run that opened the old file then finds it deleted)."""
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:
            pass  # the folder went away: nothing left to release but the lock
        finally:
            os.close(self.fd)
            self.fd = None


def acquire(folder: Path) -> OutputLock:
    """Take ``folder``'s lock (the folder exists); an InputError naming the run that holds it."""
    path = Path(folder) / LOCK_FILE
    for _ in range(10):  # a run releasing it deletes the file: then try the new one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _try_lock(fd)
            if locked is False:
                raise _busy(path, _wait_for_holder(fd))
            if not _same_file(fd, path):
                os.close(fd)
                continue
            previous = _read(fd)
            _check_left(path, previous, locks_work=locked is True)
            _write(fd, Holder.me())
        except BaseException:
            os.close(fd)
            raise
        if previous is not None:
            report(f"run.output_dir: took over {path} from {previous.describe()}, which no longer runs (it was "
                   "killed, or the machine restarted)")
        return OutputLock(path, fd)
    raise InputError(f"run.output_dir: could not take {path}: other runs keep creating and deleting it")


def _check_left(path: Path, previous: Holder | None, locks_work: bool) -> None:
    """Refuse a lock file whose holder may still run: on this host, a live process that a filesystem without
    locks did not keep out; on another host, any (it cannot be probed from here)."""
    if previous is None:
        return
    if previous.host != socket.gethostname():
        raise InputError(
            f"run.output_dir: {path.parent} is locked by {previous.describe()} ({path}). This host cannot tell "
            f"whether that run still goes on. If it does, wait for it or give this run another run.output_dir; if "
            f"it is over (its job was killed or its node lost), delete {path} and start again: a killed run's "
            f"checkpoints are resumed from as usual")
    if previous.runs_here():
        raise _busy(path, previous, "" if locks_work else
                    f" (this filesystem does not support file locks: {path} is judged by what it says)")


def _busy(path: Path, holder: Holder | None, note: str = "") -> InputError:
    who = holder.describe() if holder else "another process (it has not written who it is yet)"
    return InputError(
        f"run.output_dir: {path.parent} is in use by another run: {who} (lock file {path}){note}. Two runs in one "
        "folder would resume from each other's checkpoints and write metrics.jsonl side by side. Wait for that run "
        "to finish or stop it, or give this run another run.output_dir")


def _try_lock(fd: int) -> bool | None:
    """True: this process now holds the lock; False: another process does; None: the filesystem has no locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _wait_for_holder(fd: int) -> Holder | None:
    """The holder of a lock another process holds; it may have taken it an instant ago and not written yet."""
    deadline = time.monotonic() + _HOLDER_WRITE_WAIT
    while (holder := _read(fd)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return holder


def _read(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return Holder.parse(os.read(fd, 65536).decode("utf-8", "replace"))


def _write(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(asdict(holder), indent=1) + "\n").encode(), 0)
    os.fsync(fd)  # on a shared filesystem, another host reads it from the server


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a releasing run may have deleted it meanwhile)."""
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> int | None:
    """The start tick of process ``pid`` (field 22 of /proc/<pid>/stat); None if it does not run (gone, or a zombie
    its parent has not reaped yet) or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else int(fields[19])
