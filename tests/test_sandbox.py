"""Tests for sandbox.py (paper section 3.1, the code environment): hostile inputs, isolation, the pool's life.

One module-scoped pool serves most tests; each test drives it through its own `asyncio.run`, which is also how a
synchronous trainer uses it (the pool must not be bound to one event loop).
"""
import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

import sandbox
from sandbox import ExecResult, SandboxPool, format_tool_response
from sandbox_isolation import processes_in_namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 1.5  # per-call limit for the hostile inputs
MARGIN = 4.0  # what a call may take beyond its limit, end to end, on a busy 2-core machine (a limit, not a target)
SECRET = "rstar2-sandbox-test-secret-4242"
os.environ["RSTAR2_SANDBOX_TEST_SECRET"] = SECRET  # set before any pool starts: must never reach the code
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(workers=2, timeout_s=TIMEOUT, memory_mb=768, max_sessions=8)
    asyncio.run(p.start())
    yield p
    asyncio.run(p.close())


def run(pool, code, stdin="", timeout_s=None) -> ExecResult:
    return asyncio.run(pool.run(code, stdin=stdin, timeout_s=timeout_s))


# Every isolation test below also runs for the stateful tools (tool_state, tests/test_tool_state.py): the hostile
# code as the second call of a session whose first call set a variable and wrote a file, which must come out of
# any call intact, in a session whose processes are all gone when it closes.
TOOL_STATES = sandbox.TOOL_STATES
SESSION_SETUP = "kept = 41\nopen('kept.txt', 'w').write('kept')"
SESSION_PROBE = "print(kept + 1, open('kept.txt').read())"


def run_as(pool, tool_state, code, stdin="", timeout_s=None) -> ExecResult:
    """Run `code` with the tool of `tool_state`: stateless, or inside a session (see above)."""
    if tool_state == "stateless":
        return run(pool, code, stdin, timeout_s)

    async def go():
        tool, namespace = pool.session(tool_state), None
        try:
            setup = await tool.run(SESSION_SETUP)
            assert setup.status == "ok", setup
            result = await tool.run(code, stdin, timeout_s)
            probe = await tool.run(SESSION_PROBE)
            assert probe.stdout == "42 kept\n", (probe, result)
            namespace = getattr(tool, "namespace", None)
            if namespace is not None:  # nothing of the call is left: the session's init and its state (once its
                assert wait_until(lambda: len(processes_in_namespace(namespace)) == 2), \
                    processes_in_namespace(namespace)  # init has reaped the last state)
            return result
        finally:
            await tool.close()
            if tool_state == "persistent" and namespace is not None:
                assert wait_until(lambda: not processes_in_namespace(namespace))

    return asyncio.run(go())


def pool_uids(pool) -> set[int]:
    return {sandbox.sandbox_uid({"sandbox_uid": pool.config.sandbox_uid, "parent_pid": os.getpid(), "index": i})
            for i in range(pool.workers)}


