"""GPU check of scheduler.VLLMEngine (skipped cleanly without CUDA or vLLM; see scheduler.py, "vLLM engines").

Proves on a GPU box, with the real scheduler:
  1. a weight sync reaches the engines: greedy outputs change after loading perturbed weights, and come back
     after loading the original ones (nothing reloads the checkpoint behind our back);
  2. engine and trainer agree: the engine's log-probs of its sampled tokens and the trainer's
     log_softmax(logits / T) of the same tokens (Hugging Face model, bf16) differ by < 0.02 on average;
  3. the engines stay balanced: one step of rollouts over all GPUs gives every engine a similar share of the
     generated tokens (max / mean < 1.25) and never reserves more than an engine's KV capacity.

    python tests/gpu_check_vllm.py --model Qwen/Qwen2.5-1.5B-Instruct   # any HF causal LM directory or name
    pytest tests/gpu_check_vllm.py -s                                   # RSTAR2_GPU_MODEL=... picks the model
"""
import asyncio
import os
import sys

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


def check_all(model_path: str, num_gpus: int | None = None) -> dict:
    import scheduler as S
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loop = asyncio.new_event_loop()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engines = S.VLLMEngine.launch(model_path, loop, num_gpus=num_gpus, gpu_memory_utilization=0.6,
                                  max_model_len=8192)
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to("cuda:0").eval()
    report = {"engines": len(engines), "capacity_tokens": engines[0].capacity_tokens}
    prompt = S.render_prompt(tokenizer, "What is 17 * 23? Use Python to check.")

    def generate(req):
        async def go():
            return await engines[0].submit(req)
        return loop.run_until_complete(go())

    # 1. weight sync changes outputs, and syncing the original weights restores them
    greedy = S.GenRequest(prompt, 48, temperature=0.0)
    before = generate(greedy).token_ids
    original = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * p.float().std().to(p.dtype) * 0.5)
    S.sync_weights(engines, trainer)
    after = generate(greedy).token_ids
    trainer.load_state_dict(original)
    S.sync_weights(engines, trainer)
    restored = generate(greedy).token_ids
    report["sync_changes_output"] = after != before
    report["sync_restores_output"] = restored == before
    assert after != before and restored == before

    # 2. engine vs trainer log-probs of the same sampled tokens (temperature 1, top_p 1: the paper's setting)
    diffs = []
    for i in range(8):
        r = generate(S.GenRequest(prompt, 128, temperature=1.0, top_p=1.0, seed=i))
        ids = torch.tensor([prompt + r.token_ids], device="cuda:0")
        with torch.no_grad():
            logits = trainer(ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        diffs.append((lp.cpu() - torch.tensor(r.logprobs)).abs().mean().item())
    report["logprob_mean_abs_diff"] = sum(diffs) / len(diffs)
    assert report["logprob_mean_abs_diff"] < 0.02, report

    # 3. balance over the engines, and no engine ever reserved past its capacity
    peak = [0] * len(engines)
    for k, e in enumerate(engines):
        submit = e.submit

        def watched(req, e=e, k=k, submit=submit):
            fut = submit(req)
            peak[k] = max(peak[k], e.capacity_tokens - e.free_tokens())
            return fut
        e.submit = watched
    cfg = S.RolloutConfig(max_turns=4, max_response_tokens=2048)
    problems = [(f"p{i}", f"Compute the sum of the digits of {7 ** (50 + i)}.") for i in range(16 * len(engines))]
    groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 8, cfg, seed=0, loop=loop)
    tokens = [e.tokens_generated for e in engines]
    report["engine_tokens"] = tokens
    report["balance_max_over_mean"] = max(tokens) / (sum(tokens) / len(tokens))
    report["never_overfilled"] = all(p <= e.capacity_tokens for p, e in zip(peak, engines))
    report["finish"] = {r: sum(t.finish_reason == r for g in groups for t in g) for r in ("answer", "length", "turns", "error")}
    assert report["never_overfilled"] and report["finish"]["error"] == 0
    assert report["balance_max_over_mean"] < 1.25, report
    return report


def test_vllm_engines():
    print(check_all(os.environ.get("RSTAR2_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")))


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=os.environ.get("RSTAR2_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct"))
    parser.add_argument("--gpus", type=int, default=None, help="engines (default: every visible GPU)")
    a = parser.parse_args()
    if not (HAVE_CUDA and HAVE_VLLM):
        sys.exit("needs a CUDA GPU and vLLM (pip install -r requirements-gpu.txt)")
    print(json.dumps(check_all(a.model, a.gpus)))
