"""Sandbox pool for model-written Python: the code environment of rStar2-Agent (arXiv 2508.20722, section 3.1).

The paper serves tens of thousands of tool calls per training step from an isolated, load-balanced execution
service; tool errors and timeouts are part of the learning signal (GRPO-RoC ranks correct trajectories by their
tool error rate, section 2.2.3). This module is that service for one machine. One call flows like this:

    await SandboxPool.run(code, stdin)                 parent process, asyncio, any event loop
      -> queue -> handler thread i (one per worker)    blocking pipe I/O in threads, so the pool is bound to no loop
      -> length-prefixed JSON -> worker i              a long-lived `python -I sandbox.py --worker`, one per core:
           W  (once)      new mount/net/ipc/uts namespaces; a read-only root on a tmpfs; a new PID namespace
           Z  (once)      PID 1 of that namespace: imports numpy, sympy and friends, moves its heap onto 2 MB
                          pages (a fork copies one page-table entry per page), then serves calls
           C  (per call)  forked by Z *before* the call arrives (fresh tmpfs on /tmp, rlimits, unprivileged uid,
                          clean environment, its streams), then: read code -> stdin from a memfd -> run as a
                          notebook cell (a final bare expression is printed) -> exception type on fd 3 -> exit
           Z              drains C's stdout/stderr (head + tail), enforces the wall-clock timeout and the output
                          cap, kills every process in the namespace, classifies, replies, forks the next C
      <- ExecResult(status, stdout, stderr, exit_code, duration_s) -> format_tool_response() -> <tool_response>

Why this shape (bench/bench_sandbox.py measures it): a fork of a warm process that has already imported sympy costs
a few milliseconds, where a fresh `python -c "import sympy"` costs about half a second. Each call is a fresh fork,
so no Python state leaks between calls (the paper's tool is stateless); killing every process in the worker's PID
namespace after each call means daemons, `setsid` children and fork bombs die with their call.

Statuses: ok | error (exception or non-zero exit) | timeout | memory (MemoryError) | output_limit (printed past the
hard cap) | crashed (killed by a signal) | rejected (source too large, NUL bytes). For RoC, any status but "ok"
counts as a tool error.

Isolation is set up once per worker and fails closed: as root, namespaces plus a drop to a per-worker uid; as an
ordinary user, a user namespace (capabilities dropped instead of the uid). Where the kernel or a container runtime
refuses `unshare` (Docker's default seccomp profile does), the pool refuses to start and names what is missing
and the option that accepts less: isolation="none" (the trainer's `--sandbox-isolation none`, or the environment
variable RSTAR2_SANDBOX_ISOLATION=none for any entry point): rlimits, a scratch directory, a clean environment
and process-tree killing only, warned about at start and recorded by the trainer in config.json and every
metrics.jsonl row.

Every call is bounded in every mode (see call_limits()): its processes by a cgroup's pids.max where cgroups are
writable, else by RLIMIT_NPROC where the kernel counts it for the sandbox alone (a uid of its own, or a user
namespace), else by RLIMIT_NPROC set to what the user already runs plus max_processes; and by pid_max in its PID
namespace (300 + max_processes + 3, Linux 6.14+). Its memory by RLIMIT_AS per process and, where cgroups are
writable, by the worker's cgroup memory limit, which counts all its processes together with its /tmp (a tmpfs)
and memfds. Every call has oom_score_adj 1000 (its workers 500): when memory runs out anywhere, the kernel kills
a call first, before the trainer. docs/sandbox.md has the table and the measured bombs. SandboxSession adds optional state.

Run `python sandbox.py` for a small demonstration.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import concurrent.futures
import ctypes
import gc
import io
import json
import linecache
import math
import os
import platform
import queue
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from dataclasses import asdict, dataclass, field
from typing import Sequence

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crashed", "rejected")
ISOLATION_MODES = ("auto", "none", "userns")
ISOLATION_ENV = "RSTAR2_SANDBOX_ISOLATION"  # the default of SandboxConfig.isolation, for every entry point
WEAKER_OPTION = ("isolation='none' (rstar2_mini.py --sandbox-isolation none; SandboxPool(isolation='none'); "
                 "or RSTAR2_SANDBOX_ISOLATION=none in the environment)")


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate model-written code and weaker isolation was not accepted."""


# ---------------------------------------------------------------------------------------------------------------
# Public types: the result of one call and the pool's configuration


@dataclass(frozen=True)
class ExecResult:
    status: str  # one of STATUSES
    stdout: str  # already cut to head + tail when long
    stderr: str  # the traceback shows the user's frames only
    exit_code: int | None  # process exit code; -N when killed by signal N; None when we killed it or it never ran
    duration_s: float  # wall time of the call inside the sandbox


@dataclass
class SandboxConfig:
    """Everything the pool and its workers need; SandboxPool's keyword arguments override these defaults."""

    timeout_s: float = 10.0  # wall time per call (the paper's tool: a few seconds to tens of seconds)
    memory_mb: int = 2048  # RLIMIT_AS of each process; with a cgroup, also the call's total (processes, /tmp, memfds)
    max_output_chars: int = 4096  # kept per stream: head and tail halves, the middle counted and cut
    hard_output_bytes: int = 1 << 20  # a call that prints more than this (stdout + stderr) is killed
    max_source_bytes: int = 1 << 20  # larger code or stdin is rejected without running
    file_size_mb: int = 64  # RLIMIT_FSIZE: no file larger than this
    scratch_mb: int = 256  # size of the per-call tmpfs mounted on /tmp (the only writable place)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_processes: int = 64  # processes (threads included) of one call: cgroup pids.max or RLIMIT_NPROC (call_limits)
    sandbox_uid: int = 990_000  # base of the unprivileged uids/gids code runs as (see sandbox_uid(); no passwd entry)
    recycle_after: int = 5000  # calls after which a worker is replaced by a fresh one (started in the background)
    startup_timeout_s: float = 120.0  # a worker must import its preloads within this
    # "auto": namespaces (as root with a uid of their own, else in a user namespace) or refuse to start;
    # "none": accept no namespaces (warned, recorded); "userns": force the user-namespace mode (tests as root)
    isolation: str = field(default_factory=lambda: os.environ.get(ISOLATION_ENV, "auto"))
    cgroup: bool = True  # a cgroup (v2, else v1) with memory and pids limits per worker, where cgroups are writable
    preload: tuple[str, ...] = ("numpy", "sympy")


# The whole environment of a worker and of every call: nothing of the parent's environment gets in.
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OPENBLAS_NUM_THREADS": "1",  # one core per worker; also keeps BLAS thread pools out of forked children
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# Imported by every worker besides `preload`: what model-written math code reaches for first. Each one missing from
# the warm worker would be imported again by every call that uses it (numpy.random alone costs ~17 ms a call).
WARM_IMPORTS = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq", "bisect",
                "re", "random", "statistics", "string", "json", "numpy.random", "numpy.linalg", "numpy.fft",
                "numpy.polynomial", "sympy.ntheory", "sympy.solvers")
USER_FILENAME = "<string>"  # what tracebacks call the model's code, as `python -c` does
RESULT_FD = 3  # the call's result channel (stdout and stderr are 1 and 2, so printed text cannot reach it)