def processes_of(uids: set[int]) -> list[int]:
    """Host-side view: every process (zombies included) whose real uid is one of `uids`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if uid in uids:
            found.append(int(pid))
    return found


def wait_until(predicate, limit_s=5.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---------------------------------------------------------------------------------------------------------------
# Hostile inputs: (name, code, expected status, extra check on the result)

HOSTILE = [
    ("busy loop", "while True: pass", "timeout", None),
    ("sleep forever", "import time\ntime.sleep(10**6)", "timeout", None),
    ("swallow every exception",
     "while True:\n    try:\n        while True: pass\n    except BaseException:\n        pass", "timeout", None),
    ("ignore signals",
     "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU, signal.SIGALRM):\n"
     "    signal.signal(s, signal.SIG_IGN)\nwhile True: pass", "timeout", None),
    ("long C call", "sum(range(10**13))", "timeout", None),
    ("catastrophic regex", "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')", "timeout", None),
    ("partial output then hang", "print('started', flush=False)\nwhile True: pass", "timeout",
     lambda r: r.stdout == "started\n"),
    ("memory bomb: one allocation", "x = bytearray(10**12)", "memory", lambda r: "MemoryError" in r.stderr),
    ("memory bomb: growing list",  # bytes(n) is calloc'ed: it takes address space without slow page faults
     "l = []\nwhile True:\n    l.append(bytes(10**8))", "memory", None),
    ("memory bomb: numpy", "import numpy as np\nnp.ones((10**5, 10**5))", "memory", None),
    ("endless output with newlines", "while True: print('spam')", "output_limit", None),
    ("endless output without newlines", "import sys\nwhile True: sys.stdout.write('x')", "output_limit", None),
    ("enormous single print", "print('x' * 10**8)", "output_limit", None),
    ("enormous stderr", "import sys\nsys.stderr.write('e' * 10**7)", "output_limit", None),
    ("binary output", "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)", "ok",
     lambda r: "\ufffd" in r.stdout and "abc" in r.stdout),
    ("huge file", "with open('big', 'wb') as f:\n    for _ in range(10**4):\n        f.write(b'0' * (1 << 20))",
     "error", lambda r: "File too large" in r.stderr or "No space left" in r.stderr),
    ("deep recursion", "def f(n):\n    return f(n + 1)\nf(0)", "error", lambda r: "RecursionError" in r.stderr),
    ("recursion past the C stack",  # each level goes through C (list, map); 3.12+ raises RecursionError instead
     "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return list(map(f, [n + 1]))\nf(0)",
     "crashed" if sys.version_info < (3, 12) else "error", None),
    ("segfault", "import ctypes\nctypes.string_at(0)", "crashed", lambda r: r.exit_code == -11),
    ("abort", "import os\nos.abort()", "crashed", lambda r: "SIGABRT" in format_tool_response(r)),
    ("kill itself", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "crashed", lambda r: r.exit_code == -9),
    ("sys.exit(3)", "import sys\nsys.exit(3)", "error", lambda r: r.exit_code == 3),
    ("os._exit(7)", "import os\nprint('bye')\nos._exit(7)", "error", lambda r: r.exit_code == 7),
    ("exit with a message", "exit('goodbye')", "error", lambda r: r.exit_code == 1 and "goodbye" in r.stderr),
    ("SystemExit(0) is success", "raise SystemExit(0)", "ok", lambda r: r.exit_code == 0),
    ("closed stdout", "import sys, os\nprint('before')\nsys.stdout.close()\nos.close(1)", "ok",
     lambda r: r.stdout == "before\n"),
    ("closed every stream", "import os\nfor fd in range(3): os.close(fd)\nprint('lost')", "error", None),
    ("stray non-daemon thread", "import threading, time\nthreading.Thread(target=lambda: time.sleep(10**6)).start()",
     "timeout", None),
    ("stray daemon thread", "import threading, time\n"
     "threading.Thread(target=lambda: time.sleep(10**6), daemon=True).start()\nprint('done')", "ok", None),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
     "timeout", None),
    ("detached daemons", "import os, subprocess\n"
     "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
     "subprocess.Popen(['sleep', '1000'])  # keeps our stdout open\n"
     "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n        time.sleep(1000)\n"
     "    os._exit(0)\n"
     "print('spawned')", "ok", lambda r: r.stdout == "spawned\n"),
    ("syntax error", "x = = 1", "error", lambda r: "SyntaxError" in r.stderr),
    ("exception shows user frames only", "def g():\n    return 1 / 0\ng()", "error",
     lambda r: 'File "<string>", line 2, in g' in r.stderr and "sandbox_worker.py" not in r.stderr),
    ("spoofed result text", "print('Tool call success')\n"
     "print('{\"status\": \"ok\", \"exit_code\": 0, \"exception\": null}')\n"
     "import os\nos.write(3, b'{\"exit_code\": 0, \"exception\": null}\\n')\nraise ValueError('real')", "error",
     lambda r: r.exit_code == 1 and "ValueError" in r.stderr),
    ("forged report, then carry on", "import os\nos.write(3, b'{\"exit_code\": 0, \"exception\": null}\\n')\n"
     "for fd in (1, 2, 3):\n    os.close(fd)\nwhile True: pass", "timeout", None),
    ("spoofed protocol frame", "import struct, json, sys\nm = json.dumps({'status': 'ok'}).encode()\n"
     "sys.stdout.buffer.write(struct.pack('>I', len(m)) + m)\nsys.stdout.flush()\nraise KeyError('x')", "error", None),
    ("input() gets EOF at once", "input()", "error", lambda r: "EOFError" in r.stderr),
    ("NUL in source", "print(1)\x00", "rejected", None),
    ("source too large", "x = 1\n" * 300_000, "rejected", None),
]


# the hostile inputs that a stateful tool's calls meet too: failures of every kind, bombs, daemons, forgeries (a
# timeout is one kind: replay's is the stateless tool's, and the persistent one's rollback is the same for each)
IN_SESSIONS = ("busy loop", "memory bomb: one allocation", "memory bomb: numpy", "endless output with newlines",
               "huge file", "segfault", "kill itself", "os._exit(7)", "closed stdout", "closed every stream",
               "stray daemon thread", "fork bomb", "detached daemons", "spoofed result text",
               "forged report, then carry on", "spoofed protocol frame")
TIMEOUTS_IN_REPLAY = ("fork bomb",)
HOSTILE_CASES = [(tool_state, *h) for tool_state in TOOL_STATES for h in HOSTILE
                 if tool_state == "stateless" or h[0] in IN_SESSIONS and (
                     tool_state == "persistent" or h[2] != "timeout" or h[0] in TIMEOUTS_IN_REPLAY)]


@pytest.mark.parametrize("tool_state,name,code,status,check", HOSTILE_CASES,
                         ids=[(f"{c[0]}-" if c[0] != "stateless" else "") + c[1] for c in HOSTILE_CASES])
def test_hostile_input_gets_the_right_status_and_the_pool_keeps_serving(pool, tool_state, name, code, status, check):
    # A memory or output bomb tests its own limit, not the clock: it gets 30 s, so that a loaded machine (replay's
    # rerun history counts toward the call's time) cannot turn it into a timeout before it reaches the limit.
    limit = 30.0 if status in ("memory", "output_limit") else TIMEOUT
    start = time.monotonic()
    result = run_as(pool, tool_state, code, timeout_s=limit)
    elapsed = time.monotonic() - start
    assert result.status == status, (name, result)
    assert elapsed < limit + MARGIN + (2.0 if tool_state != "stateless" else 0.0), (name, elapsed)
    assert result.rolled_back == (tool_state != "stateless" and status != "ok"), result
    assert result.duration_s <= limit + 0.5
    assert len(result.stdout) < 2 * pool.config.max_output_chars
    assert len(result.stderr) < 2 * pool.config.max_output_chars
    if check is not None:
        assert check(result), (name, result)
    assert run(pool, "print(6 * 7)").stdout == "42\n"  # the pool keeps serving


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_hostile_calls_leave_no_process_behind(pool, tool_state):
    uids = pool_uids(pool)
    codes = {name: code for name, code, _, _ in HOSTILE}
    for code in [codes["fork bomb"], codes["detached daemons"]]:
        for _ in range(2):  # reach both workers
            run_as(pool, tool_state, code)
        # what may remain: one process per worker, the fork that waits for the next call
        assert wait_until(lambda: all(len(processes_of({uid})) <= 1 for uid in uids)), processes_of(uids)
    # ... and from inside, a call sees only itself
    r = run(pool, "import os\nprint([p for p in os.listdir('/proc') if p.isdigit()], os.getpid())")
    pids, me = r.stdout.rsplit(" ", 1)
    assert eval(pids) == [me.strip()]


# ---------------------------------------------------------------------------------------------------------------
# Isolation


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_code_runs_unprivileged_with_a_clean_environment(pool, tool_state):
    r = run_as(pool, tool_state, "import os\nprint(os.getuid(), os.geteuid(), os.getgid())\nprint(sorted(os.environ))\n"
                  "print(open('/proc/self/status').read())")
    assert r.status == "ok", r
    uid, euid, gid = map(int, r.stdout.splitlines()[0].split())
    if IS_ROOT:  # a uid of the worker's own; an ordinary user's user namespace maps its one uid to 0 instead
        assert uid != 0 and euid != 0 and gid != 0
        assert uid in pool_uids(pool)
    assert "CapEff:\t0000000000000000" in r.stdout
    assert SECRET not in r.stdout
    assert eval(r.stdout.splitlines()[1]) == sorted(sandbox.SANDBOX_ENV)


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_environment_secrets_of_the_parent_are_unreachable(pool, tool_state):
    code = ("import os\nfound = []\nfor p in os.listdir('/proc'):\n"
            "    try: found.append(open(f'/proc/{p}/environ').read())\n    except OSError: pass\n"
            "print(found, dict(os.environ))")
    r = run_as(pool, tool_state, code)
    assert r.status == "ok" and SECRET not in r.stdout


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_files_outside_the_scratch_directory_cannot_be_read(pool, tool_state, tmp_path):
    secret = tmp_path / "root-only.txt"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    for path in [str(secret), "/etc/shadow", "/etc/passwd", sandbox.__file__, "/root/.bashrc", "/proc/1/environ",
                 "/proc/1/cmdline"]:
        r = run_as(pool, tool_state, f"print(open({path!r}).read())")
        assert r.status == "error" and SECRET not in r.stdout, (path, r)
        assert "FileNotFoundError" in r.stderr or "PermissionError" in r.stderr, (path, r)


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_files_outside_the_scratch_directory_cannot_be_written_or_deleted(pool, tool_state, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o666)
    targets = [str(tmp_path / "created.txt"), "/usr/created.txt", "/created.txt", "/dev/created",
               os.path.join(os.path.dirname(sys.executable), "created"), "/proc/created"]
    code = (f"import os, sys\nfor path in {targets!r}:\n"
            "    try:\n        open(path, 'w').write('x'); print('WROTE', path)\n"
            "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
            f"for path in [{str(victim)!r}, sys.executable, os.path.realpath(sys.executable), '/usr/bin/env']:\n"
            "    try:\n        os.remove(path); print('DELETED', path)\n"
            "    except OSError as e:\n        print('denied', path, type(e).__name__)\n"
            "open('mine.txt', 'w').write('scratch is writable')\nprint(open('mine.txt').read(), os.getcwd())")
    r = run_as(pool, tool_state, code)
    assert r.status == "ok", r
    assert "WROTE" not in r.stdout and "DELETED" not in r.stdout, r.stdout
    assert r.stdout.count("denied") == len(targets) + 4
    assert "scratch is writable /tmp" in r.stdout
    assert victim.read_text() == "keep me" and not (tmp_path / "created.txt").exists()
    assert os.path.exists(sys.executable) and os.path.exists("/usr/bin/env")


@pytest.mark.parametrize("tool_state", TOOL_STATES)
def test_loopback_services_of_the_host_are_unreachable(pool, tool_state):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        r = run_as(pool, tool_state, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert r.status == "error" and ("unreachable" in r.stderr or "refused" in r.stderr), r
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    r = run_as(pool, tool_state, "import socket\nprint(socket.if_nameindex())")
    assert r.stdout.strip() == "[(1, 'lo')]"


def test_no_state_leaks_between_calls(pool):
    dirty = ("import builtins, math, sys, os, random\nbuiltins.LEAK = 1\nmath.pi = 3\nsys.path.append('/leak')\n"
             "os.environ['LEAK'] = '1'\nopen('/tmp/leak.txt', 'w').write('x')\nglobal_name = 5")
    probe = ("import builtins, math, sys, os\n"
             "print(hasattr(builtins, 'LEAK'), math.pi, '/leak' in sys.path, 'LEAK' in os.environ,"
             " os.path.exists('/tmp/leak.txt'), 'global_name' in globals(), os.listdir('.'))")
    for _ in range(3):  # both workers
        assert run(pool, dirty).status == "ok"
    for _ in range(4):
        assert run(pool, probe).stdout == "False 3.141592653589793 False False False False []\n"
    draws = {run(pool, "import random, numpy\nprint(random.random(), numpy.random.rand())").stdout for _ in range(4)}
    assert len(draws) == 4  # every call has its own random state


def test_interpreter_is_the_parents_and_can_import_beyond_the_preloads(pool):
    r = run(pool, "import sys, sqlite3, xml.dom.minidom, fractions, sympy, numpy\nprint(sys.executable)\n"
                  "import subprocess\nprint(subprocess.run([sys.executable, '-c', 'import sympy; print(sympy.pi)'],"
                  " capture_output=True, text=True).stdout)", timeout_s=20)
    assert r.status == "ok", r
    in_tmp = sys.executable.startswith("/tmp/")  # an interpreter under /tmp is seen under TMP_STASH (remapped)
    assert r.stdout.split() == [sandbox.TMP_STASH * in_tmp + sys.executable, "pi"]


# ---------------------------------------------------------------------------------------------------------------
# Behaviour of ordinary calls


def test_an_interpreter_under_tmp_stays_usable_and_out_of_sight_of_each_calls_private_tmp(tmp_path):
    # a clone or virtual environment under /tmp: every call mounts a fresh /tmp, which must neither hide it nor
    # show it (the call's working directory starts empty)
    import subprocess
    import sysconfig

    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip("needs a temporary directory under /tmp")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "ours.pth").write_text(sysconfig.get_paths()["purelib"] + "\n" + os.path.dirname(sandbox.__file__) + "\n")
    (site / "probe_under_tmp.py").write_text("X = 41 + 1\n")
    script = ("import asyncio, sandbox\n"
              "async def main():\n"
              "    async with sandbox.SandboxPool(workers=1, preload=()) as pool:\n"
              "        for _ in range(2):  # a second call: its fresh /tmp gets the interpreter again\n"
              "            r = await pool.run('import probe_under_tmp, fractions; print(probe_under_tmp.X)')\n"
              "            print(r.status, r.stdout.strip(), r.stderr.strip()[-200:])\n"
              "        r = await pool.run('open(probe_under_tmp_path, \"w\")'.replace('probe_under_tmp_path', "
              "repr(probe_path)))\n"
              "        print(r.status)\n"
              "        r = await pool.run('import os, subprocess, sys\\n'\n"
              "                           'print(os.listdir(\".\"), os.listdir(\"/tmp\"))\\n'\n"
              "                           'print(subprocess.run([sys.executable, \"-c\", \"import probe_under_tmp; '\n"
              "                           'print(probe_under_tmp.X)\"], capture_output=True, text=True).stdout)')\n"
              "        print(r.stdout.strip().replace(chr(10), ' '), r.stderr.strip()[-200:])\n"
              "probe_path = %r\n"
              "asyncio.run(main())\n") % str(site / "probe_under_tmp.py")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[:2] == ["ok 42 ", "ok 42 "], out.stdout + out.stderr
    assert lines[2] == "error"                       # ... read-only: the call cannot change it
    assert lines[3] == "[] [] 42 ", out.stdout        # out of sight, and a subprocess of sys.executable works
    assert (site / "probe_under_tmp.py").read_text() == "X = 41 + 1\n"


def test_an_interpreter_reached_through_a_link_under_tmp_imports_its_preloads(tmp_path):
    # a checkout copied under /tmp whose .venv is a link to the real environment elsewhere: the sandbox must bind
    # the link's target (every call's /tmp hides the link itself), not start without numpy and sympy
    import subprocess

    if not str(tmp_path).startswith("/tmp/") or sys.prefix.startswith("/tmp/"):
        pytest.skip("needs a temporary directory under /tmp and an environment outside it")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    script = ("import asyncio, warnings, sandbox\n"
              "warnings.simplefilter('error', RuntimeWarning)  # a failed preload warns: fail instead\n"
              "async def main():\n"
              "    async with sandbox.SandboxPool(workers=1) as pool:\n"
              "        r = await pool.run('import sympy, sys; print(sympy.Integer(6) * 7, sys.prefix)')\n"
              "        print(r.status, r.stdout.strip(), r.stderr.strip()[-300:])\n"
              "asyncio.run(main())\n")
    python = tmp_path / ".venv" / "bin" / os.path.basename(sys.executable)
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(sandbox.__file__))
    assert out.returncode == 0, out.stdout + out.stderr
    status, answer, prefix = out.stdout.split()[:3]
    assert (status, answer) == ("ok", "42"), out.stdout
    assert prefix == os.path.realpath(sys.prefix), out.stdout   # the environment seen where it really is


def test_notebook_style_final_expression_and_stdin(pool):
    assert run(pool, "x = 2\nx ** 10").stdout == "1024\n"
    assert run(pool, "print('only once')").stdout == "only once\n"
    assert run(pool, "None").stdout == ""
    assert run(pool, "import sympy\nx = sympy.Symbol('x')\nsympy.expand((x + 1) ** 2)").stdout == "x**2 + 2*x + 1\n"
    assert run(pool, "a = input()\nb = input()\nprint(int(a) + int(b))", stdin="3\n4\n").stdout == "7\n"
    assert run(pool, "import sys\nprint(len(sys.stdin.read()))", stdin="x" * 200_000).stdout == "200000\n"


def test_long_output_keeps_head_and_tail_and_counts_the_cut(pool):
    r = run(pool, "for i in range(100000): print(i)")
    assert r.status == "ok"
    assert r.stdout.startswith("0\n1\n2\n") and r.stdout.endswith("99998\n99999\n")
    total = sum(len(f"{i}\n") for i in range(100000))
    kept = len(r.stdout.split("\n... [")[0]) + len(r.stdout.split("] ...\n")[1])
    assert f"[{total - kept} characters omitted]" in r.stdout


def test_per_call_timeout_overrides_the_default(pool):
    r = run(pool, "import time\ntime.sleep(0.3)\nprint('slept')", timeout_s=0.1)
    assert r.status == "timeout" and r.exit_code is None
    r = run(pool, "import time\ntime.sleep(2)\nprint('slept')", timeout_s=5)
    assert r.status == "ok" and r.stdout == "slept\n"


def test_the_pool_counts_the_calls_running_longer_than_a_time(pool):
    """calls_running(s): how many workers have been running a call for more than s seconds, the cores the sandbox
    holds (the CPU engine decodes on the others). A call that sleeps 3 s is counted with s = 0 from its start,
    with s = 0.5 once half a second has passed, never with s = 10; nothing is counted once it returned."""
    async def go():
        call = asyncio.ensure_future(pool.run("import time\ntime.sleep(3)\nprint('slept')", timeout_s=10))
        deadline = time.monotonic() + 10
        while pool.calls_running() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seen = [(pool.calls_running(), pool.calls_running(10))]
        await asyncio.sleep(0.6)
        seen.append(pool.calls_running(0.5))
        result = await call
        return result, seen, pool.calls_running()

    result, seen, after = asyncio.run(go())
    assert result.stdout == "slept\n"
    assert seen == [(1, 0), 1] and after == 0


def test_format_tool_response_matches_the_papers_text():
    ok = ExecResult("ok", "4\n", "", 0, 0.0123)
    assert format_tool_response(ok) == "Tool call success\nstdout: 4\n\nexecution time: 0.01s"
    bad = ExecResult("error", "", "Traceback ...\nZeroDivisionError: division by zero\n", 1, 0.5)
    text = format_tool_response(bad)
    assert text.startswith("Tool call failure\nreason: error (exit code 1)\nstderr: Traceback")
    assert text.endswith("execution time: 0.50s")
    assert "killed by signal SIGSEGV" in format_tool_response(ExecResult("crashed", "", "", -11, 0.1))
    assert "timeout" in format_tool_response(ExecResult("timeout", "partial", "", None, 10.0))
    long = format_tool_response(ExecResult("ok", "a" * 5000 + "b" * 5000, "", 0, 1.0), max_chars=100)
    assert "a" * 50 + "\n... [9900 characters omitted] ...\n" + "b" * 50 in long


# ---------------------------------------------------------------------------------------------------------------
# The pool's life: concurrency, loops, failures, recycling, close, memory


def test_1000_concurrent_calls_come_back_correct_and_in_order(pool):
    async def many():
        return await asyncio.gather(*[pool.run(f"print({i} * {i})", stdin=str(i)) for i in range(1000)])

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(1000)]
    assert all(r.status == "ok" for r in results)


def test_cancelled_calls_do_not_disturb_the_pool(pool):
    async def cancel_some():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool.run("import time\ntime.sleep(0.5)"), 0.05)
        tasks = [asyncio.ensure_future(pool.run("while True: pass")) for _ in range(10)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        return await pool.run("print('still here')")

    assert asyncio.run(cancel_some()).stdout == "still here\n"


def test_pool_works_from_a_background_event_loop_thread(pool):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        futures = [asyncio.run_coroutine_threadsafe(pool.run(f"print({i})"), loop) for i in range(20)]
        assert [f.result(timeout=60).stdout for f in futures] == [f"{i}\n" for i in range(20)]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_a_dead_worker_is_replaced(pool):
    # the workers boot in the background: on a busy host none may be up yet, and then nothing would be killed
    assert wait_until(lambda: pool.worker_pids())
    for pid in pool.worker_pids():
        os.kill(pid, 9)
    results = [run(pool, "print('alive')") for _ in range(6)]
    assert results[-1].stdout == "alive\n"
    assert all(r.status in ("ok", "crashed") for r in results)
    assert pool.stats["restarts"] >= 1


def test_workers_are_recycled_and_close_leaves_nothing_behind():
    tmp_before = set(glob.glob("/tmp/rstar2-sandbox-*"))
    p = SandboxPool(workers=1, timeout_s=5, preload=(), recycle_after=3)

    async def session():
        await p.start()
        outs = []
        for i in range(40):
            outs.append((await p.run(f"print({i})")).stdout)
            if p.stats["recycled"] >= 2:
                break
            await asyncio.sleep(0.05)  # give the spare time to boot
        return outs

    outs = asyncio.run(session())
    assert outs == [f"{i}\n" for i in range(len(outs))]
    assert p.stats["recycled"] >= 2
    pids = p.worker_pids()
    family = [int(c) for pid in pids for c in open(f"/proc/{pid}/task/{pid}/children").read().split()] + pids
    asyncio.run(p.close())
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in family)), family
    assert p.worker_pids() == []
    assert set(glob.glob("/tmp/rstar2-sandbox-*")) == tmp_before


def test_parent_memory_stays_flat(pool):
    async def batch(n):
        for start in range(0, n, 100):
            await asyncio.gather(*[pool.run("print(1)") for _ in range(100)])

    asyncio.run(batch(300))  # warm up
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    asyncio.run(batch(2000))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 256 * 1024, after - before


# ---------------------------------------------------------------------------------------------------------------
# Failing closed: under a runtime that refuses unshare(2) (Docker's default seccomp profile, simulated by a real
# seccomp filter in tests/refuse_unshare.py) the pool refuses to start unless weaker isolation is accepted


def run_refusing_unshare(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "refuse_unshare.py"), sys.executable, "-c",
                           f"import sys; sys.path.insert(0, {ROOT!r})\n" + script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})


POOL_UNDER_TEST = """
import asyncio, json, sandbox
async def main():
    try:
        async with sandbox.SandboxPool(workers=1, timeout_s=5, preload=()) as pool:
            r = await pool.run("import os\\nprint(6 * 7, open('/proc/self/oom_score_adj').read().strip())")
            print(json.dumps({"mode": pool.mode, "missing": pool.isolation["missing"], "stdout": r.stdout}))
    except sandbox.SandboxUnavailable as e:
        print(json.dumps({"refused": str(e)}))
