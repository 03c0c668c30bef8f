"""A sandbox worker: the warm process that runs model-written code, one fresh fork per call (arXiv 2508.20722,
section 3.1, the code environment).

sandbox.py's SandboxPool starts one per core as `python -I -B sandbox_worker.py --worker CONFIG` and talks to it
in length-prefixed JSON over its stdin and stdout (send_message / read_message, used by both sides). Inside:

    worker_main(config)    W: joins the cgroup the pool made, isolates itself (sandbox_isolation.py), forks Z
                           Z: PID 1 of the new PID namespace: pivots into the sandbox root, imports the preloads,
                              moves its heap onto 2 MB pages, says {"ready": ..., "isolation": ...}, then serve()
    serve()                Z: fork_call() -> C waits for its code; read a request; supervise_call(); reply; repeat
    child_main()           C: limits, its own /tmp, an unprivileged uid, then runs the code as a notebook cell and
                              writes the exception's name on fd 3
    supervise_call()       Z: drains C's stdout/stderr (HeadTail), enforces the timeout and the output cap, kills
                              every process of the call, classify() -> {"status", "stdout", "stderr", ...}

A request naming a persistent session (tool_state="persistent") goes to serve_session() and sandbox_state.py
instead; the fork waiting for the next stateless call keeps waiting.

The reply becomes an ExecResult in the pool's handler thread (sandbox.py). This module imports only the standard
library and sandbox_isolation.py, never sandbox.py: a worker needs neither asyncio nor the pool.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import gc
import io
import json
import linecache
import math
import os
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass
from typing import Sequence

if __name__ == "__main__":  # `python -I` leaves this file's folder off sys.path: on it for one import, then off
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (every sys.path entry is bound into the root)
    sys.modules["sandbox_worker"] = sys.modules[__name__]  # sandbox_state imports this module by its name
from sandbox_isolation import (MS_NODEV, MS_NOSUID, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, call_limits,
                               drop_privileges, enter_sandbox_root, libc, limit_cpu_time, limit_pid_namespace,
                               missing_isolation, mount, prctl, remap_interpreter, sandbox_uid, set_limits,
                               set_oom_score_adj, set_up_isolation, umount)
import sandbox_state  # noqa: E402 - persistent sessions (tool_state="persistent")
if __name__ == "__main__":
    del sys.path[0]

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

# Imported by every worker besides `preload`: what model-written math code reaches for first, and the standard
# library's process, thread-pool and event-loop modules. Each one missing from the warm worker would be imported
# again by every call that uses it (numpy.random alone costs ~17 ms a call); and a call that runs as a dropped uid
# with isolation="none" may not be able to read the interpreter's files to import them at all.
WARM_IMPORTS = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq", "bisect",
                "re", "random", "statistics", "string", "json", "subprocess", "queue", "warnings", "asyncio",
                "concurrent.futures", "numpy.random", "numpy.linalg", "numpy.fft", "numpy.polynomial",
                "sympy.ntheory", "sympy.solvers")
USER_FILENAME = "<string>"  # what tracebacks call the model's code, as `python -c` does
RESULT_FD = 3  # the call's result channel (stdout and stderr are 1 and 2, so printed text cannot reach it)


# ---------------------------------------------------------------------------------------------------------------
# Message framing between the pool and its workers: 4-byte big-endian length, then UTF-8 JSON


def send_message(fd: int, message: dict) -> None:
    data = json.dumps(message).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes from fd, or None at EOF; raises TimeoutError when nothing has come by the deadline (monotonic
    clock). What is already waiting is read even past the deadline: a reader that was not scheduled for a while
    (a laptop's suspend, a busy host) must not take a finished call for a hung one."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = max(deadline - time.monotonic(), 0.0)
            if not select.select([fd], [], [], remaining)[0]:
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
    """tool_state="replay" only: rerun the session's earlier successful cells, their output thrown away (and the
    streams they closed open again: fds 1 and 2 are put back after the replay)."""
    streams, fds = (sys.stdin, sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
    for code, stdin in history:
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), io.StringIO(), io.StringIO()
        run_cell(code, main)
    sys.stdin, sys.stdout, sys.stderr = streams
    for target, fd in enumerate(fds, start=1):
        os.dup2(fd, target)
        os.close(fd)


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


def read_ready(fd: int, streams: dict) -> None:
    """One read of a pipe select() found ready into its HeadTail; at end of file the pipe is closed and dropped."""
    chunk = os.read(fd, 1 << 16)
    if chunk:
        streams[fd].feed(chunk)
    else:
        os.close(fd)
        del streams[fd]


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


def kill_everything_but_me(call: Call, iso: dict, keep: frozenset = frozenset()) -> None:
    """SIGKILL the call and every process it started (daemons and setsid children included). `keep`: the inits
    of live persistent sessions (sandbox_state.py), children of ours that must live on: then the namespace-wide
    kill is out, and the call's processes are found as where there is no PID namespace."""
    if iso["pid_namespace"] and not keep:
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
        others = [child for child in children_of(os.getpid()) if child != call.pid and child not in keep]
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


