"""The learner's train step (`tasks.learn.Learner.train_step`) alone: time, throughput, memory, MFU.

Two sources of model and samples:

`--model DIR` (the default, models/smollm2-135m): the CPU figures of BENCHMARKS.md. A step of
`--prompts` arithmetic prompts (grpoflow.examples.envs:arith_rows through the model's chat template) x `--group`
completions of 8-32 random tokens; advantages +-1 (every sample trains) or, with `--zero-groups K`, K
groups with equal rewards (advantage 0). Fixed variants: `share_prompt` off/on (each prompt once: its
completions after it in one row with attention by segment, as one learner process runs it;
benchmarks/prompt_layouts.py times it against the KV cache layout), zero-advantage skipping off/on, one
shared-prompt variant per further `--micro-batch` size (a micro-batch larger than a group holds
several prompts, all in the one row), and `--updates 2x1 1x2` shared-prompt variants with several updates per batch
(algorithm.num_iterations x learner.mini_batches: what the extra passes and the pi_old forward cost
against one update). Only this path imports the Prefect-dependent modules (tasks.generate, for the
tokenizer and chat template).

`--random-model SIZE`: a randomly initialised model of a known shape, saved with `save_pretrained`
(bf16) to a temporary directory; needs torch and transformers only (no pydantic, Prefect, pyarrow,
Ray, network or model files), so it runs on a bare GPU machine. Sizes (`MODEL_SHAPES`):
  tiny  Qwen2 layout, hidden 64, 2 layers, vocab 2048: the unit test's CPU smoke run, no realism.
  135m  SmolLM2-135M's shape (Llama: hidden 576, 30 layers, 9/3 heads, 1536, vocab 49152, tied).
  0.5b  Qwen2.5-0.5B's shape (Qwen2: hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864,
        vocab 151936, tied embeddings; 494M parameters, 358M of them outside the embedding).
  1.5b  Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12/2 heads, 8960, vocab 151936, tied).
  3b    Qwen2.5-3B's shape (hidden 2048, 36 layers, 16/2 heads, 11008, vocab 151936, tied).
  7b    Qwen2.5-7B's shape (hidden 3584, 28 layers, 28/4 heads, 18944, vocab 152064, untied head).
The 0.5B-class sizes keep Qwen2.5's 151,936-token vocabulary rather than SmolLM2's 49,152 because
Qwen2.5-0.5B/1.5B are the usual GRPO models of that size, and at 0.5B the vocabulary is what makes the
LM head and its float32 [tokens, V] logits a large share of the step's FLOPs and memory (the head is
136M of the 494M parameters): a smaller vocabulary would flatter the learner. RoPE settings are left
at the library default (they cost no FLOPs). Samples: `--prompts` (8) prompts of random token ids with
lengths uniform in `--prompt-tokens` (100 200) x `--group` (8) completions of lengths uniform in
`--completion-tokens` (128 512), advantages alternating +1/-1, behaviour logprobs -2; no tokenizer.
Variants: the first value of every list option makes the baseline; each further value of
`--dtype`, `--share-prompt`, `--gradient-checkpointing` or `--micro-batch`, and each `--updates` spec,
adds one variant that differs from the baseline in that one thing. Gradient checkpointing turns
`share_prompt` off inside the Learner: both the requested and the effective flag are printed.

Config objects: `tasks.config`'s LearnerConfig / AlgorithmConfig when pydantic imports, else
`types.SimpleNamespace` objects with the same explicit values (`LEARNER_VALUES`, `ALGORITHM_VALUES`):
every attribute the learner (tasks/learner/learn.py, tasks/learner/grpo.py) reads; the model section carries the dtype
(`model_config`). The printed `configs` says which.

Each variant prints one JSON line. Time: the median over `--repeats` steps after one warm-up step,
measured around `train_step` with a CUDA synchronize on both sides. Memory: on CUDA
`torch.cuda.max_memory_allocated` (weights, AdamW state, activations, logits), reset before the
variant's Learner is built; on CPU the process's peak resident set size (`resource.getrusage`
ru_maxrss, RSS, not allocator bytes), reset per variant through /proc/self/clear_refs where Linux
allows it (`peak_memory_kind` says whether the figure is per variant or since the process started).

FLOPs (model FLOPs: what the update needs, not what the hardware ran; gradient-checkpointing's
recomputed forward and padding are not counted, so both lower the MFU). Per token forwarded with
gradient, PaLM's (Chowdhery et al. 2022, appendix B) 6N + 12 L H Q T, with
  N  the non-embedding parameters (everything but the input embedding and the LM head matrix),
  L H Q  layers x query heads x head dim (H Q = hidden size in these models; GQA shrinks only the K/V
     projections, which N already counts),
  T  taken per token as its causal context, the number of keys it attends to (prompt + its own
     position), where PaLM counts a full T x T score matrix: causal attention needs half of that, and
     per-token contexts make the count exact for share_prompt, where a completion token attends to a
     cached prompt that is not forwarded again;
plus the LM head, counted separately and only where the learner computes the logits the loss uses:
6 V d per completion token (2 V d forward, 4 V d backward; V vocabulary, d hidden size). The learner
runs the head on completion positions only (`logits_to_keep`; with share_prompt the prompt forward keeps
1 position, the one that predicts the first completion token). Tokens forwarded: with share_prompt each
distinct prompt of a micro-batch once plus every completion token; without, every sample's prompt and
completion; zero-advantage samples the learner skips are not forwarded. A forward without gradient
(pi_old, when num_iterations x mini_batches > 1) counts a third: 2N + 4 L H Q T per token, 2 V d per
completion token. MFU = FLOPs per step / seconds per step / the GPU's bf16 dense peak from
`PEAK_BF16_TFLOPS`, keyed on `torch.cuda.get_device_name()` (H100 SXM and H200: 989 TFLOP/s); null on
CPU and on GPUs not in the table. The same peak is used for float32 runs (which then read low). On a
CPU, `of_cpu_matmul_rate` divides the step's rate by `cpu_matmul_tflops`: a [1024, hidden] x
[hidden, intermediate] matmul (the model's MLP) in the step's dtype, timed for a second on the same
threads.

    .venv/bin/python benchmarks/learner.py [--model models/smollm2-135m] [--repeats 3] [--zero-groups 2]
        [--prompts 8 --micro-batch 8 16 32] [--updates 2x1 1x2]
    python benchmarks/learner.py --random-model 0.5b [--device cuda] [--dtype bfloat16 float32]
        [--share-prompt on off] [--gradient-checkpointing off on] [--micro-batch 8 16]
        [--prompts 8 --group 8 --prompt-tokens 100 200 --completion-tokens 128 512] [--repeats 3]
    .venv/bin/python benchmarks/learner.py --random-model tiny --device cpu --repeats 1   # smoke run
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# This folder's scripts (storage.py, inference.py, ...) must not shadow modules of those names.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
REPO = Path(__file__).resolve().parents[1]
import importlib.util
import types

if "grpoflow" not in sys.modules and importlib.util.find_spec("grpoflow") is None:  # a bare machine
    sys.modules["grpoflow"] = types.ModuleType("grpoflow")  # its folders are grpoflow's subpackages
    sys.modules["grpoflow"].__path__ = [str(REPO)]
# On CPU, OpenMP threads that spin while idle slow the learner (as in tasks/__init__.py); before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import gc
import json
import random
import resource
import statistics
import tempfile
import time
import types

# Random-model shapes: (architecture, vocab, hidden, layers, query heads, KV heads, MLP intermediate).
# Every one ties its input embedding and LM head, as the models they copy do.
MODEL_SHAPES: dict[str, tuple[str, int, int, int, int, int, int]] = {
    "tiny": ("qwen2", 2048, 64, 2, 4, 2, 128),
    "135m": ("llama", 49152, 576, 30, 9, 3, 1536),  # SmolLM2-135M
    "0.5b": ("qwen2", 151936, 896, 24, 14, 2, 4864),  # Qwen2.5-0.5B
    "1.5b": ("qwen2", 151936, 1536, 28, 12, 2, 8960),  # Qwen2.5-1.5B
    "3b": ("qwen2", 151936, 2048, 36, 16, 2, 11008),  # Qwen2.5-3B
    "7b": ("qwen2", 152064, 3584, 28, 28, 4, 18944),  # Qwen2.5-7B (its LM head untied)
}
UNTIED = {"7b"}  # shapes whose LM head is a matrix of its own, as their model's is

# --lora's target modules: tasks.config.LORA_TARGETS (the attention and MLP projections), restated here
# because the random-model path runs without pydantic (a bare GPU worker).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# bf16 dense tensor-core peak (TFLOP/s, no sparsity) by device name; the first key found in
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200 NVL": 835.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": 312.0,
}

# What the benchmark's learner runs with, stated once for both kinds of config object. The
# per-variant fields (micro-batching, share_prompt, checkpointing, device, updates) are set per variant.
LEARNER_VALUES = {
    "lr": 5e-6,
    "weight_decay": 0.0,
    "warmup_steps": 0,
    "lr_schedule": "constant",
    "max_grad_norm": 1.0,
    "torch_threads": None,  # torch's default
    "lora": None,  # full fine-tuning; --lora R trains a rank-R adapter instead
    "lm_head_chunk": None,  # the whole micro-batch's logits at once
}
ALGORITHM_VALUES = {
    "loss_type": "dapo",
    "epsilon": 0.2,
    "epsilon_high": None,  # = epsilon
    "beta": 0.0,  # no reference model
    "correction": "tis",
    "correction_cap": 2.0,
    "correction_low": None,
    "correction_high": None,
}


def make_configs(
    *,
    micro_batch_size: int,
    share_prompt: bool | None,
    gradient_checkpointing: bool = False,
    device: str = "auto",
    mini_batches: int = 1,
    num_iterations: int = 1,
    torch_threads: int | None = None,
    lora_rank: int | None = None,
    prefer_pydantic: bool = True,
    compile_layers: bool = False,
    lm_head_chunk: int | None = None,
):
    """(learner config, algorithm config, "pydantic" | "namespace"): tasks.config's classes when they
    import (pydantic present) and `prefer_pydantic`, else SimpleNamespaces with the same values."""
    learner = LEARNER_VALUES | {
        "micro_batch_size": micro_batch_size,
        "mini_batches": mini_batches,
        "share_prompt": share_prompt,
        "gradient_checkpointing": gradient_checkpointing,
        "device": device,
        "compile": compile_layers,  # learner.compile: the warm-up step compiles
        "lm_head_chunk": lm_head_chunk,
    }
    if torch_threads is not None:
        learner["torch_threads"] = torch_threads
    # A LoRA adapter as tasks.config.LoraConfig's defaults make it: alpha 2r, no dropout, the attention
    # and MLP projections.
    lora = None if lora_rank is None else {"rank": lora_rank, "alpha": 2.0 * lora_rank, "dropout": 0.0,
                                           "target_modules": list(LORA_TARGETS)}  # fmt: skip
    algorithm = ALGORITHM_VALUES | {"num_iterations": num_iterations}
    if prefer_pydantic:
        try:
            from grpoflow.tasks.config.algorithm import AlgorithmConfig
            from grpoflow.tasks.config.learner import LearnerConfig
        except ImportError:
            pass
        else:
            return (
                LearnerConfig(**learner | {"lora": lora}),
                AlgorithmConfig(**algorithm),
                "pydantic",
            )
    learner["lora"] = types.SimpleNamespace(**lora) if lora else None
    return types.SimpleNamespace(**learner), types.SimpleNamespace(**algorithm), "namespace"


def model_config(dtype: str, source: str):
    """The model section the learner reads its dtype from, of the same kind `make_configs` gave."""
    if source == "pydantic":
        from grpoflow.tasks.config.model import ModelConfig

        return ModelConfig(dtype=dtype)
    return types.SimpleNamespace(dtype=dtype)


# -- samples ---------------------------------------------------------------------------------------


def arith_samples(model_dir: str, prompts: int, group: int, zero_groups: int, seed: int = 0):
    """The `--model` path's step: chat-template arithmetic prompts, 8-32 random completion tokens."""
    from grpoflow.examples.envs import arith_rows
    from grpoflow.tasks.learner.learner_api import TrainSample
    from grpoflow.tasks.rollouts.templates import load_tokenizer, prompt_messages, render

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    out = []
    for g, row in enumerate(arith_rows(prompts, seed)):
        ids = tok.encode(render(tok, prompt_messages(row, g), None, True), add_special_tokens=False)
        for k in range(group):
            t = rng.randint(8, 32)
            adv = 0.0 if g < zero_groups else (1.0 if k % 2 == 0 else -1.0)
            comp = [rng.randrange(1000, len(tok) - 1) for _ in range(t)]
            out.append(TrainSample(ids + comp, len(ids), [1] * t, [-2.0] * t, adv))
    return out


