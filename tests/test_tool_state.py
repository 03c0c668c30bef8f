"""Tests for the tool's state across calls (sandbox.py, tool_state = stateless | replay | persistent).

A persistent session is a process tree of its own inside a worker: each call runs in a fork of the session's last
good state, which it replaces only when the call succeeds. The oracle for every rollback test is a plain one: the
same cells without the failing one, run one after another in one fresh Python process.
"""
import asyncio
import os
import subprocess
import sys
import tempfile

import pytest

import sandbox
from sandbox import SandboxPool
from sandbox_isolation import processes_in_namespace
from test_sandbox import pool, wait_until  # noqa: E402,F401  (the isolation tests' pool fixture and poll)


def calls(pool, mode, cells):
    """Run (code, stdin) cells in order in one session of `mode`; returns the results (the session is closed)."""
    async def go():
        tool = pool.session(mode)
        try:
            return [await tool.run(code, stdin) for code, stdin in cells]
        finally:
            await tool.close()
    return asyncio.run(go())


def one_fresh_process(cells) -> str:
    """The oracle: the cells run one after another in one new interpreter, in an empty working directory (as a
    session's /tmp starts); returns the last cell's stdout."""
    program = ("import sys, io, ast\ncells = %r\nns = {'__name__': '__main__'}\n"
               "for i, (code, stdin) in enumerate(cells):\n"
               "    sys.stdin = io.StringIO(stdin)\n"
               "    if i < len(cells) - 1:\n"
               "        out, sys.stdout = sys.stdout, io.StringIO()\n"
               "    tree = ast.parse(code)\n"
               "    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None\n"
               "    exec(compile(tree, '<string>', 'exec'), ns)\n"
               "    if last is not None:\n"
               "        value = eval(compile(ast.Expression(last.value), '<string>', 'eval'), ns)\n"
               "        if value is not None: print(repr(value))\n"
               "    if i < len(cells) - 1:\n"
               "        sys.stdout = out\n") % (list(cells),)
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-c", program], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---------------------------------------------------------------------------------------------------------------
# State persists: a variable, an import, a function and an open file are there in the next call

SETUP = ("import math, os\nx = 5\nitems = [1, 2]\ndef times_x(a):\n    return a * x\n"
         "log = open('log.txt', 'w')\nlog.write('one\\n')\nopen('data.txt', 'w').write('kept')")
PROBE = ("log.write('three\\n')\nlog.close()\n"
         "print(x, items, times_x(2), math.factorial(5), repr(open('log.txt').read()), open('data.txt').read(), "
         "sorted(os.listdir('.')))")


def test_persistent_session_keeps_variables_imports_functions_and_open_files(pool):
    results = calls(pool, "persistent", [(SETUP, ""), ("items.append(x)\nprint(len(items))", ""), (PROBE, "")])
    assert [r.status for r in results] == ["ok", "ok", "ok"], results
    assert results[1].stdout == "3\n"
    assert results[2].stdout == one_fresh_process([(SETUP, ""), ("items.append(x)", ""), (PROBE, "")])
    assert results[2].stdout == "5 [1, 2, 5] 10 120 'one\\nthree\\n' kept ['data.txt', 'log.txt']\n"


# Every kind of failure, after it has changed every kind of state: variables, a list in place, an open file's
# contents and position, a file's contents, a new file
MUTATE = ("x = 100\nitems.append(3)\nlog.write('two\\n')\nlog.flush()\nopen('data.txt', 'w').write('clobbered')\n"
          "open('new.txt', 'w').write('new')\nos.mkdir('newdir')\n")
FAILURES = {
    "raises": (MUTATE + "1 / 0", "error"),
    "timeout": (MUTATE + "while True: pass", "timeout"),
    "memory": (MUTATE + "block = bytearray(10**12)", "memory"),
    "kills itself": (MUTATE + "import signal\nos.kill(os.getpid(), signal.SIGKILL)", "crashed"),
    "exits": (MUTATE + "import sys\nsys.exit(3)", "error"),
}


