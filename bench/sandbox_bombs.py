"""A fork bomb and a memory bomb in every isolation mode of sandbox.py, with the trainer (this process) watched.

For each mode (auto, userns when run as root, none), with and without the per-worker cgroup, one pool of one
worker (memory_mb 1024, max_processes 64) runs:
  * a fork bomb (every process forks forever) for 5 s, while this process counts the worker's tasks every 20 ms
    and starts a process of its own (`true`) now and then: the peak, and whether our starts all succeeded;
  * a memory bomb: 8 processes touching 400 MB each (3.2 GB against 1024 MB): how many the kernel killed, the peak
    resident memory of the worker's tree (shared pages counted in every process) and of its cgroup;
and compares this process's resident memory and threads before and after.

With --oom-demo (root, a writable cgroup): a stand-in trainer holding 600 MB runs inside a 2 GB memory cgroup
with a pool *without* per-worker cgroups, and the memory bomb exhausts that 2 GB: the kernel's OOM killer must
pick the calls (oom_score_adj 1000), not the trainer (0). The last line printed is one JSON object.

    python bench/sandbox_bombs.py [--oom-demo]        # about two minutes on 2 cores
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
MEMORY_BOMB = ("import os\nkids = []\nfor i in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
               "        block = b'x' * (400 << 20)\n        import time; time.sleep(2)\n        os._exit(0)\n"
               "    kids.append(pid)\nprint([os.waitpid(p, 0)[1] for p in kids])")


def tree(root: int) -> tuple[int, int]:
    """(tasks, resident kB) of `root` and all its descendants, from /proc."""
    parent, info = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            parent[int(pid)] = int(fields["PPid"])
            info[int(pid)] = (int(fields["Threads"]), int(fields.get("VmRSS", "0 kB").split()[0]))
        except (OSError, KeyError, ValueError):
            pass
    tasks = rss = 0
    for pid in info:
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            tasks, rss = tasks + info[pid][0], rss + info[pid][1]
    return tasks, rss


def me() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) >> 10, int(fields["Threads"])


def cgroup_peak_mb(pool) -> int | None:
    """The worker cgroup's peak memory (all its processes, /tmp and memfds counted once), where there is one."""
    for paths in pool._cgroups.values():
        name = "memory.peak" if paths["version"] == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(paths["dirs"][0], name)) as f:
                return int(f.read()) >> 20
        except OSError:
            return None
    return None


async def run_watched(pool, code, timeout_s=None):
    """Run code; meanwhile sample the worker tree and start processes of our own. Returns (result, peaks...)."""
    peak, stop, starts = [0, 0], threading.Event(), []

    def watch():
        worker = pool.worker_pids()[0]
        while not stop.is_set():
            tasks, rss = tree(worker)
            peak[0], peak[1] = max(peak[0], tasks), max(peak[1], rss)
            if len(starts) < 20:
                starts.append(subprocess.run(["true"]).returncode == 0)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = await pool.run(code, timeout_s=timeout_s)
    finally:
        stop.set()
        watcher.join()
    return result, peak[0], peak[1] >> 10, all(starts)


async def one_mode(mode: str, cgroup: bool) -> dict:
    pool = sandbox.SandboxPool(workers=1, timeout_s=5.0, memory_mb=1024, isolation=mode, cgroup=cgroup)
    rss0, threads0 = me()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        await pool.start()
    try:
        bomb, bomb_tasks, _, starts_ok = await run_watched(pool, FORK_BOMB)
        memory, _, memory_mb, starts_ok2 = await run_watched(pool, MEMORY_BOMB, timeout_s=60)
        after = await pool.run("print('still serving')")
        cgroup_peak = cgroup_peak_mb(pool)
    finally:
        await pool.close()
    statuses = json.loads(memory.stdout) if memory.stdout.startswith("[") else None
    rss1, threads1 = me()
    return {"mode": pool.mode, "isolation": mode, "cgroup": pool.isolation["cgroup"],
            "limits": pool.isolation["limits"], "fork_bomb": bomb.status, "fork_bomb_peak_tasks": bomb_tasks,
            "memory_bomb": memory.status, "memory_bomb_killed": None if statuses is None else
            sum(os.WIFSIGNALED(s) for s in statuses), "memory_bomb_peak_mb": memory_mb, "cgroup_peak_mb": cgroup_peak,
            "trainer_starts_ok": starts_ok and starts_ok2, "trainer_rss_mb": [rss0, rss1],
            "trainer_threads": [threads0, threads1], "after": after.stdout.strip()}


def oom_demo() -> dict:
    """The trainer stand-in in a 2 GB memory cgroup, pool without per-worker cgroups: who does the OOM killer pick?"""
    paths, why = sandbox.make_worker_cgroup(f"rstar2-oom-demo-{os.getpid()}", 2 << 30, 4096)
    if paths is None:
        return {"skipped": why}
    child = subprocess.run([sys.executable, __file__, "--oom-demo-child"], capture_output=True, text=True,
                           preexec_fn=lambda: [sandbox.write_file(p, str(os.getpid())) for p in paths["procs"]])
    with open(paths["events"]) as f:
        kills = [line for line in f.read().splitlines() if line.startswith("oom_kill ")]
    sandbox.remove_worker_cgroup(paths)
    report = json.loads(child.stdout.splitlines()[-1]) if child.returncode == 0 else {"stderr": child.stderr[-500:]}
    return {"trainer_exit_code": child.returncode, "cgroup_oom_kills": kills, **report}


def oom_demo_child() -> None:
    hold = b"t" * (600 << 20)  # the trainer's big resident memory: the OOM killer's choice without oom_score_adj

    async def go():
        pool = sandbox.SandboxPool(workers=1, timeout_s=10.0, memory_mb=1024, cgroup=False)
        await pool.start()
        try:
            return await pool.run(MEMORY_BOMB, timeout_s=60)
        finally:
            await pool.close()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = asyncio.run(go())
    print(json.dumps({"bomb_status": result.status, "bomb_children": result.stdout.strip(),
                      "trainer_alive_holding_mb": len(hold) >> 20}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--oom-demo", action="store_true")
    parser.add_argument("--oom-demo-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.oom_demo_child:
        oom_demo_child()
        sys.exit(0)
    modes = [(m, c) for m in ("auto", "userns", "none") for c in (True, False) if m != "userns" or os.geteuid() == 0]
    rows = []
    for mode, cgroup in modes:
        row = asyncio.run(one_mode(mode, cgroup))
        rows.append(row)
        print(f"{mode:6s} cgroup={str(row['cgroup']):4s} fork bomb: {row['fork_bomb']}, peak {row['fork_bomb_peak_tasks']}"
              f" tasks | memory bomb: {row['memory_bomb_killed']} of 8 killed, tree RSS peak {row['memory_bomb_peak_mb']} MB"
              f" (cgroup peak {row['cgroup_peak_mb']} MB) |"
              f" trainer: starts ok {row['trainer_starts_ok']}, RSS {row['trainer_rss_mb']} MB, threads "
              f"{row['trainer_threads']} | {row['after']}", flush=True)
    result = {"modes": rows}
    if args.oom_demo:
        result["oom_demo"] = oom_demo()
        print("oom demo:", result["oom_demo"])
    print(json.dumps(result))