def random_samples(
    vocab: int,
    prompts: int,
    group: int,
    prompt_tokens: tuple[int, int],
    completion_tokens: tuple[int, int],
    zero_groups: int = 0,
    seed: int = 0,
):
    """Random token prompts x `group` completions; lengths uniform in the (low, high) ranges."""
    from grpoflow.tasks.learner.learner_api import TrainSample

    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_tokens))]
        for k in range(group):
            t = rng.randint(*completion_tokens)
            adv = 0.0 if g < zero_groups else (1.0 if k % 2 == 0 else -1.0)
            comp = [rng.randrange(vocab) for _ in range(t)]
            out.append(TrainSample(ids + comp, len(ids), [1] * t, [-2.0] * t, adv))
    return out


def save_random_model(size: str, directory: Path, seed: int = 0, device: str = "cpu") -> None:
    """A randomly initialised causal LM of `MODEL_SHAPES[size]`, saved in bf16 to `directory` (built on
    `device`: a GPU initialises 1.5B parameters in a fraction of the CPU's time)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    arch, vocab, hidden, layers, heads, kv_heads, intermediate = MODEL_SHAPES[size]
    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=size not in UNTIED,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model


# -- FLOPs -----------------------------------------------------------------------------------------


def model_dims(model) -> dict[str, int]:
    """Parameter counts and the dimensions the FLOP count needs, read from a loaded model."""
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    params = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    embedding = emb.numel() + (0 if head is emb else head.numel())
    return {
        "params": params,
        "params_non_embedding": params - embedding,
        "layers": c.num_hidden_layers,
        "attn_width": heads * head_dim,
        "hidden": c.hidden_size,
        "intermediate": getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
        "vocab": c.vocab_size,
    }


def forward_cost(mb, share_prompt: bool, dims: dict[str, int]) -> tuple[float, int]:
    """(forward FLOPs, tokens forwarded) of one micro-batch, without padding (see the docstring)."""
    # A segment of n tokens after c0 cached or earlier ones: its tokens attend to c0+1 .. c0+n keys.
    if share_prompt:
        prompts = {tuple(s.input_ids[: s.prompt_len]) for s in mb}
        segments = [(0, len(p)) for p in prompts]
        segments += [(s.prompt_len, len(s.input_ids) - s.prompt_len) for s in mb]
    else:
        segments = [(0, len(s.input_ids)) for s in mb]
    tokens = sum(n for _, n in segments)
    contexts = sum(n * c0 + n * (n + 1) // 2 for c0, n in segments)
    completion = sum(len(s.input_ids) - s.prompt_len for s in mb)
    flops = (
        2 * dims["params_non_embedding"] * tokens
        + 4 * dims["layers"] * dims["attn_width"] * contexts
        + 2 * dims["vocab"] * dims["hidden"] * completion
    )
    return float(flops), tokens


def step_cost(learner, samples, dims: dict[str, int]) -> tuple[float, int]:
    """(model FLOPs, tokens forwarded) of one `train_step(samples)`: every update's forward + backward
    (3x a forward; 2x for LoRA, whose frozen base weights get no gradient: the adapter's own FLOPs are
    left out) on the micro-batches the learner forms, plus the no-grad pi_old forward of the parts
    after the first when the step takes several updates."""
    parts = learner.plan(samples)
    per_part = [[forward_cost(mb, learner.share_prompt, dims) for mb in p.micro] for p in parts]
    iterations = learner.algorithm.num_iterations
    passes = 2 if getattr(learner, "lora", None) is not None else 3
    flops = passes * iterations * sum(f for costs in per_part for f, _ in costs)
    tokens = iterations * sum(n for costs in per_part for _, n in costs)
    if iterations * len(parts) > 1:
        flops += sum(f for costs in per_part[1:] for f, _ in costs)
        tokens += sum(n for costs in per_part[1:] for _, n in costs)
    return flops, tokens


def cpu_matmul_tflops(dims: dict[str, int], dtype, rows: int = 1024, seconds: float = 1.0) -> float:
    """TFLOP/s of this CPU on the model's MLP matmul ([rows, hidden] x [hidden, intermediate], in
    the step's dtype, torch's own threads): what a CPU runs the step's matmuls at, measured, for want of a
    peak from a data sheet (oneDNN's kernel for the ISA the CPU has; the step's bound on this machine)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, dims["hidden"], generator=g).to(dtype)
    b = torch.randn(dims["hidden"], dims["intermediate"], generator=g).to(dtype)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * rows * dims["hidden"] * dims["intermediate"] * n / (time.perf_counter() - t0) / 1e12


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