# ---------------------------------------------------------------------------------------------------------------
# The tool's result text (what goes inside <tool_response>...</tool_response>)
#
# The released recipe (volcengine/verl recipe/rstar2_agent, code_judge_utils.py) answers with
#   "Tool call success\nstdout: ...\nstderr: ...\nexecution time: 0.12s"   or
#   "Tool call failure\nreason: ...\nstdout: ...\nstderr: ...\nexecution time: 0.12s"
# We keep that shape and spell the reason out, so the model can learn what went wrong.


def cut_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of `text` (max_chars in all) and say how many characters were left out."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n... [{len(text) - head - tail} characters omitted] ...\n{text[len(text) - tail:]}"


def describe_failure(result: ExecResult) -> str:
    """One line for `reason:`: what happened, in words the model can act on."""
    if result.status == "error":
        return f"error (exit code {result.exit_code})"
    if result.status == "timeout":
        return "timeout: the code ran past its time limit and was killed"
    if result.status == "memory":
        return "memory: the code ran out of memory"
    if result.status == "output_limit":
        return "output_limit: the code printed too much and was killed"
    if result.status == "crashed":
        return f"crashed: killed by signal {signal_name(result.exit_code)}"
    if result.status == "rejected":
        return "rejected: the code was not run"
    return result.status


def signal_name(exit_code: int | None) -> str:
    if exit_code is None or exit_code >= 0:
        return "unknown"
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return str(-exit_code)


def format_tool_response(result: ExecResult, max_chars: int = 4096) -> str:
    """The paper's tool text: success with stdout, stderr and execution time, or failure with the reason."""
    if result.status == "ok":
        parts = ["Tool call success"]
    else:
        parts = ["Tool call failure", f"reason: {describe_failure(result)}"]
    if result.stdout:
        parts.append(f"stdout: {cut_middle(result.stdout, max_chars)}")
    if result.stderr:
        parts.append(f"stderr: {cut_middle(result.stderr, max_chars)}")
    parts.append(f"execution time: {result.duration_s:.2f}s")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Linux plumbing: namespaces, mounts and capabilities through libc (Python 3.11 has no os.unshare)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
MADV_HUGEPAGE, MADV_COLLAPSE, HUGE_PAGE = 14, 25, 2 << 20  # MADV_COLLAPSE: Linux 6.1+
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    check(libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    ret = libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    check(ret, f"mount {source} on {target}")


def umount(target: str) -> None:
    check(libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


def prctl(option: int, value: int) -> None:
    check(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)), "prctl")


def drop_all_capabilities() -> None:
    """capset(2) with empty sets: what stands in for 'not root' inside a user namespace that maps one uid."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, all sets empty
    check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


# ---------------------------------------------------------------------------------------------------------------
# Worker start-up (runs once per worker, as W): namespaces and the read-only view of the file system

NEW_ROOT = "/sys"  # borrowed as the mount point of the new root's tmpfs (in our private mount namespace only)
TMP_STASH = "/.interpreter-in-tmp"  # interpreter files that live under /tmp are bound here (see remap_interpreter)
DEVICES = ("null", "zero", "full", "random", "urandom")


def enter_namespaces(mode: str) -> dict:
    """Unshare mount, network, IPC and UTS namespaces (as root, or inside a new user namespace)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if mode == "auto" and os.geteuid() == 0:
        unshare(flags)
        return {"kind": "root"}
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER | flags)  # unprivileged user namespaces: we become "root" over our own namespaces
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    return {"kind": "userns"}


def paths_the_interpreter_needs() -> list[str]:
    """System libraries plus everything on sys.path: the files the sandboxed interpreter must be able to read."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
             "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"]
    paths += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    paths += [os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    chosen: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths if os.path.lexists(p)}, key=len):
        if not any(path == c or path.startswith(c + "/") for c in chosen):  # already inside a chosen tree
            chosen.append(path)
    return chosen


def interpreter_paths_in_tmp() -> list[str]:
    """Interpreter paths under /tmp (a clone or virtual environment there). Each call's /tmp is a fresh, empty
    tmpfs, and binding them into it would show them in the call's working directory: they are bound under
    TMP_STASH instead, and the worker's Python looks for them there (remap_interpreter)."""
    return [p for p in paths_the_interpreter_needs() if p.startswith("/tmp/") and not os.path.islink(p)]


def remap_interpreter(in_tmp: Sequence[str]) -> None:
    """Z, after the pivot: every path of the interpreter under /tmp (sys.path, the prefixes, sys.executable, the
    search paths and files of modules already imported) now points at its bind under TMP_STASH, before the
    preloads are imported. A subprocess of sys.executable finds its pyvenv.cfg there too; what it cannot follow is
    a .pth file or a pyvenv.cfg `home` that names a /tmp path, which stays hidden behind the call's /tmp."""
    prefixes = sorted(in_tmp, key=len, reverse=True)

    def moved(path):
        if isinstance(path, str):
            for prefix in prefixes:
                if path == prefix or path.startswith(prefix + "/"):
                    return TMP_STASH + path
        return path

    sys.path[:] = [moved(p) for p in sys.path]
    for name in ("prefix", "exec_prefix", "base_prefix", "base_exec_prefix", "executable", "_base_executable"):
        if hasattr(sys, name):
            setattr(sys, name, moved(getattr(sys, name)))
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [moved(p) for p in search]
        if isinstance(getattr(module, "__file__", None), str):
            module.__file__ = moved(module.__file__)
    sys.path_importer_cache.clear()
    import importlib

    importlib.invalidate_caches()


def mount_flags_to_keep(path: str) -> int:
    """Flags a read-only remount must repeat (inside a user namespace, dropping them is refused)."""
    f = os.statvfs(path).f_flag
    kept = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return kept | (MS_RELATIME if f & 4096 else 0)  # ST_RELATIME is 4096, MS_RELATIME is 1 << 21


def bind_readonly(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | mount_flags_to_keep(target))


def build_sandbox_root() -> list[str]:
    """A tmpfs that will become '/': read-only binds of the interpreter and system libraries, a few devices.
    Returns the interpreter paths under /tmp, bound under TMP_STASH (see remap_interpreter).

    The interpreter may live where the sandbox uid cannot enter (here /root/.pyenv, and /root is 0700): the
    directories leading to the bind mounts are created 0755 on our tmpfs, so the host's permissions are untouched
    and nothing else of /root, /home, /work or /tmp is visible at all.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount from here on propagates to the host
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for path in paths_the_interpreter_needs():
        target = NEW_ROOT + path
        if os.path.islink(path):  # /bin -> usr/bin on merged-/usr systems: copy the link
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        else:
            bind_readonly(os.path.realpath(path), target)
    in_tmp = interpreter_paths_in_tmp()
    for path in in_tmp:
        bind_readonly(os.path.realpath(path), NEW_ROOT + TMP_STASH + path)
    os.makedirs(NEW_ROOT + "/dev", exist_ok=True)
    for name in DEVICES:  # device nodes are bind mounts of the host's (creating nodes needs real root)
        open(f"{NEW_ROOT}/dev/{name}", "a").close()
        mount(f"/dev/{name}", f"{NEW_ROOT}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    for name in ("tmp", "proc"):
        os.makedirs(f"{NEW_ROOT}/{name}", exist_ok=True)
    return in_tmp


def enter_sandbox_root() -> None:
    """Runs in Z, PID 1 of the worker's PID namespace: mount its /proc, then make the tmpfs the root."""
    try:  # hidepid: the call sees only its own processes, not the root-owned supervisor
        mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    except OSError:
        mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.chdir(NEW_ROOT)
    if SYS_PIVOT_ROOT is not None:
        check(libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), b".", b"."), "pivot_root")  # old root ends up on top
        umount(".")  # ... and is detached: the host's file system is gone from this namespace
    else:
        os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=16m,mode=0755")