def supervise_call(call: Call, request: dict, config: dict, iso: dict, keep: frozenset = frozenset()) -> dict:
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
                read_ready(fd, streams)
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
    kill_everything_but_me(call, iso, keep)
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


def finish_call(call: Call, iso: dict, sessions: bool = False) -> None:
    """After the reply has gone: reap the call and everything it left (all already SIGKILLed)."""
    if not call.reaped:
        os.waitpid(call.pid, 0)
    os.close(call.pidfd)
    # everything left is SIGKILLed: until reaped, it still counts toward RLIMIT_NPROC / pids (with live sessions
    # their inits are our children too, and the call's processes were reaped one by one)
    reap_all(block=not sessions)


def serve(config: dict, iso: dict) -> None:
    """Z's main loop: fork the next call, wait for a request, supervise, reply, clean up; until stdin closes."""
    scratch_root = None if iso["filesystem"] else tempfile.mkdtemp(prefix="rstar2-sandbox-")
    if scratch_root:
        os.chmod(scratch_root, 0o711)  # the dropped uid may pass through to its scratch directory (TMPDIR)
    sessions: dict[str, sandbox_state.Session] = {}  # persistent sessions living in this worker, by id
    try:
        while True:
            call = fork_call(config, iso, scratch_root)
            while (request := read_message(0)) is not None and "session" in request:  # the fork keeps waiting
                send_message(1, serve_session(sessions, request, config, iso))
            keep = frozenset(s.init_pid for s in sessions.values())
            if request is None:
                kill_everything_but_me(call, iso, keep)
                return
            try:
                response = supervise_call(call, request, config, iso, keep)
            except Exception as e:  # noqa: BLE001 - the supervisor failing is reported, not fatal
                kill_everything_but_me(call, iso, keep)
                response = {"status": "crashed", "stdout": "", "stderr": f"sandbox internal error: {e!r}",
                            "exit_code": None, "duration_s": 0.0}
            send_message(1, response)
            finish_call(call, iso, sessions=bool(keep))
    finally:
        if scratch_root:
            shutil.rmtree(scratch_root, ignore_errors=True)


def serve_session(sessions: dict, request: dict, config: dict, iso: dict) -> dict:
    """Z: a request for a persistent session (sandbox_state.py): open it on its first call, run a call, close it."""
    sid = request["session"]
    if request.get("op") == "close":
        sandbox_state.close_session(sessions.pop(sid, None))
        return {"closed": True}
    failure = {"stdout": "", "exit_code": None, "duration_s": 0.0, "rolled_back": True, "session_lost": True}
    if sid not in sessions:
        missing = sandbox_state.requirements_missing(iso)
        if missing:
            return {**failure, "status": "rejected", "stderr": missing}
        try:
            sessions[sid] = sandbox_state.open_session(config, iso)
        except Exception as e:  # noqa: BLE001
            return {**failure, "status": "crashed", "stderr": f"sandbox: the Python session could not start: {e}"}
    try:
        reply = sandbox_state.session_call(sessions[sid], request, config, iso)
    except Exception as e:  # noqa: BLE001 - the supervisor failing is reported, not fatal; the session ends
        reply = {**failure, "status": "crashed", "stderr": f"sandbox internal error: {e!r}"}
    if reply["session_lost"]:
        sandbox_state.close_session(sessions.pop(sid, None))
    reap_all(block=False)
    return reply


# ---------------------------------------------------------------------------------------------------------------
# Worker start-up (W, then Z): join the cgroup, isolate, preload, move the heap onto huge pages, serve

MADV_HUGEPAGE, MADV_COLLAPSE, HUGE_PAGE = 14, 25, 2 << 20  # MADV_COLLAPSE: Linux 6.1+


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


def worker_main(config: dict) -> None:
    """Entry point of a worker process (`python -I sandbox_worker.py --worker CONFIG`)."""
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
        remap_interpreter(iso.get("interpreter_in_tmp", {}))
    iso["pid_max"] = (limit_pid_namespace(config["max_processes"] + config.get("session_tasks", 0))
                      if iso["pid_namespace"] else None)
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


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("sandbox_worker.py is started by sandbox.SandboxPool; `python sandbox.py` shows a demonstration")
    worker_main(json.loads(sys.argv[2]))
