"""git_baseline.py - a module as it was at an earlier commit, imported beside today's, so that a benchmark times
both in one process (bench_engine.py, bench_rollout.py: the engine before slot KV against today's)."""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_at(revision: str, filename: str) -> str:
    """The text of `filename` at `revision`; exits with one line when git cannot show it."""
    code = subprocess.run(["git", "-C", ROOT, "show", f"{revision}:{filename}"], capture_output=True, text=True)
    if code.returncode != 0:
        sys.exit(f"error: git show {revision}:{filename}: {code.stderr.strip()}")
    return code.stdout


def module_at(revision: str, filename: str, name: str, own: tuple[str, ...] = ()):
    """`filename` of the checkout at `revision`, imported as module `name`. Its imports resolve to today's modules,
    except those named in `own` that it imports: they are that revision's too, imported as `<module>_<revision>`
    (engines.py runs on slot_engine.py: a baseline engine must run on its own revision's decoder)."""
    text = source_at(revision, filename)
    for dep in own:
        if re.search(rf"^\s*(from {dep} import|import {dep}\b)", text, flags=re.M):
            alias = re.sub(r"\W", "_", f"{dep}_{revision}")   # a module name whatever the revision's spelling
            module_at(revision, f"{dep}.py", alias)
            text = re.sub(rf"^(\s*)from {dep} import", rf"\1from {alias} import", text, flags=re.M)
            text = re.sub(rf"^(\s*)import {dep}\b", rf"\1import {alias} as {dep}", text, flags=re.M)
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
