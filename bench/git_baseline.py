"""git_baseline.py - a module as it was at an earlier commit, imported beside today's, so that a benchmark times
both in one process (bench_engine.py, bench_rollout.py: the engine before slot KV against today's)."""
import importlib.util
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_at(revision: str, filename: str, name: str):
    """`filename` of the checkout at `revision`, imported as module `name` (its own imports resolve to today's
    modules); exits with one line when git cannot show it."""
    code = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:{filename}"], capture_output=True, text=True)
    if code.returncode != 0:
        sys.exit(f"error: git show {revision}:{filename}: {code.stderr.strip()}")
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(code.stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
