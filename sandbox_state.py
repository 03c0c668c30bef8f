"""Persistent Python sessions inside a sandbox worker: tool_state="persistent" (docs/sandbox.md, "Persistence and
rollback"). The paper's tool is stateless (arXiv 2508.20722, section 3.1); this is the option for a model that
keeps its variables across turns, without replaying earlier calls.

One session is a small process tree inside a worker (sandbox_worker.py), shut in like every call:

    Z  open_session()       unshare(CLONE_NEWPID), fork S, setns back: S is PID 1 of the session's own namespace
    S  session_init()       its own mount namespace: a fresh tmpfs on /tmp (the session's files), its own /proc;
                            forks the first state, then only reaps (a PID namespace's init)
    P  state_main()         limits, the sandbox uid, an empty __main__: the session's *last good state*. Waits for
                            calls on the control socket (Z holds the other end); never runs code itself
    C  call_main()          per call, a fork of P: runs the cell in the state's __main__, forks P' (a copy of the
                            finished call, its own threads left behind), exits with the cell's exit code
    P' become_state()       waits for the verdict: on "commit" it takes the control socket over, kills P and
                            everything else of the call (kill(-1) reaches exactly the session's namespace), and
                            is the new state

Z decides the verdict from what code cannot forge (C's wait status, read by P; Z's own timer and output cap; the
cgroup's OOM count), exactly as for a stateless call (sandbox_worker.classify). Anything but "ok" rolls back: P
kills every process of the call, restores the session's files (contents, modes, the names in /tmp) and the
positions of its open files from the snapshot it took before forking C. The state's memory was never touched:
C wrote only to its own copy-on-write pages.

What a rollback does not restore: memory shared with a failed call on purpose (an mmap(MAP_SHARED) or
multiprocessing.shared_memory block made by an earlier call). What the call cannot reach: other sessions (their
own PID and mount namespaces), the worker, the host (the worker's namespaces, read-only root, uid, limits).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import select
import shutil
import signal
import socket
import stat
import sys
import time
import types
from dataclasses import dataclass

import sandbox_worker as w  # (circular: read at call time only; the worker's __main__ is aliased to this name)
from sandbox_isolation import (CLONE_NEWNS, CLONE_NEWPID, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_REC,
                               PR_SET_PDEATHSIG, check, drop_privileges, libc, mount, prctl, sandbox_uid,
                               set_limits, umount, unshare)

PR_SET_DUMPABLE = 4
CONTROL_FD = 3  # in S and P: the session's end of the control socket
ANSWER_S = 4.0  # what a session may take to commit or roll back before it is declared lost (well inside the
# pool's own safety net, timeout + 10 s, so that a stopped session never makes its worker look hung)
NOT_KEPT = ("the call's state could not be kept (no new state process: the call ended its own process or used "
            "every process slot), so its effects were rolled back")
STATE: dict = {}  # in P: "main" (the session's __main__ module), "private_mb" (its own memory)


@dataclass
class Session:
    """Z's handle on one session."""

    init_pid: int  # S, in the worker's PID namespace
    control: socket.socket
    namespace: int  # inode of the session's PID namespace (tests count its processes from the host)


# ---------------------------------------------------------------------------------------------------------------
# Z: open, call, close


def requirements_missing(iso: dict) -> str | None:
    if not (iso["pid_namespace"] and iso["filesystem"]):
        return ("persistent Python sessions need the sandbox's PID namespace and private file system view "
                "(isolation 'auto'); this worker has isolation "
                f"{iso['mode']!r} without them: use tool_state=stateless or replay")
    return None


def open_session(config: dict, iso: dict) -> Session:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    own_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
    try:
        unshare(CLONE_NEWPID)  # Z's next child is PID 1 of a new namespace ...
        gc.freeze()  # (the session's processes must not copy Z's heap when their garbage collector scans it)
        pid = os.fork()
        if pid == 0:
            ours.close()
            session_init(config, iso, theirs)
        check(libc.setns(ctypes.c_int(own_namespace), ctypes.c_int(CLONE_NEWPID)), "setns")  # ... and only it
    finally:
        os.close(own_namespace)
    theirs.close()
    session = Session(pid, ours, os.stat(f"/proc/{pid}/ns/pid").st_ino)
    hello = receive(ours, time.monotonic() + ANSWER_S)
    if not hello or not hello.get("ready"):
        close_session(session)
        raise RuntimeError(f"the session did not start: {hello}")
    return session


