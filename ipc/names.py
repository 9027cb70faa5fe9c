"""Names, creation and removal of the server's POSIX shared-memory segments and semaphores.

Every object is named ``/asyncserve-<pid>-<token>-<what>``: pid is the creating (server) process,
token is random per owner object, so two servers never collide and neither do two owners inside one
process, nor a new server whose pid was reused from a dead one. On Linux the objects appear in
/dev/shm as ``asyncserve-...`` (segments) and ``sem.asyncserve-...`` (semaphores).

What this process creates is unlinked by its owner's close(), and whatever is left at interpreter
exit by an atexit hook (only in the creating process: a forked child exiting must not unlink its
parent's objects). A server killed with SIGKILL runs neither; ``cleanup_stale()`` at the next start
removes the objects of every asyncserve pid that is no longer alive.
"""
from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
from pathlib import Path

import posix_ipc

PREFIX = "asyncserve"
SHM_DIR = Path("/dev/shm")
_STALE = re.compile(rf"^(sem\.)?{PREFIX}-(\d+)-")

# name -> ("shm" | "sem", creating pid): what this process still has to unlink
_created: dict[str, tuple[str, int]] = {}


def new_prefix() -> str:
    """``/asyncserve-<pid>-<token>``: the names of one owner (an arena, a worker pool) start with it."""
    return f"/{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"


def create_shm(name: str, size: int) -> mmap.mmap:
    """A new zero-filled segment of ``size`` bytes, mapped read-write; unlinked at exit."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    _created[name] = ("shm", os.getpid())
    try:
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def attach_shm(name: str) -> mmap.mmap:
    """Map an existing segment (a worker attaching to what the server created)."""
    shm = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def create_sem(name: str, value: int = 0) -> posix_ipc.Semaphore:
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=value)
    _created[name] = ("sem", os.getpid())
    return sem


def unlink(name: str) -> None:
    """Remove a name this process created (mappings and open semaphores stay usable until closed)."""
    kind, _ = _created.pop(name, ("shm", 0))
    try:
        if kind == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def close_map(view: mmap.mmap) -> None:
    """Unmap, unless tensors still view it (then the mapping goes when the last view does)."""
    try:
        view.close()
    except BufferError:
        pass


@atexit.register
def _unlink_all() -> None:
    for name, (_, pid) in list(_created.items()):
        if pid == os.getpid():
            unlink(name)


def pid_alive(pid: int) -> bool:
    """True for a running process (of any user); a zombie counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cleanup_stale(shm_dir: Path = SHM_DIR, pids: set[int] | None = None) -> list[str]:
    """Unlink the segments and semaphores of asyncserve processes that are gone (of those ``pids`` only,
    where given); returns their names."""
    removed = []
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _STALE.match(entry)
        if m is None or (pids is not None and int(m.group(2)) not in pids) or pid_alive(int(m.group(2))):
            continue
        try:
            if m.group(1):
                posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
            else:
                posix_ipc.unlink_shared_memory("/" + entry)
        except posix_ipc.ExistentialError:
            continue    # another server's cleanup got there first
        removed.append(entry)
    return removed


def leftovers(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """/dev/shm entries whose names start with ``prefix`` (``/asyncserve-<pid>-...``)."""
    stem = prefix.lstrip("/")
    return sorted(e for e in os.listdir(shm_dir) if e.startswith(stem) or e.startswith("sem." + stem))
