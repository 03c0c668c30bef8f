"""Paper scale without a GPU (issue: the paper preset must fail fast, not fall back): which device a run trains
on, and the refusal, naming the cause, of a run that expects GPUs where torch sees none."""
import pytest

import model as models
from config import Config


def test_paper_preset_without_a_gpu_is_an_error_naming_the_cause(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(models.NoUsableGPU) as e:
        models.training_device(Config(preset="paper"))
    assert "--set device=cpu" in str(e.value)
    assert any(cause in str(e.value) for cause in ("CPU-only", "driver", "ROCm", "sees no GPU"))


def test_torchrun_ranks_expect_gpus_unless_cpu_is_said(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(models.NoUsableGPU):
        models.training_device(Config())
    assert models.training_device(Config(device="cpu")) == "cpu"   # CPU ranks on purpose (tests, CPU checks)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert models.training_device(Config()) == "cpu"               # the laptop: one process on the CPU


def test_a_gpu_is_used_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert models.training_device(Config()) == "cuda"
    assert models.training_device(Config(device="cpu")) == "cpu"
    with pytest.raises(ValueError):
        models.training_device(Config(device="tpu"))


def test_rank0_alone_reads_the_weights_and_the_optimizer_state(tmp_path, tiny_model_dir, tokenizer):
    """Under torchrun (2 CPU ranks on purpose, gloo): rank 0 reads the checkpoint, the others build the model on
    the meta device and receive their shards; the result equals the file (oracle: the model loaded plainly, its
    logits and its RoPE buffers). The optimizer state saved after an update comes back whole through rank 0
    alone: rank 1 never holds it (held_keys 0) and ends with the same full state."""
    import torch

    import scheduler
    from test_trainer import torchrun

    out = str(tmp_path / "load")
    torchrun("load", tiny_model_dir, out)
    r0, r1 = (torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1))
    plain = models.load_model(tiny_model_dir)
    want = plain.state_dict()
    assert set(r0["weights"]) <= set(want) and len(r0["weights"]) > 0
    for k, v in r0["weights"].items():
        assert torch.equal(v, want[k]), k
    plain.load_state_dict(r0["updated"], strict=False)  # the weights after the update: the logits' oracle
    ids = torch.tensor([scheduler.render_prompt(tokenizer, "What is 6*7?")[:24]])
    with torch.no_grad():
        ref = plain(input_ids=ids).logits
    for r in (r0, r1):
        assert torch.allclose(r["logits"], ref, atol=1e-5), (r["logits"] - ref).abs().max()
        for name, buf in models.load_model(tiny_model_dir).named_buffers():
            assert torch.equal(r["buffers"][name], buf), name
    assert r0["held_keys"] > 0 and r1["held_keys"] == 0
    assert (r0["step"], r0["cursor"]) == (r1["step"], r1["cursor"]) == (3, 17)
    saved, back = r0["optimizer"]["state"], r0["reloaded"]["state"]
    assert saved.keys() == back.keys() and len(saved) > 0
    for k in saved:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[k][name], back[k][name]), (k, name)
