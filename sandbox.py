"""Sandbox pool for model-written Python: the code environment of rStar2-Agent (arXiv 2508.20722, section 3.1).

The paper serves tens of thousands of tool calls per training step from an isolated, load-balanced execution
service; tool errors and timeouts are part of the learning signal (GRPO-RoC ranks correct trajectories by their
tool error rate, section 2.2.3). This module and the two it starts are that service for one machine:
the pool's side is here; the worker's side is sandbox_worker.py (the warm worker, its supervisor and each
call's process), which shuts a call in with sandbox_isolation.py (namespaces, the read-only root, limits).
One call flows like this:

    await SandboxPool.run(code, stdin)                 parent process, asyncio, any event loop
      -> queue -> handler thread i (one per worker)    blocking pipe I/O in threads, so the pool is bound to no loop
      -> length-prefixed JSON -> worker i              a long-lived `python -I sandbox_worker.py`, one per core:
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

Every call is bounded in every mode (see sandbox_isolation.call_limits()): its processes by a cgroup's pids.max
where cgroups are writable, else by RLIMIT_NPROC where the kernel counts it for the sandbox alone (a uid of its
own, or a user namespace), else by RLIMIT_NPROC set to what the user already runs plus max_processes; and by
pid_max in its PID namespace (300 + max_processes + 3, Linux 6.14+). Its memory by RLIMIT_AS per process and,
where cgroups are writable, by the worker's cgroup memory limit, which counts all its processes together with its
/tmp (a tmpfs) and memfds. Every call has oom_score_adj 1000 (its workers 500): when memory runs out anywhere, the
kernel kills a call first, before the trainer. docs/sandbox.md has the table and the measured bombs.

The tool's state across a trajectory's calls (tool_state; pool.session(tool_state) gives a trajectory its tool):
stateless (the paper's, the default: the pool itself), replay (ReplaySession: earlier successful calls rerun in
each call's fork) or persistent (PersistentSession: a live session in the worker, sandbox_state.py; each call a
fork of the last good state, a failed call rolled back). docs/sandbox.md, "Persistence and rollback".

Run `python sandbox.py` for a small demonstration.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import sandbox_worker
from sandbox_isolation import ISOLATION_MODES, required_isolation_missing
from sandbox_isolation import TMP_STASH, process_limit, sandbox_uid  # noqa: F401 - read as sandbox.X by tests
from sandbox_worker import SANDBOX_ENV, read_message, send_message

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crashed", "rejected")
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
    rolled_back: bool = False  # a stateful session's call whose effects were undone (tool_state replay/persistent)


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
    sandbox_uid: int = 990_000  # base of the uids/gids code runs as (sandbox_isolation.sandbox_uid; no passwd)
    recycle_after: int = 5000  # calls after which a worker is replaced by a fresh one (started in the background)
    startup_timeout_s: float = 120.0  # a worker must import its preloads within this
    # "auto": namespaces (as root with a uid of their own, else in a user namespace) or refuse to start;
    # "none": accept no namespaces (warned, recorded); "userns": force the user-namespace mode (tests as root)
    isolation: str = field(default_factory=lambda: os.environ.get(ISOLATION_ENV, "auto"))
    cgroup: bool = True  # a cgroup (v2, else v1) with memory and pids limits per worker, where cgroups are writable
    preload: tuple[str, ...] = ("numpy", "sympy")
    # persistent Python sessions (tool_state="persistent", sandbox_state.py): at most this many live at once in
    # the pool (0: none; more are refused), each state at most session_memory_mb of memory of its own
    max_sessions: int = 0
    session_memory_mb: int = 128  # (a session after four sympy cells held 13 MB of its own: docs/sandbox.md)


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
    if result.rolled_back:
        parts.append(ROLLED_BACK)
    parts.append(f"execution time: {result.duration_s:.2f}s")
    return "\n".join(parts)


ROLLED_BACK = "state: rolled back (this call's effects on variables and files were undone)"


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
    launch: int = 0  # which start of the pool's workers this is: a persistent session lives in exactly one


class Inbox:
    """The handler threads' requests: any worker takes a stateless call; a persistent session's calls go to the
    worker that holds it. None (one per thread) tells a thread to stop."""

    def __init__(self, workers: int):
        self._ready = threading.Condition()
        self._shared: collections.deque = collections.deque()
        self._own = [collections.deque() for _ in range(workers)]

    def put(self, item, worker: int | None = None) -> None:
        with self._ready:
            (self._shared if worker is None else self._own[worker]).append(item)
            self._ready.notify_all()

    def get(self, worker: int):
        with self._ready:
            while not (self._own[worker] or self._shared):
                self._ready.wait()
            return (self._own[worker] or self._shared).popleft()


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
        self._launch_of: dict[int, int] = {}  # worker pid -> its launch number
        self._launches = 0
        self.stats = {"calls": 0, "restarts": 0, "recycled": 0, "huge_pages_mb": 0}
        self._queue = Inbox(self.workers)
        self._threads: list[threading.Thread] = []
        self._sessions: dict[str, list] = {}  # persistent session id -> [worker index, its launch (None: not yet)]
        self._session_ids = itertools.count()
        self._worker_pids: set[int] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._call_started: list[float | None] = [None] * self.workers  # worker index -> its call's start, or None

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
        self._queue = Inbox(self.workers)  # a fresh queue: nothing left over from an earlier start() / close()
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
        for index in range(len(self._threads)):
            self._queue.put(None, index)
        threads, self._threads = self._threads, []
        await asyncio.to_thread(lambda: [t.join() for t in threads])

    def calls_running(self, longer_than_s: float = 0.0) -> int:
        """How many workers have been running a call for more than longer_than_s seconds: the cores the sandbox
        holds now (a call's code runs on one core). The CPU engine decodes on the others (engines.py, cores_taken)."""
        now = time.monotonic()
        return sum(1 for t in list(self._call_started) if t is not None and now - t > longer_than_s)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(self._worker_pids)

    # -- calls

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None,
                  history: Sequence[tuple[str, str]] = (), session: str | None = None) -> ExecResult:
        """Run `code` with `stdin` in a fresh sandboxed process. `history` is for ReplaySession, `session` for
        PersistentSession (use pool.session(tool_state) for both)."""
        rejection = self._check_input(code, stdin, history)
        if rejection:
            return ExecResult("rejected", "", rejection, None, 0.0, rolled_back=session is not None)
        if not self._threads:
            raise RuntimeError("SandboxPool is not started: use `async with SandboxPool() as pool` or start()")
        request = {"code": code, "stdin": stdin, "timeout_s": float(timeout_s or self.config.timeout_s),
                   "history": [list(h) for h in history]}
        worker = None
        if session is not None:
            worker, refusal = self._place_session(session)
            if refusal:
                return ExecResult("rejected", "", refusal, None, 0.0, rolled_back=True)
            request["session"] = session
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((request, future), worker)
        return await asyncio.wrap_future(future)  # cancelling the await cancels a call that has not started

    def session(self, tool_state: str = "persistent"):
        """The tool of one trajectory: the pool itself (stateless), a ReplaySession or a PersistentSession. Every
        one has `await run(code, stdin, timeout_s)` and `await close()`."""
        if tool_state not in TOOL_STATES:
            raise ValueError(f"tool_state must be one of {', '.join(TOOL_STATES)}, not {tool_state!r}")
        return {"stateless": StatelessTool, "replay": ReplaySession, "persistent": PersistentSession}[tool_state](self)

    def _place_session(self, sid: str) -> tuple[int | None, str | None]:
        """(the worker holding persistent session `sid`, or None and why it is refused). A new session goes to
        the worker holding the fewest."""
        with self._lock:
            if sid in self._sessions:
                return self._sessions[sid][0], None
            if len(self._sessions) >= self.config.max_sessions:
                return None, (f"sandbox: refused: {len(self._sessions)} persistent Python sessions are live, the "
                              f"pool's limit (max_sessions={self.config.max_sessions}); the call was not run. "
                              "Raise max_sessions (memory allowing: session_memory_mb each) or run fewer "
                              "trajectories at once")
            held = [0] * self.workers
            for placed in self._sessions.values():
                held[placed[0]] += 1
            index = held.index(min(held))
            self._sessions[sid] = [index, None]
            return index, None

    async def _close_session(self, sid: str) -> None:
        with self._lock:
            placed = self._sessions.get(sid)
        if placed is None or not self._threads:
            with self._lock:
                self._sessions.pop(sid, None)
            return
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(({"session": sid, "op": "close"}, future), placed[0])
        try:
            await asyncio.wrap_future(future)
        finally:
            with self._lock:
                self._sessions.pop(sid, None)

    def _session_namespace(self, sid: str) -> int | None:
        with self._lock:
            placed = self._sessions.get(sid, [])
            return placed[2] if len(placed) > 2 else None

    def sessions_per_worker(self) -> int:
        return -(-self.config.max_sessions // self.workers)

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
            while (item := self._queue.get(index)) is not None:
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
                if "session" in request and not self._session_on(worker, request):
                    future.set_result(ExecResult("crashed", "", SESSION_LOST, None, 0.0, rolled_back=True))
                    continue
                self._call_started[index] = time.monotonic()
                try:
                    result, worker_ok = self._call(worker, request)
                except Exception as e:  # noqa: BLE001 - a bug of ours: the caller hears of it, the thread lives
                    result, worker_ok = ExecResult("crashed", "", f"sandbox internal error: {e!r}", None, 0.0), False
                finally:
                    self._call_started[index] = None
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
                if worker.calls >= self.config.recycle_after and spare is None and not self._sessions_on(index):
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
        deadline = time.monotonic() + request.get("timeout_s", 0.0) + 10.0  # the worker enforces the timeout; this is a
        try:  # safety net against a supervisor that hangs
            send_message(worker.proc.stdin.fileno(), request)
            answer = read_message(worker.proc.stdout.fileno(), deadline)
        except TimeoutError:
            return ExecResult("timeout", "", "sandbox worker stopped responding and was replaced", None,
                              request.get("timeout_s", 0.0)), False
        except OSError:  # broken pipe: the worker is gone
            answer = None
        if answer is None:
            with self._lock:
                if request.get("session") in self._sessions:
                    self._sessions[request["session"]][1] = None  # it died with the worker: its next call starts anew
            lost = "; " + SESSION_LOST if "session" in request else ""
            return ExecResult("crashed", "", "sandbox worker died and was replaced" + lost, None, 0.0,
                              rolled_back="session" in request), False
        if "session" in request:
            namespace = answer.pop("namespace", None)
            with self._lock:
                placed = self._sessions.get(request["session"])
                if placed is not None:
                    placed[2:] = [namespace]
                    if answer.pop("session_lost", False) or answer.pop("closed", False):
                        placed[1] = None  # the next call starts a new session
            if "status" not in answer:
                return ExecResult("ok", "", "", 0, 0.0), True
        return ExecResult(**answer), True

    def _session_on(self, worker: Worker, request: dict) -> bool:
        """Whether this worker holds the request's session (or may open it): False when the worker that held it
        has died since, and the session with it."""
        with self._lock:
            placed = self._sessions.get(request["session"])
            if placed is None:  # closed meanwhile, or a close request for a session that never ran
                return request.get("op") == "close" or False
            if placed[1] is None:
                placed[1] = worker.launch
            if placed[1] != worker.launch:
                placed[1] = None  # lost; its next call starts a new session on this worker
                return request.get("op") == "close"
            return True

    def _sessions_on(self, index: int) -> bool:
        with self._lock:
            return any(placed[0] == index for placed in self._sessions.values())

    def _launch(self, index: int) -> subprocess.Popen:
        # a live session holds two processes (its init and its state), and a third while a call commits
        session_tasks = 2 * self.sessions_per_worker() + 1 if self.config.max_sessions else 0
        config = {**asdict(self.config), "index": index, "parent_pid": os.getpid(), "session_tasks": session_tasks}
        cgroup, why = None, "switched off (cgroup=False)"
        with self._lock:
            self._launches += 1
            launch = self._launches
        if self.config.cgroup:
            name = f"{CGROUP_PREFIX}-{os.getpid()}-{index}-{launch}"
            # until the worker is ready: room for its start-up; then its own size + memory_mb (_await_ready)
            cgroup, why = make_worker_cgroup(name, (self.config.memory_mb + 1024) << 20,
                                             self.config.max_processes + 2 + session_tasks)
        config["cgroup_paths"], config["cgroup_absent"] = cgroup, why
        worker_script = os.path.abspath(sandbox_worker.__file__)
        proc = subprocess.Popen([sys.executable, "-I", "-B", worker_script, "--worker", json.dumps(config)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=SANDBOX_ENV, close_fds=True,
                                start_new_session=True)  # no terminal signals: the pool decides when workers end
        with self._lock:
            self._worker_pids.add(proc.pid)
            self._launch_of[proc.pid] = launch
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
        # the latest worker's (sandbox_worker.collapse_heap_into_huge_pages)
        self.stats["huge_pages_mb"] = hello["huge_pages_mb"]
        with self._lock:
            cgroup = self._cgroups.get(proc.pid)
        if cgroup:  # the worker's own memory is charged now: the calls get memory_mb on top of it (and the
            sessions = self.sessions_per_worker() * self.config.session_memory_mb if self.config.max_sessions else 0
            with open(cgroup["usage"]) as f:  # sessions it may hold, session_memory_mb each)
                write_file(cgroup["limit"], str(int(f.read()) + ((self.config.memory_mb + sessions) << 20)))
        with self._lock:
            launch = self._launch_of.get(proc.pid, 0)
        return Worker(proc, hello["isolation"], cgroup=cgroup, launch=launch)

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
            self._launch_of.pop(proc.pid, None)
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


# ---------------------------------------------------------------------------------------------------------------
# The tool's state across a trajectory's calls: tool_state = stateless (the paper's) | replay | persistent

TOOL_STATES = ("stateless", "replay", "persistent")
SESSION_LOST = ("the Python session's state was lost (the sandbox worker holding it died); the next call starts "
                "an empty session")


def sessions_that_fit(session_memory_mb: int = SandboxConfig.session_memory_mb, share: float = 0.5) -> int:
    """How many persistent sessions of at most session_memory_mb each fit in `share` of the memory available now
    (MemAvailable): the trainer's and eval.py's max_sessions, so that live sessions can never drive the machine
    into swap; past it, a new session is refused."""
    with open("/proc/meminfo") as f:
        available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return max(1, int(share * available_kb / 1024 / session_memory_mb))


class StatelessTool:
    """The paper's tool: every call a fresh process, nothing kept."""

    def __init__(self, pool: SandboxPool):
        self.pool = pool

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        return await self.pool.run(code, stdin, timeout_s)

    async def close(self) -> None:
        pass


class ReplaySession(StatelessTool):
    """tool_state="replay": later calls see the variables of earlier successful ones. As the released recipe's
    SimJupyterTool does, every call replays the session's earlier successful calls (their output thrown away) in
    its own fresh fork before running the new code: a failed call rolls back by construction and no process is
    held between turns. The price: replay time grows with the history and counts toward the call's timeout, and
    replayed code that draws random numbers or writes files does it again, differently."""

    def __init__(self, pool: SandboxPool):
        super().__init__(pool)
        self.history: list[tuple[str, str]] = []  # (code, stdin) of every successful call so far

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        result = await self.pool.run(code, stdin, timeout_s, history=self.history)
        if result.status == "ok":
            self.history.append((code, stdin))
        elif result.status != "rejected" or self.history:
            result = replace(result, rolled_back=True)
        return result


SandboxSession = ReplaySession  # its earlier name


class PersistentSession(StatelessTool):
    """tool_state="persistent": a process that holds the session's interpreter state between calls, inside the
    worker's isolation, in PID and mount namespaces of its own (sandbox_state.py). Each call runs in a fork of
    the last good state and becomes the state only if it succeeds; otherwise the session is exactly as before
    (its files and open files' positions restored) and the result says rolled_back. No replay: a call's cost does
    not grow with the history. Close it (or close the pool) to end its processes."""

    def __init__(self, pool: SandboxPool):
        super().__init__(pool)
        self.id = f"s{os.getpid()}-{next(pool._session_ids)}"
        self.namespace: int | None = None  # inode of its PID namespace, once it runs (tests count its processes)

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        result = await self.pool.run(code, stdin, timeout_s, session=self.id)
        if self.namespace is None and result.status != "rejected":
            self.namespace = self.pool._session_namespace(self.id)
        return result

    async def close(self) -> None:
        await self.pool._close_session(self.id)
        self.namespace = None

    async def __aenter__(self) -> PersistentSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ---------------------------------------------------------------------------------------------------------------
# Entry point: a small demonstration


async def demo() -> None:
    async with SandboxPool() as pool:
        print("isolation:", pool.isolation)
        for code in ["import sympy\nsympy.factorint(2**64 - 1)", "while True: pass", "1/0",
                     "import socket; socket.create_connection(('127.0.0.1', 22))"]:
            result = await pool.run(code, timeout_s=2)
            print(f"--- {code!r}\n{format_tool_response(result)}")


if __name__ == "__main__":
    asyncio.run(demo())