asyncio.run(main())
"""


def test_pool_refuses_to_start_when_unshare_is_refused():
    r = run_refusing_unshare(POOL_UNDER_TEST)
    assert r.returncode == 0, r.stderr
    refused = json.loads(r.stdout.splitlines()[-1])["refused"]
    for words in ("network namespace", "private read-only file system view", "PID namespace",
                  "Operation not permitted", "--sandbox-isolation none", "isolation='none'",
                  "RSTAR2_SANDBOX_ISOLATION=none", "seccomp"):
        assert words in refused, (words, refused)
    assert "weaker isolation" not in r.stderr  # no fallback: nothing ran


def test_refused_unshare_with_isolation_none_accepted_runs_warned_and_bounded():
    r = run_refusing_unshare(POOL_UNDER_TEST, env={"RSTAR2_SANDBOX_ISOLATION": "none"})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["mode"] == "none" and report["stdout"] == "42 1000\n"
    assert any("network namespace" in m for m in report["missing"])
    assert "RuntimeWarning: sandbox: running with weaker isolation (isolation='none')" in r.stderr


def test_unknown_isolation_mode_is_an_error():
    with pytest.raises(ValueError, match="isolation must be one of auto, none, userns"):
        SandboxPool(isolation="off")


# ---------------------------------------------------------------------------------------------------------------
# Every call bounded in every isolation mode: processes, memory (its processes, /tmp and memfds together where a
# cgroup can be made), and the OOM killer's choice. The trainer (this process) must be untouched.

MODES = [(mode, cgroup) for mode in ("auto", "userns", "none") for cgroup in (True, False)
         if mode != "userns" or IS_ROOT]  # (an ordinary user's "auto" is the user-namespace mode)
COUNT_FORKS = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
               "    print(n, e.errno)")
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
MEMORY_IN_PROCESSES = ("import os\nkids = []\nfor i in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
                       "        block = b'x' * (160 << 20)\n        import time; time.sleep(0.5)\n        os._exit(0)\n"
                       "    kids.append(pid)\nprint([os.waitpid(p, 0)[1] for p in kids])")
TMP_THEN_MEMORY = ("import tempfile\nfor i in range(4):\n"
                   "    open(f'{tempfile.gettempdir()}/fill{i}', 'wb').write(b'x' * (50 << 20))\n"
                   "block = b'y' * (250 << 20)\nprint('survived', tempfile.gettempdir())")


def trainer_state(threads_at_most: int | None = None) -> tuple[int, int]:
    """(VmRSS in kB, threads) of this process. threads_at_most: wait up to 5 s for the count to fall that low, as
    a joined thread leaves /proc a moment after Thread.join() returns (seen on a loaded machine); a thread that
    really stays is still counted."""
    deadline = time.monotonic() + 5.0
    while True:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        rss, threads = int(fields["VmRSS"].split()[0]), int(fields["Threads"])
        if threads_at_most is None or threads <= threads_at_most or time.monotonic() > deadline:
            return rss, threads
        time.sleep(0.05)


def expected_process_bound(pool) -> int:
    """What bounds a call's children here: a cgroup or RLIMIT_NPROC (max_processes), else pid_max (its tasks)."""
    if pool.isolation.get("cgroup") or sandbox.process_limit(pool.config.__dict__, pool.isolation) is not None:
        return pool.config.max_processes
    assert pool.isolation.get("pid_max"), pool.isolation  # root forcing a user namespace without a cgroup
    return pool.isolation.get("pid_max") - 1