@pytest.mark.parametrize("failure", list(FAILURES), ids=list(FAILURES))
def test_a_failed_call_leaves_the_session_exactly_as_before(pool, failure):
    code, status = FAILURES[failure]
    setup, failed, probe = calls(pool, "persistent", [(SETUP, ""), (code, ""), (PROBE, "")])
    assert setup.status == "ok" and failed.status == status, failed
    assert failed.rolled_back
    assert "rolled back" in sandbox.format_tool_response(failed)
    assert probe.status == "ok", probe
    assert probe.stdout == one_fresh_process([(SETUP, ""), (PROBE, "")])  # as if the failed call never ran


# A call that turns on the session's own processes. Their memory is out of its reach: the state comes out intact.
# Signals are not (the state and the call share a uid and a PID namespace): a call that kills the state loses the
# session, and says so; the next call starts an empty session, and no process is left over.
REACH_MEMORY = {
    "writes its parent's memory": ("import os\nfd = os.open(f'/proc/{os.getppid()}/mem', os.O_RDWR)\n"
                                   "os.pwrite(fd, b'x' * 8, 0x400000)"),
    "attaches to its parent": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                               "assert libc.ptrace(16, os.getppid(), 0, 0) == 0, ctypes.get_errno()"),
}
SIGNALS = {
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(0.5)",
    "kills every process": "import os, signal\nos.kill(-1, signal.SIGKILL)\nimport time\ntime.sleep(0.5)",
    "stops its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)",
}


@pytest.mark.parametrize("attack", list(REACH_MEMORY), ids=list(REACH_MEMORY))
def test_a_call_cannot_reach_the_states_memory(pool, attack):
    setup, attacked, probe = calls(pool, "persistent", [(SETUP, ""), (MUTATE + REACH_MEMORY[attack], ""), (PROBE, "")])
    assert attacked.status == "error" and attacked.rolled_back, attacked
    assert any(e in attacked.stderr for e in ("PermissionError", "FileNotFoundError", "AssertionError: 1")), attacked
    assert probe.stdout == one_fresh_process([(SETUP, ""), (PROBE, "")]), probe


@pytest.mark.parametrize("attack", list(SIGNALS), ids=list(SIGNALS))
def test_a_call_that_kills_the_state_loses_the_session_loudly_and_leaves_nothing(pool, attack):
    async def go():
        async with pool.session("persistent") as session:
            await session.run("x = 1")
            namespace = session.namespace
            return await session.run(SIGNALS[attack]), namespace, await session.run("print('x' in globals())")

    restarts = pool.stats["restarts"]
    attacked, namespace, after = asyncio.run(go())
    assert attacked.status != "ok" and attacked.rolled_back and "state was lost" in attacked.stderr, attacked
    assert pool.stats["restarts"] == restarts  # the session alone was lost, never its worker
    assert after.status == "ok" and after.stdout == "False\n"  # a new, empty session
    assert wait_until(lambda: not processes_in_namespace(namespace))  # the lost session left nothing


def test_a_successful_call_is_not_rolled_back_and_says_nothing_about_it(pool):
    ok, = calls(pool, "persistent", [("print(1)", "")])
    assert ok.status == "ok" and not ok.rolled_back
    assert "rolled back" not in sandbox.format_tool_response(ok)


def test_random_drawn_in_one_call_is_not_drawn_again_in_the_next(pool):
    cells = [("import random\nrandom.seed(7)\na = random.random()\nprint(a)", ""),
             ("print(a, random.random())", "")]
    first, second = calls(pool, "persistent", cells)
    assert second.stdout == one_fresh_process(cells)  # the generator's state carries over, no fresh seed at fork
    assert second.stdout.split()[0] == first.stdout.strip()
    # replay draws again: a later call that reads `a` sees a new value (the cost the persistent mode removes)
    unseeded = [("import random\na = random.random()\nprint(a)", ""), ("print(a)", "")]
    p1, p2 = calls(pool, "persistent", unseeded)
    r1, r2 = calls(pool, "replay", unseeded)
    assert p1.stdout == p2.stdout and r1.stdout != r2.stdout


