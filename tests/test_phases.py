"""Paper scale, phase by phase (docs/memory.md "Phases"): the rollouts and the update take turns on the GPUs. The
trainer's sharded state waits in host memory while the engines generate (distributed.move_trainer), and nothing of a
finished phase stays allocated. Run here on CPU ranks (gloo) under torchrun, like tests/test_trainer.py's FSDP2
tests."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_trainer import torchrun  # noqa: E402


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