def set_up_isolation(mode: str) -> tuple[dict, bool]:
    """Runs in W. Returns (what is in place, whether to fork Z into a new PID namespace)."""
    # "unprivileged" holds in every mode: root drops to a sandbox uid, a user namespace drops its capabilities.
    iso = {"mode": mode, "kind": "none", "network": False, "filesystem": False, "pid_namespace": False,
           "unprivileged": True, "host_uid": os.getuid()}
    if mode not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, not {mode!r}")
    if mode == "none":
        return iso, False
    try:
        iso.update(enter_namespaces(mode))
        iso["network"] = True
    except OSError as e:
        iso["error"] = str(e)
        return iso, False
    try:
        iso["interpreter_in_tmp"] = build_sandbox_root()
        iso["filesystem"] = True
    except OSError as e:
        iso["error"] = str(e)
    try:
        socket.sethostname("sandbox")
    except OSError:
        pass
    try:
        unshare(CLONE_NEWPID)
        iso["pid_namespace"] = True
    except OSError as e:
        iso["error"] = str(e)
    return iso, iso["pid_namespace"]


def required_isolation_missing(iso: dict) -> list[str]:
    """What isolation="auto" requires and this worker lacks: then the pool refuses to start."""
    names = {"network": "network namespace", "filesystem": "private read-only file system view",
             "pid_namespace": "PID namespace"}
    return [name for key, name in names.items() if not iso[key]]


def missing_isolation(iso: dict) -> list[str]:
    """Names of what this worker could not set up, for the one warning the pool prints."""
    missing = []
    if not iso["network"]:
        missing.append("network namespace (code can reach the network and the host's loopback services)")
    if not iso["filesystem"]:
        missing.append("private read-only file system view (code can read files its uid can read)")
    if not iso["pid_namespace"]:
        missing.append("PID namespace (descendants are killed by scanning instead)")
    if iso["kind"] == "userns":
        missing.append("separate uid (user namespace maps one uid; capabilities are dropped instead)")
    if iso["kind"] == "none" and os.geteuid() == 0:
        missing.append("interpreter files for the dropped uid (imports beyond the preloaded modules may fail)")
    if not iso.get("cgroup"):
        missing.append(f"cgroup memory limit ({iso.get('cgroup_absent')}: a call's processes, /tmp and memfds are "
                       "bounded one by one, not together; oom_score_adj 1000 still makes a call the OOM killer's "
                       "first choice)")
    return missing


# ---------------------------------------------------------------------------------------------------------------
# Message framing between the pool and its workers: 4-byte big-endian length, then UTF-8 JSON


def send_message(fd: int, message: dict) -> None:
    data = json.dumps(message).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes from fd, or None at EOF; raises TimeoutError past the deadline (monotonic clock)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_message(fd: int, deadline: float | None = None) -> dict | None:
    header = read_exactly(fd, 4, deadline)
    if header is None:
        return None
    body = read_exactly(fd, struct.unpack(">I", header)[0], deadline)
    return None if body is None else json.loads(body)


# ---------------------------------------------------------------------------------------------------------------
# Inside the call (C): forked ahead of time, set up, then waits for its code on fd 0


def process_limit(config: dict, iso: dict) -> int | None:
    """RLIMIT_NPROC for a call, or None where it cannot bound one. The kernel counts processes and threads per
    user, and since Linux 5.14 per user namespace; it exempts uid 0 (the host's root) altogether."""
    n = config["max_processes"]
    if iso["host_uid"] == 0:  # root drops to a uid of this worker's own; forced "userns" stays uid 0: exempt
        return n if iso["kind"] != "userns" else None
    if iso["kind"] == "userns" and kernel_at_least(5, 14):
        return n + 2  # counted in this worker's user namespace alone: W, Z and the call
    return tasks_of_uid(os.getuid()) + n  # counted with the user's other processes: leave the call n more


def kernel_at_least(major: int, minor: int) -> bool:
    try:
        return tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


def tasks_of_uid(uid: int) -> int:
    """Processes and threads whose real uid is `uid`, as far as this process can see them (RLIMIT_NPROC's count)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                pass
    return count


def set_limits(config: dict, iso: dict) -> None:
    """Per-call resource limits, set while still privileged so that the code cannot raise them again."""
    mb = 1 << 20
    limits = {
        resource.RLIMIT_AS: config["memory_mb"] * mb,
        resource.RLIMIT_FSIZE: config["file_size_mb"] * mb,
        resource.RLIMIT_NOFILE: config["max_open_files"],
        resource.RLIMIT_CORE: 0,
    }
    nproc = process_limit(config, iso)
    if nproc is not None:
        limits[resource.RLIMIT_NPROC] = nproc
    set_oom_score_adj(1000)  # the OOM killer's first choice, whatever the call's size; raising it needs no privilege
    for which, value in limits.items():
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def set_oom_score_adj(value: int) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(value))


def limit_cpu_time(timeout_s: float) -> None:
    """A backstop only (the supervisor's wall-clock timer kills first); lowering a limit needs no privilege."""
    seconds = math.ceil(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))


def sandbox_uid(config: dict) -> int:
    """Worker i of the pool in process P runs code as base + 256 * (P % 4096) + i, so concurrent pools rarely share
    a uid (a shared uid shares RLIMIT_NPROC: one pool's fork bomb could make another's forks fail)."""
    return config["sandbox_uid"] + 256 * (config["parent_pid"] % 4096) + config["index"]


def drop_privileges(uid: int, kind: str) -> None:
    """Never run model code as root: a per-worker uid, or (in a user namespace) no capabilities."""
    if kind == "userns":
        drop_all_capabilities()
    elif os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from 0 to non-zero: the kernel clears every capability
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot give anything back
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after the uid change, which clears it


ORIGINAL_STREAMS: list = []  # Z's sys.stdin/stdout/stderr, kept alive so their finalizers never close fds 0-2
CALL_STREAMS: list = []  # the calls' text streams on fds 0-2: built once by Z, unused there, inherited by each fork


def build_call_streams() -> None:
    """Text streams on fds 0-2 for the calls; stdout line-buffered so a timeout still returns what was printed.
    Z builds them once and never uses them; every call installs its own (forked) copy: ~0.2 ms a call saved."""
    CALL_STREAMS[:] = [open(0, "r", encoding="utf-8", errors="replace", closefd=False),
                       open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False),
                       open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)]


def connect_streams() -> None:
    """In the call: sys.stdin/stdout/stderr become the fresh streams on fds 0-2."""
    ORIGINAL_STREAMS.extend([sys.stdin, sys.stdout, sys.stderr])
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = CALL_STREAMS