def test_replay_and_stateless_tools_keep_their_meaning(pool):
    cells = [("x = 5", ""), ("x = 100\n1 / 0", ""), ("print(x)", "")]
    replay = calls(pool, "replay", cells)
    stateless = calls(pool, "stateless", cells)
    assert replay[2].stdout == "5\n" and replay[1].rolled_back
    assert stateless[2].status == "error" and "NameError" in stateless[2].stderr and not stateless[1].rolled_back


def test_two_sessions_never_see_each_others_state_or_files(pool):
    async def go():
        a, b = pool.session("persistent"), pool.session("persistent")
        try:
            await a.run("secret = 'from a'\nopen('a.txt', 'w').write('a')")
            await b.run("mine = 'b'")
            return [await b.run("import os\nprint('secret' in globals(), sorted(os.listdir('.')), "
                                "sorted(os.listdir('/tmp')))"),
                    await b.run("import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))"),
                    await a.run("print(secret, open('a.txt').read(), 'mine' in globals())")]
        finally:
            await a.close()
            await b.close()

    b_view, b_procs, a_view = asyncio.run(go())
    assert b_view.stdout == "False [] []\n"
    assert a_view.stdout == "from a a False\n"
    assert len(eval(b_procs.stdout)) <= 2, b_procs  # itself (and its session's state), nothing of `a`


def test_a_sessions_processes_are_gone_after_it_ends_and_after_the_pool_closes():
    p = SandboxPool(workers=1, timeout_s=5, preload=(), max_sessions=4)

    async def go():
        await p.start()
        ended, kept = p.session("persistent"), p.session("persistent")
        daemon = ("import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\nx = 1")
        assert (await ended.run(daemon)).status == "ok"
        assert (await kept.run(daemon)).status == "ok"
        spaces = ended.namespace, kept.namespace
        alive = [len(processes_in_namespace(ns)) for ns in spaces]
        await ended.close()
        gone_after_end = wait_until(lambda: not processes_in_namespace(spaces[0]))
        wait_until(lambda: len(processes_in_namespace(spaces[1])) == 2)  # (its last call's may still be dying)
        still = len(processes_in_namespace(spaces[1]))
        await p.close()  # `kept` was never closed: the pool takes it down
        return spaces, alive, gone_after_end, still

    spaces, alive, gone_after_end, still = asyncio.run(go())
    assert all(n >= 2 for n in alive), alive  # the session's init and its state (the daemon died with its call)
    assert gone_after_end and still == 2  # the other session: its init and its state, untouched
    assert wait_until(lambda: not processes_in_namespace(spaces[1]))


def test_sessions_past_the_limit_are_refused_clearly(pool):
    async def go():
        sessions = [pool.session("persistent") for _ in range(pool.config.max_sessions + 1)]
        try:
            return [await s.run("1") for s in sessions]
        finally:
            for s in sessions:
                await s.close()

    async def after():
        async with pool.session("persistent") as session:
            return await session.run("2")

    results = asyncio.run(go())
    assert [r.status for r in results[:-1]] == ["ok"] * pool.config.max_sessions
    assert results[-1].status == "rejected" and "max_sessions" in results[-1].stderr
    assert asyncio.run(after()).status == "ok"  # closed sessions free their slots


def test_a_session_whose_state_outgrows_its_bound_is_refused_and_rolled_back():
    p = SandboxPool(workers=1, timeout_s=10, preload=(), max_sessions=1, session_memory_mb=64)

    async def go():
        async with p:
            s = p.session("persistent")
            return [await s.run("small = b'x' * (8 << 20)"), await s.run("big = b'y' * (200 << 20)"),
                    await s.run("print(len(small), 'big' in globals())")]

    small, big, probe = asyncio.run(go())
    assert small.status == "ok" and big.status == "memory" and big.rolled_back
    assert "session_memory_mb" in big.stderr
    assert probe.stdout == f"{8 << 20} False\n"


