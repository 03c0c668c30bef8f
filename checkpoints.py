"""checkpoints.py - resumable training state for the SFT (sft.py) and the RL stages (rstar2_mini.py), written so
that a run killed at any moment continues exactly (paper section 4: multi-hour stages; here Ctrl-C on a laptop).

    run_dir/checkpoints/step_000010/   a Hugging Face model directory (loadable on its own: evaluate it, start
                                       the next stage from it) + tokenizer + trainer_state.pt (optimizer, lr
                                       schedule, RNG states, data cursor, loss history, config)
    run_dir/checkpoints/latest         the name of the newest complete checkpoint

Every directory is written under a temporary name and renamed into place (atomic_dir); the pointer `latest` is
replaced with os.replace after its checkpoint is complete. A kill at any moment leaves `latest` naming a complete
checkpoint, and never a half-written directory under a final name. The last `keep` checkpoints are kept.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path


def rng_state() -> dict:
    """Every global random state the training code draws from (Python, NumPy, torch)."""
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yields an empty temporary directory next to `final`; when the block ends without an error it takes
    final's name (an older `final` is moved aside first and then deleted). A temporary left by a killed write
    is removed by the next write of the same name."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir()
    yield tmp
    if final.exists():
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def save_model(out_dir: Path, model, tokenizer, weights=None, trainer_state: dict | None = None,
               json_files: dict | None = None) -> Path:
    """save_pretrained + the tokenizer (+ trainer_state.pt, + {name: object} as JSON files) into out_dir,
    atomically. weights: the full state dict when the model itself is sharded (FSDP), else None."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        if trainer_state is not None:
            import torch

            torch.save(trainer_state, tmp / "trainer_state.pt")
        for name, obj in (json_files or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=1, default=str))
    return Path(out_dir)


def save_checkpoint(run_dir: Path, model, tokenizer, trainer_state: dict, keep: int = 2, weights=None) -> Path:
    """run_dir/checkpoints/step_{trainer_state['step']}, then the `latest` pointer, then older ones pruned."""
    ckpts = Path(run_dir) / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    name = f"step_{trainer_state['step']:06d}"
    final = save_model(ckpts / name, model, tokenizer, weights, trainer_state)
    pointer = ckpts / "latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, ckpts / "latest")
    for old in sorted(p for p in ckpts.glob("step_*") if p.name != name)[:-(keep - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = Path(run_dir) / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").exists() else None


def load_weights(model, ckpt: Path) -> None:
    """Copy a checkpoint's safetensors weights into `model` in place, one tensor at a time (no second model in
    memory). Every parameter must be found, except those tied to one that is (the output projection of a model
    with tied embeddings, which save_pretrained stores once)."""
    import torch
    from safetensors import safe_open

    params = model.state_dict()
    files = sorted(Path(ckpt).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt} holds no *.safetensors weights")
    loaded = set()
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key not in params:
                        raise KeyError(f"{f}: {key} is not a parameter of this model")
                    params[key].copy_(st.get_tensor(key))
                    loaded.add(key)
    filled = {params[k].data_ptr() for k in loaded}
    missing = [k for k in params if k not in loaded and params[k].data_ptr() not in filled]
    if missing:
        raise KeyError(f"{ckpt} lacks {len(missing)} weights of this model, e.g. {missing[:3]}")