def close_session(session: Session | None) -> None:
    """SIGKILL to a PID namespace's init takes every process of the namespace with it."""
    if session is None:
        return
    try:
        os.kill(session.init_pid, signal.SIGKILL)
        os.waitpid(session.init_pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    session.control.close()


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def receive(sock: socket.socket, deadline: float | None = None) -> dict | None:
    """One message, or None at EOF or past the deadline."""
    if deadline is not None and not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
        return None
    try:
        data = sock.recv(1 << 16)
    except OSError:
        return None
    return json.loads(data) if data else None


def session_call(session: Session, request: dict, config: dict, iso: dict) -> dict:
    """Z: one call of a session, supervised as sandbox_worker.supervise_call supervises a stateless one; then the
    verdict (commit or roll back) and the session's answer. The reply holds "rolled_back" and "session_lost"."""
    (req_r, req_w), (out_r, out_w), (err_r, err_w), (res_r, res_w) = os.pipe(), os.pipe(), os.pipe(), os.pipe()
    out, err, res = (w.HeadTail(config["max_output_chars"]), w.HeadTail(config["max_output_chars"]),
                     w.HeadTail(4096))
    streams = {out_r: out, err_r: err, res_r: res}
    oom_before = w.oom_kills(iso.get("oom_fd"))
    start = time.monotonic()
    deadline, reason, exited, lost = start + request["timeout_s"], None, None, False
    try:
        send(session.control, {"op": "call"}, [req_r, out_w, err_w, res_w])
    except OSError:
        lost = True
    for fd in (req_r, out_w, err_w, res_w):
        os.close(fd)
    try:
        w.send_message(req_w, {"code": request["code"], "stdin": request["stdin"], "timeout_s": request["timeout_s"]})
    except OSError:
        pass  # the call died before reading it; its status says why
    os.close(req_w)

    def pump(wait_s: float, control: bool) -> dict | None:
        ready = select.select([*streams, *([session.control] if control else [])], [], [], max(0.0, wait_s))[0]
        message = None
        for fd in ready:
            if fd is session.control:
                message = receive(session.control) or {"lost": True}
            else:
                w.read_ready(fd, streams)
        return message

    while exited is None and not lost:  # until the call's main process has exited, or time or output runs out
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        message = pump(remaining, control=True)
        if message is not None:
            lost = bool(message.get("lost"))
            exited = None if lost else message
        if out.total_bytes + err.total_bytes > config["hard_output_bytes"]:
            reason = "output_limit"
            break
    duration = time.monotonic() - start
    while streams and exited is not None and pump(0.0, control=False) is None and \
            select.select(list(streams), [], [], 0)[0]:
        pass  # what the call wrote before it exited (its report among it) is in the pipes already

    report = parse_report(res.text())
    oom_killed = w.oom_kills(iso.get("oom_fd")) > oom_before
    rusage = types.SimpleNamespace(ru_utime=(exited or {}).get("cpu", 0.0), ru_stime=0.0)
    if lost:
        state, exit_code = "crashed", None
    else:
        state, exit_code = w.classify(reason, report, (exited or {}).get("status", 0), rusage,
                                      int(request["timeout_s"]) + 2, oom_killed)
    answer = None
    if not lost:
        try:
            kept = state == "ok" and (report or {}).get("state_kept", False)
            send(session.control, {"op": "commit" if kept else "rollback"})
            answer = wait_for_answer(session.control)
            if state == "ok" and not kept and answer is not None:
                answer["refused"] = NOT_KEPT
        except OSError:
            pass
    lost = answer is None
    grace = time.monotonic() + 2.0  # every process of the call is gone now: read what is left in the pipes
    while streams and time.monotonic() < grace:
        pump(grace - time.monotonic(), control=False)
    for fd in streams:
        os.close(fd)
    if oom_killed and state != "memory" and not err.total_bytes:
        err.feed(b"the call's processes together reached the sandbox's memory limit\n")
    if answer and answer.get("refused"):
        if answer["refused"] != NOT_KEPT:  # past session_memory_mb
            state = "memory"
        err.feed(answer["refused"].encode() + b"\n")
    if lost:
        err.feed(b"the Python session's state was lost (its processes died); the next call starts an empty "
                 b"session\n")
    return {"status": state, "stdout": out.text(), "stderr": err.text(), "exit_code": exit_code,
            "duration_s": duration, "rolled_back": lost or not answer.get("committed"), "session_lost": lost,
            "namespace": session.namespace}


def parse_report(text: str) -> dict | None:
    lines = text.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def wait_for_answer(control: socket.socket) -> dict | None:
    deadline = time.monotonic() + ANSWER_S
    while True:
        message = receive(control, deadline)
        if message is None or "exited" not in message:  # (an exit that crossed our rollback is skipped)
            return message


# ---------------------------------------------------------------------------------------------------------------
# S: the session's init


def session_init(config: dict, iso: dict, control: socket.socket) -> None:
    """PID 1 of the session's namespace. Never returns."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the worker goes -> so does the session
        os.dup2(control.detach(), CONTROL_FD)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # never the worker's pipes to the pool
            os.dup2(null, fd)
        os.closerange(CONTROL_FD + 1, 1 << 16)
        unshare(CLONE_NEWNS)  # the session's own /tmp and /proc
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        try:
            umount("/tmp")
        except OSError:
            pass
        uid = 0 if iso["kind"] == "userns" else sandbox_uid(config)
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={config['scratch_mb']}m,nr_inodes=16384,mode=0700,uid={uid},gid={uid}")
        try:  # this namespace's processes only (on top of the worker's: a user namespace mounts proc only where
            # one is fully visible already); hidepid: the state sees its own uid's processes, not this init
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
        except OSError:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        if os.fork() == 0:
            state_main(config, iso)
        os.close(CONTROL_FD)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                os._exit(0)  # no state left: the session is over (Z sees its control socket close)
    except BaseException:  # noqa: BLE001
        report_failure()


# ---------------------------------------------------------------------------------------------------------------
# P: the session's last good state; C: one call; P': the state a successful call leaves


def state_main(config: dict, iso: dict) -> None:
    """The first state: an empty __main__ behind the sandbox's limits and uid. Never returns."""
    try:
        os.setsid()
        set_limits({**config, "extra_tasks": config["session_tasks"]}, iso)  # room for the worker's sessions' states
        os.chdir("/tmp")
        drop_privileges(sandbox_uid(config), iso["kind"])
        prctl(PR_SET_DUMPABLE, 0)  # no call may ptrace the state or open its /proc/PID/mem (a user namespace's
        sys.argv = ["-c"]  # one uid would allow it; a uid drop as root already clears it)
        sys.path.insert(0, "")
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))
        random.seed()
        STATE["main"] = w.fresh_main()
        STATE["bound_mb"] = config["session_memory_mb"]
        STATE["private_mb"] = private_memory_mb()
        control = socket.socket(fileno=CONTROL_FD)
        send(control, {"ready": True})
        serve_state(control)
    except BaseException:  # noqa: BLE001
        report_failure()