# the stateful tools in the modes they run in (persistent sessions need the PID namespace: not "none")
BOMB_CASES = ([("stateless", mode, cgroup) for mode, cgroup in MODES]
              + [("persistent", mode, cgroup) for mode, cgroup in MODES if mode != "none"]
              + [("replay", mode, cgroup) for mode, cgroup in MODES if (mode, cgroup) == ("auto", True)])


@pytest.mark.parametrize("tool_state,mode,cgroup", BOMB_CASES,
                         ids=[(f"{t}-" if t != "stateless" else "") + f"{m}-{'cgroup' if c else 'no-cgroup'}"
                              for t, m, c in BOMB_CASES])
def test_fork_and_memory_bombs_are_bounded_in_every_mode_and_the_trainer_is_untouched(tool_state, mode, cgroup):
    pool = SandboxPool(workers=1, timeout_s=4.0, memory_mb=384, preload=(), isolation=mode, cgroup=cgroup,
                       max_processes=16, max_sessions=int(tool_state == "persistent"), session_memory_mb=32)
    rss_before, threads_before = trainer_state()
    cgroups = []

    async def session():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            await pool.start()
        cgroups.extend(d for paths in pool._cgroups.values() for d in paths["dirs"])
        persistent = pool.session(tool_state)  # one session meets every bomb (stateless: the pool itself)

        async def call(code, timeout_s=None):
            if tool_state != "replay":
                return await persistent.run(code, timeout_s=timeout_s)
            replay = pool.session("replay")  # each bomb after one harmless cell (replaying a bomb would be a
            replay.history.append(("kept = 41", ""))  # second bomb)
            return await replay.run(code, timeout_s=timeout_s)

        try:
            counted = await call(COUNT_FORKS, timeout_s=60)  # up to 300 forks on a busy machine
            bomb = await call(FORK_BOMB, timeout_s=1.0)
            # the memory bombs take about a second; 30 s, not the pool's 4, so that a loaded machine (the suite's
            # other worker beside a training run) cannot turn them into timeouts with no output
            bombs = [await call(code, timeout_s=30) for code in (MEMORY_IN_PROCESSES, TMP_THEN_MEMORY)]
            return [counted, bomb, *bombs, await call("print(open('/proc/self/oom_score_adj').read())")]
        finally:
            await pool.close()

    counted, bomb, memory, tmp_memory, oom_adj = asyncio.run(session())
    children = int(counted.stdout.split()[0])
    # a persistent session's call may also take the slot kept for the state it leaves (RLIMIT_NPROC as root)
    assert 1 <= children <= expected_process_bound(pool) + (tool_state == "persistent"), (counted, pool.isolation)
    assert bomb.status == "timeout"
    assert oom_adj.stdout == "1000\n\n"
    statuses = eval(memory.stdout)
    if pool.isolation.get("cgroup"):  # 4 x 160 MB of touched memory against a 384 MB budget: the kernel kills some
        assert sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in statuses) >= 1, memory
    else:  # no aggregate bound: each process stays under its RLIMIT_AS, and the warning said so
        assert statuses == [0, 0, 0, 0], memory
        assert any("cgroup memory limit" in m for m in pool.isolation["missing"])
    if pool.isolation.get("cgroup") and pool.isolation["filesystem"]:
        assert tmp_memory.status == "memory", tmp_memory  # the private /tmp's 200 MB count toward the 384 MB
    else:  # no cgroup, or no private /tmp (isolation "none": TMPDIR is the call's scratch directory on disk)
        assert tmp_memory.stdout.startswith("survived"), tmp_memory
    rss_after, threads_after = trainer_state(threads_at_most=threads_before + 1)
    assert rss_after - rss_before < 64 << 10 and threads_after <= threads_before + 1  # kB; this process untouched
    assert subprocess.run(["true"]).returncode == 0  # ... and can still start processes
    assert bool(cgroups) == bool(pool.isolation.get("cgroup")) and not any(map(os.path.exists, cgroups))