def test_a_dead_worker_loses_its_sessions_loudly_and_is_replaced():
    p = SandboxPool(workers=1, timeout_s=5, preload=(), max_sessions=2)

    async def go():
        async with p:
            s = p.session("persistent")
            await s.run("x = 1")
            for pid in p.worker_pids():
                os.kill(pid, 9)
            lost = await s.run("print(x)")
            fresh = await s.run("x = 2\nprint(x)")
            return lost, fresh

    lost, fresh = asyncio.run(go())
    assert lost.status != "ok" and "lost" in lost.stderr
    assert fresh.stdout == "2\n"


def test_persistent_sessions_need_the_pid_namespace():
    p = SandboxPool(workers=1, timeout_s=5, preload=(), max_sessions=2, isolation="none")

    async def go():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            async with p:
                return await p.session("persistent").run("1")

    r = asyncio.run(go())
    assert r.status == "rejected" and "PID namespace" in r.stderr


def test_unknown_tool_state_is_an_error(pool):
    with pytest.raises(ValueError, match="stateless, replay, persistent"):
        pool.session("sticky")


def test_rollouts_carry_a_trajectorys_session_across_its_turns(pool, tokenizer):
    """The scheduler with the real pool: turn 1 defines x (and a failed turn 2 tries to change it), turn 3 reads
    it; with a persistent tool x is there and unchanged, with the stateless tool it is not."""
    import json as json_

    import scheduler as S

    def call(code):
        return "<tool_call>" + json_.dumps({"name": S.TOOL_NAME, "arguments": {"code": code, "input": ""}}) + \
            "</tool_call>"

    turns = [call("x = 6 * 7"), call("x = 0\n1 / 0"), call("print(x)"), "Done."]

    def script(req):
        _, _, turn = req.key
        text = turns[min(turn, len(turns) - 1)]
        ids = S.encode(tokenizer, text)
        return (ids, "tool") if text.endswith(S.TOOL_CALL_CLOSE) else (ids + [tokenizer.eos_token_id], "eos")

    responses = {}
    for tool_state in ("stateless", "persistent"):
        loop = S.virtual_time_loop()
        engines = [S.SimulatedEngine(script, 20000, tokens_per_s=1000, saturation=4)]
        try:
            groups = S.run_rollouts(engines, pool, tokenizer, [("p", "q")], 2, S.RolloutConfig(tool_state=tool_state),
                                    seed=0, progress=False, loop=loop)
        finally:
            loop.close()
        responses[tool_state] = [t.response_text for t in groups[0]]
    assert all("stdout: 42" in r and r.count("rolled back") >= 1 for r in responses["persistent"])
    assert all("NameError" in r and "rolled back" not in r for r in responses["stateless"])
    assert not pool._sessions  # every trajectory's session was closed with it


def test_a_killed_trainer_leaves_no_session_process():
    """The trainer dies without closing anything (SIGKILL, as a crash or a second Ctrl-C): its sessions go with
    it (the session's init dies with its worker, the worker with the trainer: PR_SET_PDEATHSIG down the chain)."""
    script = ("import asyncio, sys, time, sandbox\n"
              "async def main():\n"
              "    pool = sandbox.SandboxPool(workers=1, preload=(), max_sessions=2)\n"
              "    await pool.start()\n"
              "    s = pool.session('persistent')\n"
              "    await s.run('x = 1')\n"
              "    print(s.namespace, flush=True)\n"
              "    time.sleep(60)\n"
              "asyncio.run(main())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        namespace = int(trainer.stdout.readline())
        assert len(processes_in_namespace(namespace)) >= 2
    finally:
        trainer.kill()
        trainer.wait()
    assert wait_until(lambda: not processes_in_namespace(namespace)), processes_in_namespace(namespace)