def report_failure() -> None:
    """The session's set-up failed: say why on the control socket (the worker's answer quotes it), then exit."""
    import traceback

    try:
        send(socket.socket(fileno=CONTROL_FD), {"ready": False, "error": traceback.format_exc()[-600:]})
    finally:
        os._exit(70)


def serve_state(control: socket.socket) -> None:
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except OSError:
            data = b""
        if not data:
            os._exit(0)  # the worker closed the session
        run_call(control, fds)


def run_call(control: socket.socket, fds: list[int]) -> None:
    """P: fork the call, report its exit, then commit (hand the control socket to P') or roll back."""
    files, positions = snapshot_files("/tmp"), file_positions()
    generator = random.getstate()  # the random module reseeds every fork's child: the call gets the state's own
    to_call, to_state = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    gc.freeze()  # as for a stateless call: the call's collector leaves the state's objects (and their pages) alone
    pid = fork_or_none()
    if pid == 0:
        to_call.close()
        call_main(fds, to_state, control, generator)
    if pid is None:  # every process slot taken (a fork bomb's remains not reaped yet): the call cannot start
        os.write(fds[2], b"sandbox: the call could not start: no process slot is free\n")
    for fd in fds:
        os.close(fd)
    to_state.close()
    if pid is None:
        send(control, {"exited": True, "status": 70 << 8, "cpu": 0.0})
        pid = 0
    pidfd = os.pidfd_open(pid) if pid else os.eventfd(0)
    verdict = None
    while verdict is None:
        ready = select.select([pidfd, control], [], [])[0]
        if pidfd in ready and pid:
            _, status, usage = os.wait4(pid, 0)
            pid = 0
            send(control, {"exited": True, "status": status, "cpu": usage.ru_utime + usage.ru_stime})
            ready = select.select([control], [], [])[0]
        if control in ready:
            verdict = receive(control) or {"op": "close"}
    os.close(pidfd)
    refused = None
    if verdict["op"] == "commit":
        try:  # P' takes over: it kills this process, so nothing below runs on success
            socket.send_fds(to_call, [json.dumps({"private_mb": STATE["private_mb"]}).encode()], [control.fileno()])
            answer = to_call.recv(1 << 12) if select.select([to_call], [], [], ANSWER_S / 4)[0] else b""
        except OSError:
            answer = b""
        if answer == b"ok":
            while True:
                signal.pause()
        refused = answer.decode() if answer else NOT_KEPT
    kill_the_rest()  # (the call's main process among them, reaped there)
    to_call.close()
    restore_files("/tmp", files)
    restore_positions(positions)
    if verdict["op"] == "close":
        os._exit(0)
    send(control, {"rolled_back": True, "committed": False, "refused": refused})


