"""Paper scale, phase by phase (docs/memory.md "Phases"): the rollouts and the update take turns on the GPUs. The
trainer's sharded state waits in host memory while the engines generate (distributed.move_trainer), and nothing of a
finished phase stays allocated. Run here on CPU ranks (gloo) under torchrun, like tests/test_trainer.py's FSDP2
tests."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_trainer import tool_model_dir, torchrun  # noqa: E402,F401  (a fixture, and 2 CPU ranks under torchrun)


def test_the_trainers_state_to_host_and_back_leaves_training_exactly_as_it_was(tmp_path, tiny_model_dir):
    """Two FSDP2 updates on two gloo ranks, once with the sharded weights and AdamW moments sent to host memory and
    back between them: bitwise the same weights, optimizer state and update numbers as without the round trip
    (oracle: the run that never moved). The move really happened: every shard and moment was in new storage on the
    way out and again on the way back."""
    torchrun("offload", tiny_model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    plain, moved = got[False], got[True]
    assert moved["moved_away"] and moved["moved_back"]
    assert plain["numbers"] == moved["numbers"]
    assert plain["weights"].keys() == moved["weights"].keys()
    for k in plain["weights"]:
        assert torch.equal(plain["weights"][k], moved["weights"][k]), k
    for k, s in plain["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(moved["optimizer"]["state"][k][name])), (k, name)


def test_rl_steps_with_the_trainer_offloaded_between_updates_equal_steps_without(tmp_path, tool_model_dir):
    """Two RL steps of rstar2_mini.train_stage on two gloo ranks, rollouts on rank 0, a checkpoint every step: with
    offload_trainer (the state in host memory during rollouts, back for each update and each checkpoint's gather,
    phases.py) the checkpoints hold bitwise the weights and optimizer state of the run without it, and the steps'
    losses are the same. The offload's switches are logged (metrics.jsonl)."""
    import json

    import model as models
    import rstar2_mini as R

    torchrun("stage", tool_model_dir, tmp_path / "plain", 2)
    torchrun("stage", tool_model_dir, tmp_path / "offload", 2, "offload")
    runs = {}
    for name in ("plain", "offload"):
        d = tmp_path / name / "stage1"
        ckpt = R.latest_checkpoint(d)
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (torch.load(ckpt / "trainer_state.pt", weights_only=False),
                      models.load_model(ckpt).state_dict(), lines)
    (s0, w0, m0), (s1, w1, m1) = runs["plain"], runs["offload"]
    assert s0["step"] == s1["step"] == 2
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    for k, st in s0["optimizer"]["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s1["optimizer"]["state"][k][name])), (k, name)
    assert [x.get("loss") for x in m0] == [x.get("loss") for x in m1]
    assert any(x.get("loss") is not None for x in m1)   # the steps trained
    assert any("trainer_to_host_s" in x for x in m1) and not any("trainer_to_host_s" in x for x in m0)
