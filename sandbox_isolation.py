"""The sandbox's walls: namespaces, a read-only root and per-call limits (arXiv 2508.20722, section 3.1, the code
environment).

sandbox.py's pool starts workers (sandbox_worker.py); this module is what a worker uses to shut a call in. It imports
nothing of the project, so that a worker started as `python -I sandbox_worker.py` needs no more than this file beside
it. Data flows one way, all of it in the worker's own processes:

    W  set_up_isolation(mode)        new mount/net/ipc/uts namespaces (as root, or in a new user namespace),
                                     build_sandbox_root(): a tmpfs with read-only binds of the interpreter and the
                                     system libraries, then a new PID namespace    -> iso, a dict of what is in place
    Z  enter_sandbox_root()          PID 1 of that namespace: /proc, pivot_root onto the tmpfs, remount read-only;
       remap_interpreter(...)        interpreter paths under /tmp now point at their binds under TMP_STASH
                                     (a link there: at its target);
       limit_pid_namespace(n)        pid_max of the namespace bounds a call's processes (Linux 6.14+)
    C  set_limits(config, iso)       rlimits and oom_score_adj 1000, set while still privileged;
       drop_privileges(uid, kind)    a uid of the worker's own (as root), or no capabilities (user namespace)

    iso -> missing_isolation(iso), call_limits(config, iso) -> the worker's hello -> SandboxPool.isolation, which
    refuses to start on required_isolation_missing(iso) unless isolation="none" was accepted.

docs/sandbox.md has the table of what bounds a call in each mode.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import resource
import signal
import socket
import sys

ISOLATION_MODES = ("auto", "none", "userns")


# ---------------------------------------------------------------------------------------------------------------
# Linux plumbing: namespaces, mounts and capabilities through libc (Python 3.11 has no os.unshare)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
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
    paths += [os.path.realpath(p) for p in paths]  # a link's target too (a .venv linked into a checkout)
    chosen: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths if os.path.lexists(p)}, key=len):
        if not any(path == c or path.startswith(c + "/") for c in chosen):  # already inside a chosen tree
            chosen.append(path)
    return chosen


def interpreter_paths_in_tmp() -> dict[str, str]:
    """Interpreter paths under /tmp (a clone or virtual environment there), each with where the sandbox shows it.
    Each call's /tmp is a fresh, empty tmpfs, and binding them into it would show them in the call's working
    directory: a directory is bound under TMP_STASH instead; a link is followed to its target (bound by
    paths_the_interpreter_needs where it really is); the worker's Python looks for them there (remap_interpreter)."""
    def seen_at(path):
        return TMP_STASH + path if path.startswith("/tmp/") else path

    return {p: seen_at(os.path.realpath(p) if os.path.islink(p) else p)
            for p in paths_the_interpreter_needs() if p.startswith("/tmp/")}


def remap_interpreter(in_tmp: dict[str, str]) -> None:
    """Z, after the pivot: every path of the interpreter under /tmp (sys.path, the prefixes, sys.executable, the
    search paths and files of modules already imported) now points where the sandbox shows it (its bind under
    TMP_STASH, or a link's target), before the preloads are imported. A subprocess of sys.executable finds its
    pyvenv.cfg there too; what it cannot follow is a .pth file or a pyvenv.cfg `home` that names a /tmp path,
    which stays hidden behind the call's /tmp."""
    prefixes = sorted(in_tmp, key=len, reverse=True)

    def moved(path):
        if isinstance(path, str):
            for prefix in prefixes:
                if path == prefix or path.startswith(prefix + "/"):
                    return in_tmp[prefix] + path[len(prefix):]
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


def build_sandbox_root() -> dict[str, str]:
    """A tmpfs that will become '/': read-only binds of the interpreter and system libraries, a few devices.
    Returns the interpreter paths under /tmp and where the sandbox shows each (see remap_interpreter).

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
    for path, seen in in_tmp.items():
        if seen == TMP_STASH + path:
            bind_readonly(os.path.realpath(path), NEW_ROOT + seen)
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
# Limits of one call (set in C before its code arrives) and of the worker's PID namespace (set in Z)


def process_limit(config: dict, iso: dict) -> int | None:
    """RLIMIT_NPROC for a call, or None where it cannot bound one. The kernel counts processes and threads per
    user, and since Linux 5.14 per user namespace; it exempts uid 0 (the host's root) altogether."""
    n = config["max_processes"] + config.get("extra_tasks", 0)  # a persistent session's: + its fellow sessions'
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


def processes_in_namespace(inode: int) -> list[int]:
    """Seen from the host: every process whose PID namespace is `inode` (a persistent session's; counted by the
    tests and bench/bench_sandbox.py to show that a session leaves nothing behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino == inode:
                found.append(int(pid))
        except OSError:
            pass
    return found