# ---------------------------------------------------------------------------------------------------------------
# Degraded modes: weaker isolation is announced, never silent


def test_no_isolation_mode_warns_and_still_enforces_limits():
    before = set(glob.glob("/tmp/rstar2-sandbox-*"))
    p = SandboxPool(workers=1, timeout_s=1.0, preload=(), isolation="none")
    uids = {sandbox.sandbox_uid({"sandbox_uid": p.config.sandbox_uid, "parent_pid": os.getpid(), "index": 0})}
    earlier = set(processes_of(uids)) if IS_ROOT else set()  # another pool of this process had this uid before

    async def session():
        with pytest.warns(RuntimeWarning, match="network namespace"):
            await p.start()
        try:
            return [await p.run("print(6 * 7)"), await p.run("while True: pass"),
                    await p.run("import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
                                "print('spawned')")]
        finally:
            if IS_ROOT:
                ours = lambda: set(processes_of(uids)) - earlier  # noqa: E731
                assert wait_until(lambda: len(ours()) <= 1), (ours(), earlier)  # the waiting fork alone
            await p.close()

    ok, timeout, daemon = asyncio.run(session())
    assert ok.stdout == "42\n" and timeout.status == "timeout" and daemon.stdout == "spawned\n"
    assert set(glob.glob("/tmp/rstar2-sandbox-*")) == before