def compile_cell(code: str) -> tuple[types.CodeType, types.CodeType | None]:
    """Split the code like a notebook cell: the statements, and the final bare expression (if any) to print."""
    tree = ast.parse(code, USER_FILENAME)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), USER_FILENAME, "eval")
    return compile(tree, USER_FILENAME, "exec"), last


def print_user_traceback(error: BaseException) -> None:
    """Like Python's own report, minus the harness frames that lead to the user's code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != USER_FILENAME:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb, file=sys.stderr)


def fresh_main() -> types.ModuleType:
    """A new, empty __main__ module for the code to run in (as `python -c` would give it)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


def run_cell(code: str, main: types.ModuleType) -> tuple[int, str | None]:
    """Run the code in `main`; returns (exit code, name of the exception that ended it, if any)."""
    linecache.cache[USER_FILENAME] = (len(code), None, code.splitlines(True), USER_FILENAME)  # source in tracebacks
    try:
        body, last = compile_cell(code)
        exec(body, main.__dict__)
        if last is not None:
            value = eval(last, main.__dict__)
            if value is not None:
                print(repr(value))
        for thread in threading.enumerate():  # Python waits for non-daemon threads at exit; so do we
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        return 0, None
    except SystemExit as e:  # the same rules as the interpreter's exit
        if e.code is None:
            return 0, None
        if isinstance(e.code, int):
            return e.code & 0xFF, "SystemExit"
        print(e.code, file=sys.stderr)
        return 1, "SystemExit"
    except BaseException as e:  # noqa: BLE001 - everything the code raises is the code's error
        try:
            print_user_traceback(e)
        except BaseException:  # noqa: BLE001 - e.g. stderr closed by the code, or no memory left to format
            pass
        return 1, type(e).__name__


def replay_history(history: Sequence[tuple[str, str]], main: types.ModuleType) -> None:
    """Stateful sessions only: rerun the session's earlier successful cells, their output thrown away."""
    streams = sys.stdin, sys.stdout, sys.stderr
    for code, stdin in history:
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), io.StringIO(), io.StringIO()
        run_cell(code, main)
    sys.stdin, sys.stdout, sys.stderr = streams


def child_main(config: dict, iso: dict, fds: tuple[int, int, int, int], scratch: str) -> None:
    """C: set everything up, wait for the code, run it as a notebook cell, report, exit. Never returns."""
    os.setsid()  # its own session and process group (killed as a group when there is no PID namespace)
    for target, fd in enumerate(fds):  # 0 the request pipe (stdin later), 1 stdout, 2 stderr, 3 result channel
        os.dup2(fd, target, inheritable=target != RESULT_FD)
    os.closerange(RESULT_FD + 1, 1 << 16)  # among them the pool's request/response pipes
    set_limits(config, iso)
    os.chdir(scratch)
    if not iso["filesystem"]:  # no private /tmp: temporary files go to the scratch directory, wiped after the call
        os.environ["TMPDIR"] = os.environ["HOME"] = tempfile.tempdir = scratch
    drop_privileges(sandbox_uid(config), iso["kind"])
    connect_streams()  # (the environment is already SANDBOX_ENV: Z set it once, see worker_main)
    sys.argv = ["-c"]
    sys.path.insert(0, "")  # as with `python -c`: modules written to the scratch directory can be imported
    if "numpy.random" in sys.modules:  # fork copies numpy's global random state: give every call its own seed
        sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))  # (stdlib random reseeds itself)

    request = read_message(0)  # -- everything above ran before the call was asked for; the clock starts here
    if request is None:
        os._exit(0)  # the worker is shutting down
    limit_cpu_time(request["timeout_s"])
    stdin = os.memfd_create("stdin")  # the whole input, then EOF: input() never blocks
    os.write(stdin, request["stdin"].encode())
    os.lseek(stdin, 0, os.SEEK_SET)
    os.dup2(stdin, 0)  # replaces (and so closes) the request pipe
    os.close(stdin)

    main = fresh_main()
    replay_history(request.get("history", ()), main)
    exit_code, exception = run_cell(request["code"], main)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - closed by the code
            pass
    try:  # a separate fd: nothing printed can forge it (code that writes to fd 3 on purpose only hurts itself)
        os.write(RESULT_FD, json.dumps({"exit_code": exit_code, "exception": exception}).encode() + b"\n")
    except OSError:
        pass
    for fd in (1, 2, RESULT_FD):  # EOF on all three tells the supervisor we are done, before our exit's teardown
        try:
            os.close(fd)
        except OSError:
            pass
    os._exit(exit_code)


# ---------------------------------------------------------------------------------------------------------------
# The supervisor (Z): one call at a time, each a fresh fork made while the previous result travels back


class HeadTail:
    """Keeps the first and last bytes of a stream and counts the characters in between (UTF-8)."""

    CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: deleting them leaves one byte per char

    def __init__(self, keep: int):
        self.head_cap, self.tail_cap = keep // 2, keep - keep // 2
        self.head, self.tail, self.total_bytes, self.total_chars = bytearray(), bytearray(), 0, 0

    def feed(self, data: bytes) -> None:
        self.total_bytes += len(data)
        self.total_chars += len(data.translate(None, self.CONTINUATION))
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        del self.tail[:max(0, len(self.tail) - self.tail_cap)]

    def text(self) -> str:
        kept = len(self.head) + len(self.tail)
        if self.total_bytes == kept:
            return (self.head + self.tail).decode("utf-8", "replace")
        cut = self.total_chars - len(bytes(self.head + self.tail).translate(None, self.CONTINUATION))
        return (f"{self.head.decode('utf-8', 'replace')}\n... [{cut} characters omitted] ...\n"
                f"{self.tail.decode('utf-8', 'replace')}")


def fresh_scratch(config: dict, iso: dict, scratch_root: str | None) -> str:
    """A new, empty, private /tmp for every call (a tmpfs: its size caps disk use, and it leaves nothing behind)."""
    uid = 0 if iso["kind"] == "userns" else sandbox_uid(config)
    if iso["filesystem"]:
        try:
            umount("/tmp")
        except OSError:
            pass  # first call: nothing mounted yet
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={config['scratch_mb']}m,nr_inodes=16384,mode=0700,uid={uid},gid={uid}")
        return "/tmp"
    path = os.path.join(scratch_root, "call")  # no mount namespace: a directory that is wiped after every call
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o700)
    if os.geteuid() == 0:
        os.chown(path, uid, uid)
    return path


@dataclass
class Call:
    """A forked call waiting for its code, and the supervisor's ends of its pipes."""

    pid: int
    pidfd: int  # readable once the call's main process has exited
    request_w: int
    out_r: int
    err_r: int
    result_r: int
    reaped: bool = False  # its wait status has been collected (its pid may be reused from then on)


def fork_call(config: dict, iso: dict, scratch_root: str | None) -> Call:
    scratch = fresh_scratch(config, iso, scratch_root)
    (req_r, req_w), (out_r, out_w), (err_r, err_w), (res_r, res_w) = os.pipe(), os.pipe(), os.pipe(), os.pipe()
    gc.freeze()  # forked calls must not COW-copy the whole heap when their garbage collector scans it (~40 ms)
    pid = os.fork()
    if pid == 0:
        try:
            child_main(config, iso, (req_r, out_w, err_w, res_w), scratch)
        except BaseException:  # noqa: BLE001 - the sandbox's own set-up failed: say so on the call's stderr
            os.write(2, f"sandbox set-up failed:\n{traceback.format_exc()}".encode())
        finally:
            os._exit(70)
    for fd in (req_r, out_w, err_w, res_w):
        os.close(fd)
    return Call(pid, os.pidfd_open(pid), req_w, out_r, err_r, res_r)