def call_main(fds: list[int], to_state: socket.socket, control: socket.socket, generator) -> None:
    """C: run one cell in the state's __main__, leave a copy of the result as P', exit. Never returns."""
    try:
        os.setsid()
        control.close()  # the call never holds the session's control socket
        for target, fd in enumerate(fds):  # 0 the request pipe (stdin later), 1 stdout, 2 stderr, 3 result channel
            os.dup2(fd, target, inheritable=target != w.RESULT_FD)
        for fd in fds:
            if fd > w.RESULT_FD:
                os.close(fd)
        random.setstate(generator)
        w.build_call_streams()  # new stream objects: an earlier call may have closed (and kept) the last ones
        w.connect_streams()
        request = w.read_message(0)
        if request is None:
            os._exit(0)
        limit_cpu_time_soft(request["timeout_s"])
        stdin = os.memfd_create("stdin")
        os.write(stdin, request["stdin"].encode())
        os.lseek(stdin, 0, os.SEEK_SET)
        os.dup2(stdin, 0)
        os.close(stdin)
    except BaseException:  # noqa: BLE001
        os.write(2, b"sandbox session set-up failed\n")
        os._exit(70)
    exit_code, exception = w.run_cell(request["code"], STATE["main"])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    kept = False
    if exit_code == 0:  # the candidate state: a fork of this finished call, its threads left behind
        generator = random.getstate()
        try:
            if os.fork() == 0:
                become_state(to_state, generator)
            kept = True
        except OSError:
            pass  # no process slot left (the call used them all): no new state, the call is rolled back
    try:
        os.write(w.RESULT_FD, json.dumps({"exit_code": exit_code, "exception": exception,
                                          "state_kept": kept}).encode() + b"\n")
    except OSError:
        pass
    os._exit(exit_code)


def become_state(to_state: socket.socket, generator) -> None:
    """P': wait for the verdict; on commit, check the state's size, take over, and serve. Never returns."""
    try:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # the call's pipes close: the worker sees EOF when the call exits
            os.dup2(null, fd)
        os.close(null)
        os.close(w.RESULT_FD)
        data, fds, _, _ = socket.recv_fds(to_state, 1 << 12, 1)
        if not data or not fds:
            os._exit(0)  # rolled back
        control = socket.socket(fileno=fds[0])
        grown = private_memory_mb()  # pages this state does not share with the last one
        bound = STATE.get("bound_mb", 0)
        size = json.loads(data)["private_mb"] + grown
        if bound and size > bound:
            to_state.send(f"the session's state would hold {size:.0f} MB, past its bound of {bound} MB "
                          "(session_memory_mb): the call's effects were rolled back".encode())
            os._exit(0)
        to_state.send(b"ok")
        try:  # the last state and the call's other processes: signalled now, waited for after the answer (the
            os.kill(-1, signal.SIGKILL)  # next call is read only then)
        except ProcessLookupError:
            pass
        send(control, {"committed": True})
        kill_the_rest()
        to_state.close()
        random.setstate(generator)
        STATE["private_mb"] = private_memory_mb()
        serve_state(control)
    except BaseException:  # noqa: BLE001
        os._exit(70)