# -- memory ----------------------------------------------------------------------------------------


def reset_peak_memory(device) -> str:
    """Start a variant's peak-memory window; returns what `peak_memory_mib` will measure."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_memory_allocated"
    try:  # Linux: writing 5 resets the peak RSS (VmHWM, and with it getrusage's ru_maxrss)
        Path("/proc/self/clear_refs").write_text("5")
        return "rss_peak_this_variant"
    except OSError:
        return "rss_peak_since_process_start"


def peak_memory_mib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- variants --------------------------------------------------------------------------------------


def legacy_variants(args) -> list[dict]:
    """The `--model` path's fixed sequence (the rows of BENCHMARKS.md's learner tables)."""
    first, *more = args.micro_batch
    skip = bool(args.zero_groups)
    rows = [(False, False, first), (True, False, first)] + ([(True, True, first)] if skip else [])
    rows += [(True, skip, n) for n in more]
    out = [{"share_prompt": s, "skip_zero_advantage": k, "micro_batch_size": n} for s, k, n in rows]
    for spec in args.updates:
        iterations, minis = (int(x) for x in spec.split("x"))
        out.append(
            {"share_prompt": True, "micro_batch_size": first, "skip_zero_advantage": skip}
            | _updates(iterations, minis)
        )
    return [{**_common(args), "num_iterations": 1, "mini_batches": 1} | v for v in out]


def one_change_variants(args) -> list[dict]:
    """The baseline (every list option's first value), then one variant per further value."""
    base = _common(args) | {
        "share_prompt": args.share_prompt[0] == "on",
        "skip_zero_advantage": True,
        "micro_batch_size": args.micro_batch[0],
        "num_iterations": 1,
        "mini_batches": 1,
    }
    out = [base]
    out += [base | {"dtype": d} for d in args.dtype[1:]]
    out += [base | {"share_prompt": s == "on"} for s in args.share_prompt[1:]]
    out += [base | {"gradient_checkpointing": g == "on"} for g in args.gradient_checkpointing[1:]]
    out += [base | {"micro_batch_size": n} for n in args.micro_batch[1:]]
    for spec in args.updates:
        out.append(base | _updates(*(int(x) for x in spec.split("x"))))
    return out


def _common(args) -> dict:
    return {"dtype": args.dtype[0], "gradient_checkpointing": args.gradient_checkpointing[0] == "on"}


def _updates(iterations: int, minis: int) -> dict:
    return {"num_iterations": iterations, "mini_batches": minis}


def run_variant(model_path: str, model_label: str, samples, v: dict, args) -> dict:
    import torch

    from grpoflow.tasks.learner.learn import Learner
    from grpoflow.tasks.learner.learner_api import LearnerRun

    learner_cfg, algorithm_cfg, source = make_configs(
        micro_batch_size=v["micro_batch_size"],
        share_prompt=v["share_prompt"],
        gradient_checkpointing=v["gradient_checkpointing"],
        device=args.device,
        mini_batches=v["mini_batches"],
        num_iterations=v["num_iterations"],
        torch_threads=v.get("threads"),
        lora_rank=args.lora,
        compile_layers=v.get("compile", False),
        lm_head_chunk=v.get("lm_head_chunk"),
    )
    auto = "cuda" if torch.cuda.is_available() else "cpu"  # as the Learner resolves "auto"
    memory_kind = reset_peak_memory(torch.device(auto if args.device == "auto" else args.device))
    learner = Learner(
        model_path, learner_cfg, algorithm_cfg, LearnerRun(total_steps=100),
        model=model_config(v["dtype"], source), skip_zero_advantage=v["skip_zero_advantage"],
    )  # fmt: skip
    cuda = learner.device.type == "cuda"
    secs = []
    for _ in range(args.repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        learner.train_step(samples)
        if cuda:
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
    seconds = statistics.median(secs[1:])
    dims = model_dims(learner.model)
    flops, forwarded = step_cost(learner, samples, dims)
    name = torch.cuda.get_device_name(learner.device) if cuda else None
    peak = peak_tflops(name)
    matmul = None if cuda else cpu_matmul_tflops(dims, learner.dtype)
    completion = sum(len(s.completion_mask) for s in samples)
    row = {
        "model": model_label,
        "device": str(learner.device),
        "device_name": name,
        "dtype": str(learner.dtype).removeprefix("torch."),
        "configs": source,
        "params": dims["params"],
        "params_non_embedding": dims["params_non_embedding"],
        "lora_rank": args.lora,
        "trainable_params": sum(p.numel() for p in learner.trainable),
        "vocab": dims["vocab"],
        "share_prompt_requested": v["share_prompt"],
        "share_prompt": learner.share_prompt,  # gradient checkpointing turns it off
        "gradient_checkpointing": v["gradient_checkpointing"],
        "skip_zero_advantage": learner.skip_zero_advantage,
        "micro_batch_size": v["micro_batch_size"],
        "num_iterations": v["num_iterations"],
        "mini_batches": v["mini_batches"],
        "micro_batches": sum(len(update.micro) for update in learner.plan(samples)),
        "samples": len(samples),
        "zero_advantage_samples": sum(1 for s in samples if not s.advantage),
        "prompt_tokens": sorted({s.prompt_len for s in samples}),
        "completion_tokens": completion,
        "forwarded_tokens": forwarded,
        "seconds_per_step": round(seconds, 4),
        "completion_tokens_per_s": round(completion / seconds, 1),
        "tokens_per_s": round(forwarded / seconds, 1),
        "step_tflop": float(f"{flops / 1e12:.4g}"),
        "achieved_tflops": float(f"{flops / seconds / 1e12:.4g}"),
        "peak_bf16_tflops": peak,
        "mfu": float(f"{flops / seconds / (peak * 1e12):.4g}") if peak else None,
        # on a CPU: the step's rate over this CPU's measured matmul rate in the step's dtype
        "cpu_matmul_tflops": float(f"{matmul:.4g}") if matmul else None,
        "of_cpu_matmul_rate": float(f"{flops / seconds / (matmul * 1e12):.4g}") if matmul else None,
        "peak_memory_mib": round(peak_memory_mib(learner.device), 1),
        "peak_memory_kind": memory_kind,
    }
    if "threads" in v:
        row |= {"world_size": 1, "threads_per_rank": v["threads"]}
    del learner
    return row


def run_sharded(model_path: str, samples, v: dict, args, base: dict) -> dict:
    """The baseline variant at `v["world_size"]` N > 1: N ranks (tasks.distributed.DistributedLearner)
    on a local Ray, each with threads // N torch threads. The model-derived fields (FLOPs, tokens, micro-
    batches) are the world-size-1 row's `base`: the update is the same; the time and the largest rank's
    peak memory are this run's. Needs Ray and pydantic (the CPU machine's environment)."""
    import ray

    from grpoflow.flows.processes.cluster import ray_cluster
    from grpoflow.tasks.config.run import ScaleConfig
    from grpoflow.tasks.learner.distributed import DistributedLearner
    from grpoflow.tasks.learner.learner_api import LearnerRun

    n = v["world_size"]
    threads = max(1, v["threads"] // n)
    learner_cfg, algorithm_cfg, source = make_configs(
        micro_batch_size=v["micro_batch_size"], share_prompt=v["share_prompt"],
        gradient_checkpointing=v["gradient_checkpointing"], device=args.device,
        mini_batches=v["mini_batches"], num_iterations=v["num_iterations"], torch_threads=threads,
    )  # fmt: skip
    learner_cfg = learner_cfg.model_copy(update={"world_size": n})
    with ray_cluster(ScaleConfig(ray_address="local", num_cpus=n * threads)):
        learner = DistributedLearner(
            model_path, learner_cfg, algorithm_cfg, LearnerRun(total_steps=100),
            model=model_config(v["dtype"], source), skip_zero_advantage=v["skip_zero_advantage"],
        )  # fmt: skip
        try:
            secs = []
            for _ in range(args.repeats + 1):
                t0 = time.perf_counter()
                learner.train_step(samples)
                secs.append(time.perf_counter() - t0)
            memory = ray.get([r.peak_memory_mib.remote() for r in learner.ranks])
        finally:
            learner.close()
    seconds = statistics.median(secs[1:])
    flops = base["achieved_tflops"] * base["seconds_per_step"] * 1e12
    peak = base["peak_bf16_tflops"]
    return base | {
        "device": learner.device,
        "world_size": n,
        "threads_per_rank": threads,
        "seconds_per_step": round(seconds, 4),
        "completion_tokens_per_s": round(base["completion_tokens"] / seconds, 1),
        "tokens_per_s": round(base["forwarded_tokens"] / seconds, 1),
        "achieved_tflops": float(f"{flops / seconds / 1e12:.4g}"),
        "mfu": float(f"{flops / seconds / (peak * 1e12):.4g}") if peak else None,
        "peak_memory_mib": round(max(memory), 1),
        "peak_memory_kind": "largest rank's peak (CUDA allocated, or RSS since the rank started)",
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="model directory (default models/smollm2-135m)")
    src.add_argument("--random-model", choices=sorted(MODEL_SHAPES), help="random weights of this shape")
    ap.add_argument("--prompts", type=int, help="prompts per step (default 4; random model 8)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[100, 200], metavar=("MIN", "MAX"))
    ap.add_argument("--completion-tokens", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8], help="sizes (the first for all)")
    ap.add_argument("--zero-groups", type=int, default=0, help="groups with advantage 0")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant (+1 warm-up)")
    ap.add_argument("--updates", nargs="*", default=[], help="extra ITERATIONSxMINI_BATCHES variants")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", nargs="+", choices=["auto", "bfloat16", "float32"], default=["auto"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    ap.add_argument("--share-prompt", nargs="+", choices=["on", "off"], help="random model only (default on)")
    ap.add_argument("--gradient-checkpointing", nargs="*", choices=["on", "off"],
                    help="alone: on; default off")  # fmt: skip
    ap.add_argument("--world-size", type=int, nargs="+",
                    help="the baseline at each of these learner world sizes (first: 1), ranks on a local Ray")  # fmt: skip
    ap.add_argument("--lora", type=int, metavar="RANK",
                    help="train a rank-RANK LoRA adapter (peft) in every variant; peak memory is the "
                    "process's, so compare LoRA with full fine-tuning in two runs")  # fmt: skip
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="with --world-size: torch threads in all, split evenly over the ranks")  # fmt: skip
    args = ap.parse_args(argv)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = ["off"]
    elif not args.gradient_checkpointing:
        args.gradient_checkpointing = ["on"]

    import torch  # noqa: F401  (after OMP_WAIT_POLICY is set)

    if args.world_size:
        if args.world_size[0] != 1 or args.updates or len(args.micro_batch) > 1:
            ap.error(
                "--world-size starts with 1 (the row the others compare with) and takes no other variants"
            )
        world_size_rows(args)
        return

    if args.random_model:
        args.share_prompt = args.share_prompt or ["on"]
        vocab = MODEL_SHAPES[args.random_model][1]
        samples = random_samples(
            vocab, args.prompts or 8, args.group, tuple(args.prompt_tokens),
            tuple(args.completion_tokens), args.zero_groups,
        )  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="learner-bench-") as tmp:
            save_random_model(args.random_model, Path(tmp))
            for v in one_change_variants(args):
                row = run_variant(tmp, f"random:{args.random_model}", samples, v, args)
                print(json.dumps(row), flush=True)
        return
    if args.share_prompt or len(args.dtype) > 1 or len(args.gradient_checkpointing) > 1:
        ap.error("--share-prompt and several --dtype / --gradient-checkpointing values need --random-model")
    model = args.model or str(REPO / "models" / "smollm2-135m")
    samples = arith_samples(model, args.prompts or 4, args.group, args.zero_groups)
    for v in legacy_variants(args):
        print(json.dumps(run_variant(model, model, samples, v, args)), flush=True)


def world_size_rows(args) -> None:
    """`--world-size 1 N ...`: the baseline variant at each world size, the same samples."""
    model = args.model or str(REPO / "models" / "smollm2-135m")
    with tempfile.TemporaryDirectory(prefix="learner-bench-") as tmp:
        if args.random_model:
            args.share_prompt = args.share_prompt or ["on"]
            v = {**one_change_variants(args)[0], "threads": args.threads}
            vocab = MODEL_SHAPES[args.random_model][1]
            samples = random_samples(vocab, args.prompts or 8, args.group, tuple(args.prompt_tokens),
                                     tuple(args.completion_tokens), args.zero_groups)  # fmt: skip
            save_random_model(args.random_model, Path(tmp))
            model, label = tmp, f"random:{args.random_model}"
        else:
            v = {**legacy_variants(args)[1], "threads": args.threads}  # shared prompt, as the runs train
            samples = arith_samples(model, args.prompts or 4, args.group, args.zero_groups)
            label = model
        base = run_variant(model, label, samples, v, args)
        print(json.dumps(base), flush=True)
        for n in args.world_size[1:]:
            print(json.dumps(run_sharded(model, samples, v | {"world_size": n}, args, base)), flush=True)


if __name__ == "__main__":
    main()