def kill_everything_but_me(call: Call, iso: dict) -> None:
    """SIGKILL the call and every process it started (daemons and setsid children included)."""
    if iso["pid_namespace"]:
        assert os.getpid() == 1  # kill(-1) from a namespace's init reaches exactly that namespace
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    # No PID namespace. While the call is unreaped its pid (and so its process group id) cannot be reused: kill
    # the group. Then anything that was re-parented to us (we are a subreaper), until nothing is left.
    if not call.reaped:
        for kill in (os.killpg, os.kill):
            try:
                kill(call.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:  # wait until it is a zombie (not reaped: its pid stays ours): by then the kernel has re-parented
            os.waitid(os.P_PID, call.pid, os.WEXITED | os.WNOWAIT)  # every child it had to us, the subreaper
        except ChildProcessError:
            pass
    for _ in range(100):
        others = [child for child in children_of(os.getpid()) if child != call.pid]
        if not others:
            break
        for child in others:
            try:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def children_of(parent: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        kids.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def reap_all(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def classify(reason: str | None, report: dict | None, status: int, rusage, cpu_limit: float,
             oom_killed: bool = False) -> tuple[str, int | None]:
    """The status and exit code, from what we saw (our own kill reason, the wait status, the cgroup's OOM kills)
    and what the call said."""
    if reason is not None:  # we killed it: "timeout" or "output_limit"
        return reason, None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if oom_killed and sig == signal.SIGKILL:  # the cgroup's memory limit: the kernel killed one of its processes
            return "memory", -sig
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and rusage.ru_utime + rusage.ru_stime >= cpu_limit - 0.5):
            return "timeout", None  # the CPU-time backstop fired
        return "crashed", -sig
    code = os.WEXITSTATUS(status)
    if report is not None and report.get("exception") == "MemoryError":
        return "memory", code
    return ("ok" if code == 0 else "error"), code


PF_EXITING = 0x4  # task flag: the process is inside exit(2); its exit code is fixed, no more of its code runs


def exit_status_if_exiting(pid: int) -> int | None:
    """The wait status of a call that is already inside exit(2), read from /proc/PID/stat (flags, exit_code).

    The exit's memory teardown takes milliseconds after the call has closed its streams; reading the status here
    lets the reply go out without waiting for it. A report on fd 3 alone is never trusted: code could write one
    and carry on. Returns None while the process still runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # fields[0] is field 3 (state) of proc(5)
    except OSError:
        return None
    return int(fields[49]) if int(fields[6]) & PF_EXITING else None  # fields 52 (exit_code) and 9 (flags)


def supervise_call(call: Call, request: dict, config: dict, iso: dict) -> dict:
    """Z: hand the code to the waiting fork, collect its output, enforce time and output caps, kill the rest."""
    out, err, res = HeadTail(config["max_output_chars"]), HeadTail(config["max_output_chars"]), HeadTail(4096)
    oom_before = oom_kills(iso.get("oom_fd"))
    streams = {call.out_r: out, call.err_r: err, call.result_r: res}  # an fd leaves this dict at EOF
    start = time.monotonic()
    deadline, reason, status, rusage = start + request["timeout_s"], None, None, None
    try:
        send_message(call.request_w, request)
    except BrokenPipeError:
        pass  # the fork died during set-up; its stderr says why
    os.close(call.request_w)

    def pump(wait_s: float, watch_exit: bool) -> bool:
        """Read whatever is ready; True when the call's main process has exited."""
        ready = select.select([*streams, *([call.pidfd] if watch_exit else [])], [], [], max(0.0, wait_s))[0]
        for fd in ready:
            if fd != call.pidfd:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    streams[fd].feed(chunk)
                else:
                    os.close(fd)
                    del streams[fd]
        return call.pidfd in ready

    # Phase 1: until the call has exited (or, having closed all its streams, is inside exit(2) with a normal exit
    # code), runs out of time, or prints past the hard cap.
    poll_s = 0.0005  # once every stream is closed we poll /proc for the exit, backing off to 50 ms
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        if pump(remaining if streams else min(remaining, poll_s), watch_exit=True):
            _, status, rusage = os.wait4(call.pid, 0)  # a zombie now: its full wait status and CPU time
            call.reaped = True
        elif not streams:
            early = exit_status_if_exiting(call.pid)
            status = early if early is not None and os.WIFEXITED(early) else None  # signals: wait for rusage
            poll_s = min(0.05, poll_s * 2)
        if out.total_bytes + err.total_bytes > config["hard_output_bytes"]:
            reason = "output_limit"
            break
    duration = time.monotonic() - start

    # Phase 2: nothing of the call survives it; read what is left in the pipes (their writers are dead now).
    kill_everything_but_me(call, iso)
    grace = time.monotonic() + 2.0
    while streams and time.monotonic() < grace:
        pump(grace - time.monotonic(), watch_exit=False)
    for fd in streams:
        os.close(fd)
    if reason is not None and not call.reaped:
        _, status, rusage = os.wait4(call.pid, 0)
        call.reaped = True

    report = None  # the harness's word on which exception ended the call (only MemoryError matters)
    lines = res.text().strip().splitlines()
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            pass
    oom_killed = oom_kills(iso.get("oom_fd")) > oom_before
    state, exit_code = classify(reason, report, status, rusage, math.ceil(request["timeout_s"]) + 1, oom_killed)
    if oom_killed and state != "memory" and not err.total_bytes:  # e.g. a child of the call was the one killed
        err.feed(b"the call's processes together reached the sandbox's memory limit\n")
    return {"status": state, "stdout": out.text(), "stderr": err.text(), "exit_code": exit_code,
            "duration_s": duration}


def finish_call(call: Call, iso: dict) -> None:
    """After the reply has gone: reap the call and everything it left (all already SIGKILLed)."""
    if not call.reaped:
        os.waitpid(call.pid, 0)
    os.close(call.pidfd)
    reap_all(block=True)  # everything left is SIGKILLed: until reaped, it still counts toward RLIMIT_NPROC / pids


def serve(config: dict, iso: dict) -> None:
    """Z's main loop: fork the next call, wait for a request, supervise, reply, clean up; until stdin closes."""
    scratch_root = None if iso["filesystem"] else tempfile.mkdtemp(prefix="rstar2-sandbox-")
    if scratch_root:
        os.chmod(scratch_root, 0o711)  # the dropped uid may pass through to its scratch directory (TMPDIR)
    try:
        while True:
            call = fork_call(config, iso, scratch_root)
            request = read_message(0)
            if request is None:
                kill_everything_but_me(call, iso)
                return
            try:
                response = supervise_call(call, request, config, iso)
            except Exception as e:  # noqa: BLE001 - the supervisor failing is reported, not fatal
                kill_everything_but_me(call, iso)
                response = {"status": "crashed", "stdout": "", "stderr": f"sandbox internal error: {e!r}",
                            "exit_code": None, "duration_s": 0.0}
            send_message(1, response)
            finish_call(call, iso)
    finally:
        if scratch_root:
            shutil.rmtree(scratch_root, ignore_errors=True)


def collapse_heap_into_huge_pages() -> int:
    """Back Z's heap (numpy and sympy's objects: ~48 MB) with 2 MB pages; returns how many MB it moved.

    Every call costs one fork, which copies a page-table entry per resident 4 KB page, and one exit, which tears
    them all down again: with sympy loaded that is ~15,000 entries each way and most of a call's CPU time (perf:
    copy_page_range and exit_mmap). A 2 MB page is one entry. A page the call writes is still copied on its own
    (the kernel splits the huge mapping first), so calls stay exactly as isolated. Measured on 2 cores: an empty
    fork + exit 2.8 -> 1.7 ms. Where the kernel has no MADV_COLLAPSE (before Linux 6.1), nothing changes."""
    moved = 0
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for fields in regions:
        low, high = (int(x, 16) for x in fields[0].split("-"))
        anonymous = len(fields) < 6 or fields[5] == "[heap]"
        start, end = -(-low // HUGE_PAGE) * HUGE_PAGE, high // HUGE_PAGE * HUGE_PAGE  # whole 2 MB pages inside
        if not (fields[1].startswith("rw") and anonymous and end > start):
            continue
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_COLLAPSE) == 0:
            moved += (end - start) >> 20
    return moved


def join_cgroup(paths: dict) -> int:
    """W moves itself into the worker's cgroup (made by the pool), so Z and every call are born inside it.
    Returns an fd on the file that counts the cgroup's OOM kills (read after the pivot, which hides /sys)."""
    for procs in paths["procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return os.open(paths["events"], os.O_RDONLY)


def oom_kills(fd: int | None) -> int:
    """The cgroup's OOM-kill count: "oom_kill N" in memory.events (v2) or memory.oom_control (v1)."""
    if fd is None:
        return 0
    for line in os.pread(fd, 4096, 0).decode().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def limit_pid_namespace(max_processes: int) -> int | None:
    """Z: pid_max of its own PID namespace (Linux 6.14+), a process limit that needs neither a uid nor a cgroup.
    Every process and thread needs a pid below pid_max, so a call never has more than pid_max - 1 tasks. Once the
    namespace has handed out pid 300 the kernel allocates from 300 up only (pids 1-299 are reserved after the
    first wrap, and 301 is the smallest pid_max it takes): 300 + max_processes + 3 leaves a call max_processes
    (+ the supervisor's spare) from then on, and at most 300 + max_processes + 2 before."""
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(300 + max_processes + 3))
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def call_limits(config: dict, iso: dict) -> list[str]:
    """In words, what bounds one call here (reported by the pool; docs/sandbox.md explains each)."""
    limits = [f"RLIMIT_AS {config['memory_mb']} MB per process", "oom_score_adj 1000"]
    if iso["filesystem"]:
        limits.append(f"/tmp tmpfs {config['scratch_mb']} MB")
    if iso.get("cgroup"):
        limits.append(f"cgroup v{iso['cgroup']}: memory and pids of the worker and its calls together")
    nproc = process_limit(config, iso)
    if nproc is not None:
        limits.append(f"RLIMIT_NPROC {nproc}")
    if iso.get("pid_max"):
        limits.append(f"pid_max {iso['pid_max']} in the PID namespace")
    return limits


def worker_main(config: dict) -> None:
    """Entry point of a worker process (`python -I sandbox.py --worker CONFIG`)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the pool's handler thread dies -> so do we
    if os.getppid() != config["parent_pid"]:
        os._exit(1)  # the pool died before we could ask to follow it
    os.umask(0o022)
    os.environ.clear()  # what every call's code sees (the pool started us with it; made certain here, once)
    os.environ.update(SANDBOX_ENV)
    set_oom_score_adj(500)  # the supervisors go before the trainer too, after the calls (1000)
    oom_fd = join_cgroup(config["cgroup_paths"]) if config.get("cgroup_paths") else None  # W, Z and every call
    iso, fork_init = set_up_isolation(config["isolation"])
    iso["cgroup"] = (config.get("cgroup_paths") or {}).get("version")
    iso["cgroup_absent"] = None if iso["cgroup"] else config.get("cgroup_absent")
    iso["oom_fd"] = oom_fd
    if fork_init:  # W forks Z, the PID namespace's init, and waits for it
        pid = os.fork()
        if pid != 0:
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a call come back to us, to be killed
    if iso["filesystem"]:
        enter_sandbox_root()
        remap_interpreter(iso.get("interpreter_in_tmp", ()))
    iso["pid_max"] = limit_pid_namespace(config["max_processes"]) if iso["pid_namespace"] else None
    iso["missing"] = missing_isolation(iso)
    iso["limits"] = call_limits(config, iso)
    failed = []
    for name in config["preload"]:  # after the pivot: proves the sandbox's view of the interpreter works
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{name}: {e!r}")
    for name in WARM_IMPORTS:  # submodules only of what was preloaded (numpy.* only when numpy is wanted)
        if name.split(".")[0] in sys.modules or "." not in name:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - a convenience, not a requirement
                pass
    build_call_streams()
    gc.collect()
    huge_mb = collapse_heap_into_huge_pages()
    report = {k: v for k, v in iso.items() if k != "oom_fd"}
    send_message(1, {"ready": True, "isolation": report, "preload_failed": failed, "huge_pages_mb": huge_mb})
    serve(config, iso)


# ---------------------------------------------------------------------------------------------------------------
# Per-worker cgroups (parent side): one memory + pids limit for a worker and all of its calls' processes
#
# cgroup v2: a child of this process's cgroup's parent (a cgroup with processes cannot also have children that
# use controllers), with memory.max, memory.swap.max = 0 and pids.max. cgroup v1: children of this process's
# memory and pids cgroups. Where neither can be written (a container's read-only /sys/fs/cgroup, a cgroup not
# delegated to this user), the pool says so in its warning and the per-process limits remain.

CGROUP_PREFIX = "rstar2-sandbox"


def own_cgroups() -> dict[str, str]:
    """Controller ("" for the v2 unified hierarchy) -> this process's cgroup, from /proc/self/cgroup."""
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                found[controller] = path
    return found


def cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Controller ("" for cgroup2) -> (mount point, the cgroup path mounted there), from /proc/self/mountinfo."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields, (fstype, _, options) = left.split(), right.split()[:3]
            if fstype == "cgroup2":
                mounts.setdefault("", (fields[4], fields[3]))
            elif fstype == "cgroup":
                for controller in set(options.split(",")) & {"memory", "pids"}:
                    mounts.setdefault(controller, (fields[4], fields[3]))
    return mounts


def cgroup_dir(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return os.path.normpath(point + "/" + path)


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def make_worker_cgroup(name: str, memory_bytes: int, tasks: int) -> tuple[dict | None, str]:
    """A cgroup for one worker, memory and tasks limited: (paths, "") or (None, why there is none)."""
    try:
        own, mounts = own_cgroups(), cgroup_mounts()
    except (OSError, ValueError) as e:
        return None, f"cannot read this process's cgroups ({e})"
    why = []
    if "" in own and "" in mounts:
        mine = cgroup_dir(mounts[""], own[""])
        parent = mine if own[""] == "/" else os.path.dirname(mine)
        d = os.path.join(parent, name)
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            wanted = [c for c in ("memory", "pids") if c not in enabled]
            if wanted:
                write_file(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
            os.mkdir(d)
            try:
                write_file(f"{d}/memory.max", str(memory_bytes))
                write_file(f"{d}/pids.max", str(tasks))
                if os.path.exists(f"{d}/memory.swap.max"):
                    write_file(f"{d}/memory.swap.max", "0")
            except OSError:
                os.rmdir(d)
                raise
            return {"version": 2, "dirs": [d], "procs": [f"{d}/cgroup.procs"], "limit": f"{d}/memory.max",
                    "usage": f"{d}/memory.current", "events": f"{d}/memory.events"}, ""
        except OSError as e:
            why.append(f"cgroup v2 at {parent}: {e.strerror or e}")
    if "memory" in mounts and "pids" in mounts and "memory" in own and "pids" in own:
        dirs = []
        try:
            for controller in ("memory", "pids"):
                dirs.append(os.path.join(cgroup_dir(mounts[controller], own[controller]), name))
                os.mkdir(dirs[-1])
            memory, pids = dirs
            write_file(f"{memory}/memory.limit_in_bytes", str(memory_bytes))
            write_file(f"{pids}/pids.max", str(tasks))
            return {"version": 1, "dirs": dirs, "procs": [f"{d}/cgroup.procs" for d in dirs],
                    "limit": f"{memory}/memory.limit_in_bytes", "usage": f"{memory}/memory.usage_in_bytes",
                    "events": f"{memory}/memory.oom_control"}, ""
        except OSError as e:
            for d in reversed(dirs):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            why.append(f"cgroup v1 memory and pids: {e.strerror or e}")
    if not why:
        why.append("no cgroup v2 hierarchy nor v1 memory and pids hierarchies")
    return None, "; ".join(why)


def remove_worker_cgroup(paths: dict) -> None:
    """Kill whatever is left inside (normally nothing: the worker's PID namespace died with it) and remove it."""
    for d in paths["dirs"]:
        for _ in range(100):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                try:
                    with open(f"{d}/cgroup.procs") as f:
                        for pid in f.read().split():
                            os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
                time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------------------
# The pool (parent side): one handler thread per worker; asyncio callers wait on concurrent futures


@dataclass
class Worker:
    proc: subprocess.Popen
    isolation: dict
    calls: int = 0
    cgroup: dict | None = None


class SandboxPool:
    """Warm, isolated Python workers behind `await pool.run(code, stdin)`.

    Bound to no event loop: `asyncio.run(...)` may be called repeatedly with the same pool, or one loop may run
    in a background thread. Use `async with SandboxPool() as pool:` or start() / close().
    """

    def __init__(self, workers: int | None = None, timeout_s: float = 10.0, memory_mb: int = 2048,
                 max_output_chars: int = 4096, preload: Sequence[str] = ("numpy", "sympy"), **options):
        self.config = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                                    preload=tuple(preload), **options)
        if self.config.isolation not in ISOLATION_MODES:
            raise ValueError(f"sandbox isolation must be one of {', '.join(ISOLATION_MODES)}, "
                             f"not {self.config.isolation!r}")
        self.workers = workers or len(os.sched_getaffinity(0))
        self.isolation: dict = {}  # what the first worker has in place (kind, namespaces, limits, missing ...)
        self._cgroups: dict[int, dict] = {}  # worker pid -> its cgroup
        self._launches = 0
        self.stats = {"calls": 0, "restarts": 0, "recycled": 0, "huge_pages_mb": 0}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._worker_pids: set[int] = set()
        self._lock = threading.Lock()
        self._closing = False

    # -- lifecycle

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self._threads:
            return
        self._closing = False
        self._queue = queue.SimpleQueue()  # a fresh queue: nothing left over from an earlier start() / close()
        ready = [concurrent.futures.Future() for _ in range(self.workers)]
        for index in range(self.workers):
            thread = threading.Thread(target=self._handle_worker, args=(index, ready[index]), daemon=True,
                                      name=f"sandbox-worker-{index}")
            thread.start()
            self._threads.append(thread)
        try:
            reports = [await asyncio.wrap_future(f) for f in ready]
        except BaseException:
            await self.close()
            raise
        self.isolation = reports[0]
        lacking = required_isolation_missing(reports[0])
        if lacking and self.config.isolation != "none":  # fail closed: never weaker than asked for
            await self.close()
            raise SandboxUnavailable(refusal_message(reports[0], lacking))
        if reports[0]["missing"]:
            warnings.warn(f"sandbox: running with weaker isolation (isolation={self.config.isolation!r}); "
                          "missing: " + "; ".join(reports[0]["missing"]), RuntimeWarning, stacklevel=2)

    @property
    def mode(self) -> str:
        """The isolation in place, in one word for logs and metrics: "namespaces" (as root: with a uid of their
        own), "userns" (namespaces inside a user namespace) or "none"."""
        kind = self.isolation.get("kind")
        return {"root": "namespaces", "userns": "userns"}.get(kind, "none") if kind else "not started"

    async def close(self) -> None:
        """Stop every worker; afterwards no process and no temporary directory of the pool is left."""
        self._closing = True
        for _ in self._threads:
            self._queue.put(None)
        threads, self._threads = self._threads, []
        await asyncio.to_thread(lambda: [t.join() for t in threads])

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(self._worker_pids)

    # -- calls

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None,
                  history: Sequence[tuple[str, str]] = ()) -> ExecResult:
        """Run `code` with `stdin` in a fresh sandboxed process. `history` is for SandboxSession only."""
        rejection = self._check_input(code, stdin, history)
        if rejection:
            return ExecResult("rejected", "", rejection, None, 0.0)
        if not self._threads:
            raise RuntimeError("SandboxPool is not started: use `async with SandboxPool() as pool` or start()")
        request = {"code": code, "stdin": stdin, "timeout_s": float(timeout_s or self.config.timeout_s),
                   "history": [list(h) for h in history]}
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((request, future))
        return await asyncio.wrap_future(future)  # cancelling the await cancels a call that has not started

    def _check_input(self, code: str, stdin: str, history: Sequence[tuple[str, str]]) -> str | None:
        """Why the call must not run ("rejected"), or None. A session's history counts toward the size limits."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            return "code and input must be strings"
        if "\x00" in code:
            return "source contains a NUL byte"
        try:
            code_bytes = len(code.encode()) + sum(len(c.encode()) for c, _ in history)
            stdin_bytes = len(stdin.encode()) + sum(len(i.encode()) for _, i in history)
        except UnicodeEncodeError:
            return "source is not valid UTF-8 text"
        if code_bytes > self.config.max_source_bytes:
            return f"source too large: {code_bytes} bytes (limit {self.config.max_source_bytes})"
        if stdin_bytes > self.config.max_source_bytes:
            return f"input too large: {stdin_bytes} bytes (limit {self.config.max_source_bytes})"
        return None

    # -- the handler thread of worker `index`

    def _handle_worker(self, index: int, ready: concurrent.futures.Future) -> None:
        worker = spare = None
        try:
            worker = self._start_worker(index)
            ready.set_result(worker.isolation)
        except BaseException as e:  # noqa: BLE001
            ready.set_exception(e)
            return
        try:
            while (item := self._queue.get()) is not None:
                request, future = item
                if not future.set_running_or_notify_cancel():
                    continue  # the caller gave up before the call started
                if self._closing:
                    future.set_exception(RuntimeError("SandboxPool closed"))
                    continue
                if worker is None:
                    try:
                        worker = self._start_worker(index)
                    except Exception as e:  # noqa: BLE001
                        future.set_result(ExecResult("crashed", "", f"sandbox worker could not start: {e}", None, 0))
                        continue
                try:
                    result, worker_ok = self._call(worker, request)
                except Exception as e:  # noqa: BLE001 - a bug of ours: the caller hears of it, the thread lives
                    result, worker_ok = ExecResult("crashed", "", f"sandbox internal error: {e!r}", None, 0.0), False
                future.set_result(result)
                with self._lock:
                    self.stats["calls"] += 1
                if not worker_ok:  # dead or hung: replace it
                    self._stop_worker(worker)
                    worker = None
                    with self._lock:
                        self.stats["restarts"] += 1
                    continue
                # Recycling: a fresh worker boots in the background while the old one keeps serving.
                if worker.calls >= self.config.recycle_after and spare is None:
                    spare = self._launch(index)
                if spare is not None and select.select([spare.stdout], [], [], 0)[0]:
                    try:
                        fresh = self._await_ready(spare, time.monotonic() + 5.0)
                    except Exception:  # noqa: BLE001
                        self._stop_worker(Worker(spare, {}))
                    else:
                        self._stop_worker(worker)
                        worker = fresh
                        with self._lock:
                            self.stats["recycled"] += 1
                    spare = None
        finally:
            for w in (worker, Worker(spare, {}) if spare else None):
                if w is not None:
                    self._stop_worker(w)

    def _call(self, worker: Worker, request: dict) -> tuple[ExecResult, bool]:
        """Send one request and wait for its answer. Returns (result, whether the worker is still usable)."""
        worker.calls += 1
        deadline = time.monotonic() + request["timeout_s"] + 10.0  # the worker enforces the timeout; this is a
        try:  # safety net against a supervisor that hangs
            send_message(worker.proc.stdin.fileno(), request)
            answer = read_message(worker.proc.stdout.fileno(), deadline)
        except TimeoutError:
            return ExecResult("timeout", "", "sandbox worker stopped responding and was replaced", None,
                              request["timeout_s"]), False
        except OSError:  # broken pipe: the worker is gone
            answer = None
        if answer is None:
            return ExecResult("crashed", "", "sandbox worker died and was replaced", None, 0.0), False
        return ExecResult(**answer), True

    def _launch(self, index: int) -> subprocess.Popen:
        config = {**asdict(self.config), "index": index, "parent_pid": os.getpid()}
        cgroup, why = None, "switched off (cgroup=False)"
        if self.config.cgroup:
            with self._lock:
                self._launches += 1
                name = f"{CGROUP_PREFIX}-{os.getpid()}-{index}-{self._launches}"
            # until the worker is ready: room for its start-up; then its own size + memory_mb (_await_ready)
            cgroup, why = make_worker_cgroup(name, (self.config.memory_mb + 1024) << 20, self.config.max_processes + 2)
        config["cgroup_paths"], config["cgroup_absent"] = cgroup, why
        proc = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker", json.dumps(config)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=SANDBOX_ENV, close_fds=True,
                                start_new_session=True)  # no terminal signals: the pool decides when workers end
        with self._lock:
            self._worker_pids.add(proc.pid)
            if cgroup:
                self._cgroups[proc.pid] = cgroup
        return proc

    def _await_ready(self, proc: subprocess.Popen, deadline: float) -> Worker:
        try:
            hello = read_message(proc.stdout.fileno(), deadline)
        except TimeoutError:
            hello = None
        if not hello or not hello.get("ready"):
            self._stop_worker(Worker(proc, {}))
            raise RuntimeError(f"sandbox worker failed to start (exit code {proc.poll()})")
        if hello["preload_failed"]:
            warnings.warn(f"sandbox: preload failed: {hello['preload_failed']}", RuntimeWarning)
        self.stats["huge_pages_mb"] = hello["huge_pages_mb"]  # the latest worker's (see collapse_heap_into_huge_pages)
        with self._lock:
            cgroup = self._cgroups.get(proc.pid)
        if cgroup:  # the worker's own memory is charged now: the calls get memory_mb on top of it
            with open(cgroup["usage"]) as f:
                write_file(cgroup["limit"], str(int(f.read()) + (self.config.memory_mb << 20)))
        return Worker(proc, hello["isolation"], cgroup=cgroup)

    def _start_worker(self, index: int) -> Worker:
        return self._await_ready(self._launch(index), time.monotonic() + self.config.startup_timeout_s)

    def _stop_worker(self, worker: Worker) -> None:
        """Close its stdin (Z exits, its PID namespace dies, W exits); SIGKILL if it does not go quickly."""
        proc = worker.proc
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()  # W dies; Z follows through its parent-death signal, and the namespace with it
            proc.wait()
        with self._lock:
            self._worker_pids.discard(proc.pid)
            cgroup = self._cgroups.pop(proc.pid, None)
        if cgroup:
            remove_worker_cgroup(cgroup)


def refusal_message(iso: dict, lacking: list[str]) -> str:
    """Why the pool will not start, and the option that accepts weaker isolation (one paragraph, for people)."""
    cause = iso.get("error") or "unknown"
    return (f"sandbox: cannot isolate model-written code: no {', no '.join(lacking)} ({cause}). Container runtimes "
            "block unshare(2) by default (Docker's seccomp profile; allow it with `--security-opt "
            "seccomp=unconfined` or run as root with CAP_SYS_ADMIN), and some kernels disable user namespaces "
            "(kernel.unprivileged_userns_clone=0, or AppArmor's apparmor_restrict_unprivileged_userns=1 on "
            f"Ubuntu 23.10+). To run with rlimits, a scratch directory and process killing only - code can then "
            f"reach the network and read what its uid can read - accept it with {WEAKER_OPTION}.")


class SandboxSession:
    """Optional stateful tool (off by default: the paper's tool is stateless, each call a fresh process).

    Later calls see the variables of earlier successful ones. As the released recipe's SimJupyterTool does, every
    call replays the session's earlier successful calls (their output thrown away) in its own fresh fork before
    running the new code: a failed call rolls back by construction and no process is held between turns. The
    price: replay time grows with the history and counts toward the call's timeout, and replayed code that draws
    random numbers draws new ones.
    """

    def __init__(self, pool: SandboxPool):
        self.pool = pool
        self.history: list[tuple[str, str]] = []  # (code, stdin) of every successful call so far

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        result = await self.pool.run(code, stdin, timeout_s, history=self.history)
        if result.status == "ok":
            self.history.append((code, stdin))
        return result


# ---------------------------------------------------------------------------------------------------------------
# Entry points: the worker, or a small demonstration


async def demo() -> None:
    async with SandboxPool() as pool:
        print("isolation:", pool.isolation)
        for code in ["import sympy\nsympy.factorint(2**64 - 1)", "while True: pass", "1/0",
                     "import socket; socket.create_connection(('127.0.0.1', 22))"]:
            result = await pool.run(code, timeout_s=2)
            print(f"--- {code!r}\n{format_tool_response(result)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
    else:
        asyncio.run(demo())