def fork_or_none() -> int | None:
    """os.fork(), retried for up to a second while no process slot is free; None if none frees."""
    for _ in range(200):
        try:
            return os.fork()
        except BlockingIOError:
            time.sleep(0.005)
    return None


def limit_cpu_time_soft(timeout_s: float) -> None:
    """A backstop like sandbox_isolation.limit_cpu_time, soft only: a later call of the session may need more."""
    import resource

    seconds = int(timeout_s) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (seconds if hard == resource.RLIM_INFINITY else min(seconds, hard),
                                             hard))


def kill_the_rest() -> None:
    """SIGKILL every other process of the session (kill(-1) spares the caller and the namespace's init; a process
    being killed cannot fork), then wait until none of them runs. Only ever called inside a session namespace."""
    me = os.getpid()
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]:
            return  # (zombies included: until the init has reaped them they hold process slots)
        time.sleep(0.001)


def private_memory_mb() -> float:
    """This process's memory shared with no other (Private_Clean + Private_Dirty of smaps_rollup), in MB."""
    total = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1])
    except OSError:
        return 0.0
    return total / 1024


# ---------------------------------------------------------------------------------------------------------------
# The session's files: a snapshot before each call, restored in place after a failed one (same inodes, so the
# state's open files still name them), and the positions of its open files


def snapshot_files(root: str) -> dict[str, tuple]:
    """path -> ("d", mode) | ("f", mode, contents) | ("l", target), for everything under root."""
    mode = stat.S_IMODE(os.lstat(root).st_mode)
    tree = {root: ("d", mode)}
    os.chmod(root, mode | 0o700)
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                tree[path] = ("l", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                tree[path] = ("d", mode)
                if not mode & 0o500:
                    os.chmod(path, mode | 0o700)  # (walked below; restored after)
            elif stat.S_ISREG(info.st_mode):
                if not mode & 0o400:
                    os.chmod(path, mode | 0o600)
                with open(path, "rb") as f:
                    tree[path] = ("f", mode, f.read())
                os.chmod(path, mode)
    for path, entry in tree.items():
        if entry[0] == "d":
            os.chmod(path, entry[1])
    return tree


def restore_files(root: str, tree: dict[str, tuple]) -> None:
    """Make root hold exactly what `tree` holds: new names removed, changed files rewritten in place."""
    os.chmod(root, 0o700)
    for base, dirs, _ in os.walk(root):
        for name in dirs:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    now = set()
    for base, dirs, files in os.walk(root):
        now.update(os.path.join(base, n) for n in dirs + files)
    now.discard(root)
    for path in sorted(now, key=len, reverse=True):  # deepest first
        entry = tree.get(path)
        info = os.lstat(path)
        kind = "l" if stat.S_ISLNK(info.st_mode) else "d" if stat.S_ISDIR(info.st_mode) else "f"
        if entry is None or entry[0] != kind or kind == "l" and os.readlink(path) != entry[1]:
            if kind == "d":
                shutil.rmtree(path)
            else:
                os.unlink(path)
    for path, entry in sorted(tree.items(), key=lambda item: len(item[0])):  # parents first
        if entry[0] == "d":
            os.makedirs(path, exist_ok=True)
        elif entry[0] == "l":
            if not os.path.lexists(path):
                os.symlink(entry[1], path)
        else:
            if os.path.exists(path):
                os.chmod(path, 0o600)
                with open(path, "rb") as f:
                    same = f.read() == entry[2]
            else:
                same = False
            if not same:
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(entry[2])
            os.chmod(path, entry[1])
    for path, entry in sorted(tree.items(), key=lambda item: -len(item[0])):
        if entry[0] == "d":
            os.chmod(path, entry[1])


def file_positions() -> dict[int, int]:
    positions = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            positions[fd] = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:
            pass  # pipes, sockets: no position
    return positions


def restore_positions(positions: dict[int, int]) -> None:
    for fd, position in positions.items():
        try:
            os.lseek(fd, position, os.SEEK_SET)
        except OSError:
            pass