@pytest.mark.skipif(not IS_ROOT, reason="forcing the user-namespace mode is tested as root")
def test_user_namespace_mode_warns_and_isolates_the_network():
    p = SandboxPool(workers=1, timeout_s=2.0, preload=("sympy",), isolation="userns")

    async def session():
        with pytest.warns(RuntimeWarning, match="separate uid"):
            await p.start()
        try:
            return [await p.run("import sympy\nsympy.factorint(1001)"),
                    await p.run("import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)"),
                    await p.run("print(open('/proc/self/status').read())")]
        finally:
            await p.close()

    factor, net, status = asyncio.run(session())
    assert factor.stdout == "{7: 1, 11: 1, 13: 1}\n"
    assert net.status == "error" and "unreachable" in net.stderr
    assert "CapEff:\t0000000000000000" in status.stdout


# ---------------------------------------------------------------------------------------------------------------
# Optional stateful sessions


def test_session_keeps_state_and_rolls_back_failed_calls(pool):
    async def turns():
        session = sandbox.SandboxSession(pool)
        other = sandbox.SandboxSession(pool)
        return [await session.run("x = 5\nprint('set')"), await session.run("x * 2"),
                await session.run("x = 100\n1 / 0"), await session.run("y = x + 1\nname = input()", stdin="ada"),
                await session.run("print(x, y, name)"), await other.run("x"), await pool.run("x")]

    set_x, double, failed, add_y, both, other, stateless = asyncio.run(turns())
    assert set_x.stdout == "set\n" and double.stdout == "10\n"  # replayed cells print nothing
    assert failed.status == "error"
    assert add_y.status == "ok" and both.stdout == "5 6 ada\n"  # x = 100 was rolled back
    assert other.status == "error" and "NameError" in other.stderr  # sessions are separate
    assert stateless.status == "error"  # and the plain tool stays stateless


def test_worker_cgroup_v2_is_a_sibling_of_ours_with_memory_and_pids_limits(tmp_path, monkeypatch):
    """The cgroup v2 path on a stand-in hierarchy (this test machine may only have v1 controllers): where the
    directory goes, which controllers are switched on, which limits are written."""
    parent = tmp_path / "user.slice" / "app.slice"
    (parent / "term.scope").mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text("memory\n")  # pids not yet enabled for the children
    monkeypatch.setattr(sandbox, "own_cgroups", lambda: {"": "/user.slice/app.slice/term.scope"})
    monkeypatch.setattr(sandbox, "cgroup_mounts", lambda: {"": (str(tmp_path), "/")})
    paths, why = sandbox.make_worker_cgroup("rstar2-sandbox-test", 123 << 20, 66)
    d = parent / "rstar2-sandbox-test"
    assert why == "" and paths["version"] == 2 and paths["dirs"] == [str(d)]
    assert (parent / "cgroup.subtree_control").read_text() == "+pids"
    assert (d / "memory.max").read_text() == str(123 << 20) and (d / "pids.max").read_text() == "66"
    assert paths["procs"] == [str(d / "cgroup.procs")] and paths["events"] == str(d / "memory.events")
    # a hierarchy mounted from a sub-tree (a container's view): paths are taken relative to the mount's root
    monkeypatch.setattr(sandbox, "cgroup_mounts", lambda: {"": (str(tmp_path / "user.slice"), "/user.slice")})
    paths, why = sandbox.make_worker_cgroup("rstar2-sandbox-test-2", 1 << 30, 66)
    assert paths["dirs"] == [str(parent / "rstar2-sandbox-test-2")], why
    # nothing writable: no cgroup, and the reason
    monkeypatch.setattr(sandbox, "cgroup_mounts", lambda: {"": (str(tmp_path / "absent"), "/")})
    paths, why = sandbox.make_worker_cgroup("rstar2-sandbox-test-3", 1 << 30, 66)
    assert paths is None and why.startswith("cgroup v2 at ")


def test_an_answer_waiting_past_its_deadline_is_read_not_timed_out():
    """A trainer that was not scheduled for a while (a laptop's suspend, SIGSTOP, a busy host) finds the worker's
    answer waiting in the pipe after the call's deadline has passed: it reads it, and does not call a worker that
    answered dead (which would replace the worker and turn a finished call into a timeout)."""
    import sandbox_worker

    r, w = os.pipe()
    try:
        sandbox_worker.send_message(w, {"status": "ok", "stdout": "42\n"})
        assert sandbox_worker.read_message(r, time.monotonic() - 5.0) == {"status": "ok", "stdout": "42\n"}
        with pytest.raises(TimeoutError):         # nothing there: past the deadline is a timeout, as before
            sandbox_worker.read_message(r, time.monotonic() - 5.0)
    finally:
        os.close(r)
        os.close(w)
