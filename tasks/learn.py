"""The learner: policy model, optimizer, LR schedule, GRPO train step, resumable checkpoints.

`Learner.train_step(batch)` recomputes the policy's logprobs on the completion tokens, applies the
loss from `tasks/grpo.py` with the masks, and steps. Masked samples (invalid reward, dropped group,
stale) never reach the forward pass: they would contribute nothing but cost compute.

A Learner built inside an initialised `torch.distributed` process group of N > 1 ranks is one rank
of a sharded learner (tasks/distributed.py starts them): its model is sharded with FSDP2
(`fully_shard` per decoder layer, then the whole model), every rank plans the step from the whole
batch (so the loss normalisers are the global ones) and runs its share of the micro-batches, and the
gradients are summed over ranks, so the update is the one a single process makes.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.grpo import compute_loss

if TYPE_CHECKING:  # the learner runs with torch and transformers alone (a bare GPU worker)
    from storage.records import RolloutGroup
    from tasks.config import AlgorithmConfig, LearnerConfig


@dataclass
class TrainSample:
    """One completion ready for the loss: prompt + completion tokens and aligned masks."""

    input_ids: list[int]  # [P + T]
    prompt_len: int  # P
    completion_mask: list[int]  # [T]
    behaviour_logprobs: list[float]  # [T]
    advantage: float


def samples_from_groups(groups: list[RolloutGroup]) -> list[TrainSample]:
    """Completions marked `trained` (valid, fresh, in a group with signal), in batch order."""
    out = []
    for g in groups:
        for c in g.completions:
            if not c.trained or not any(c.completion_mask):
                continue
            prompt_ids = g.prompt_ids_of(c)  # its own prompt: reset notes may differ per sample
            out.append(
                TrainSample(
                    input_ids=list(prompt_ids) + list(c.completion_ids),
                    prompt_len=len(prompt_ids),
                    completion_mask=list(c.completion_mask),
                    behaviour_logprobs=list(c.logprobs),
                    advantage=float(c.advantage),
                )
            )
    return out


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float):
    """log p(x_t | x_<t) for t >= 1, shape [B, L-1]; logits scaled by the sampling temperature,
    because vLLM reports processed (post-temperature) logprobs and the ratio must compare like with like."""
    return _logprobs_from(model, input_ids, attention_mask, temperature, first=0)


def _logprobs_from(model, input_ids, attention_mask, temperature: float, first: int) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) for positions t = first .. L-2, shape [B, L-1-first].

    The LM head runs only on positions >= `first` (transformers' `logits_to_keep`): prompt positions
    need no logits, and on a 49k vocabulary the head and its [B, L, V] float32 logits are a large
    share of a CPU train step."""
    L = input_ids.shape[1]
    kwargs = {"logits_to_keep": L - first} if first > 0 and _takes_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
    return _picked_logprobs(logits[:, -(L - first) : -1], input_ids[:, first + 1 :], temperature)


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-softmax of temperature-scaled float32 logits [B, T, V] at `targets` [B, T]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # gather - logsumexp avoids materialising a full [B, T, V] log_softmax copy.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _takes_logits_to_keep(model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


@dataclass
class _Part:
    """The samples of one optimizer step: micro-batches of the ones that run, and the normalisers."""

    micro: list[list[TrainSample]]
    sequences: int  # every sample of the part, zero-advantage ones included
    tokens: int
    skipped: int  # zero-advantage samples left out of the forward

    @property
    def work_samples(self) -> int:
        return sum(len(mb) for mb in self.micro)


def _split(samples: list[TrainSample], k: int) -> list[list[TrainSample]]:
    """`samples` in order, cut into min(k, len) near-equal parts."""
    n = len(samples)
    k = min(k, n)
    return [samples[i * n // k : (i + 1) * n // k] for i in range(k)]


# Per-iteration metrics in the steps table (train/iter<i>/<name>) when algorithm.num_iterations > 1.
ITERATION_METRICS = (
    "loss",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clip_frac_low",
    "clip_frac_high",
    "policy_kl",
)


def _fold(pieces: list[tuple[float, float, dict[str, float]]], plain: tuple[str, ...]) -> dict[str, float]:
    """Several pieces' metrics as one: minima and maxima over all pieces; every other metric a sum
    weighted per piece, by its `plain` weight for the keys in `plain`, else by its sample weight.
    Micro-batches of one update: the loss (normalised over the whole update already) sums (plain 1),
    statistics average by samples. Updates of one step: the loss and grad norm average per update,
    statistics by samples."""
    out: dict[str, float] = {}
    for weight, plain_weight, m in pieces:
        for k, v in m.items():
            if v is None or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            elif k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v * (plain_weight if k in plain else weight)
    return out


def _combine(updates: list[tuple[int, int, dict[str, float]]]) -> dict[str, float]:
    """The step's metrics from its updates' (iteration, samples run, metrics); an update that ran no
    sample (all advantages 0) weighs as much as any when none ran."""
    total = sum(n for _, n, _ in updates)
    per = 1 / len(updates)
    return _fold([(n / total if total else per, per, m) for _, n, m in updates], ("loss", "grad_norm"))


@dataclass
class StepRun:
    """What one train step's updates leave for the metrics (of one rank, or merged over ranks):
    per update (iteration, samples run, metrics), the step's completion tokens, zero-advantage samples
    left out, and the learning rate its first update ran at."""

    updates: list[tuple[int, int, dict[str, float]]]
    tokens: int
    skipped: int
    lr: float


def merge_ranks(runs: list[StepRun]) -> StepRun:
    """The ranks' runs of one step as one: each rank's metrics of an update are its share of the
    weighted sums (its micro-batches weighed against the whole update), so they add up; minima and
    maxima combine; the gradient norm is global already (every rank holds the same)."""
    first = runs[0]
    updates = []
    for u, (it, n, m) in enumerate(first.updates):
        merged = _fold([(1.0, 1.0, r.updates[u][2]) for r in runs], ())
        merged["grad_norm"] = m["grad_norm"]
        updates.append((it, n, merged))
    return StepRun(updates, first.tokens, first.skipped, first.lr)


def step_metrics(run: StepRun, samples: int, iterations: int, seconds: float) -> dict[str, float]:
    """The steps table's train/ metrics of one step."""
    metrics = {"train/samples": float(samples)}
    metrics.update({f"train/{k}": v for k, v in _combine(run.updates).items()})
    if iterations > 1:
        for it in range(iterations):
            per = _combine([u for u in run.updates if u[0] == it])
            metrics.update({f"train/iter{it}/{k}": per[k] for k in ITERATION_METRICS if k in per})
    metrics.update(
        {
            "train/skipped_zero_advantage": float(run.skipped),
            "train/optimizer_steps": float(len(run.updates)),
            "train/grad_norm_max": max(m["grad_norm"] for _, _, m in run.updates),
            "train/lr": run.lr,
            "train/tokens": float(run.tokens),
            "train/tokens_per_s": run.tokens / seconds if seconds > 0 else 0.0,
            "train/seconds": seconds,
        }
    )
    return metrics


def _process_group() -> tuple[int, int]:
    """(rank, world size) of this process's torch.distributed group; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_weights(model, directory: Path) -> None:
    """What vLLM's reload needs from an unsharded model: the safetensors weights (+ config.json, so
    the dir is a model dir). A tied parameter (lm_head = embed_tokens) is written once."""
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            tensors[name] = t.detach()
    write_safetensors(tensors, Path(directory) / "model.safetensors")
    (Path(directory) / "config.json").write_text(model.config.to_json_string())


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` as a safetensors file (an 8-byte little-endian header length, a JSON header of dtype,
    shape and byte offsets, then the tensors' bytes in order), written from each tensor's memory (a GPU
    tensor is copied to the CPU just before its turn). An existing file is overwritten in place, not
    replaced: a push recycles the oldest version's directory, and rewriting pages the filesystem
    already holds took a SmolLM2 file 0.07-0.15 s where a new file took 0.16-0.64 s (BENCHMARKS.md),
    which the library's writer (it always creates the file anew) cannot do."""
    import struct

    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # transformers checks the format
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "r+b" if Path(path).is_file() else "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in tensors.values():
            t = t.detach().to("cpu").contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        f.truncate()


def _aliases(model) -> list[str]:
    """Names of parameters that are another parameter under a second name (tied embeddings)."""
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append(name)
        seen.add(id(p))
    return out


def _shard(model, device: torch.device, world_size: int) -> None:
    """FSDP2 over the process group: each decoder layer (transformers' `_no_split_modules`) is a
    unit of its own, so one layer's full parameters exist at a time, then the rest of the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _one_process_dcp(world_size: int):
    """torch.distributed.checkpoint in one process warns that it assumes one process, which is meant."""
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    if world_size == 1:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
    return stack


# The optimizer's state in a checkpoint: torch.distributed.checkpoint shards, loadable at any world size.
OPTIMIZER_DIR = "optimizer"


class Learner:
    """Holds the policy (and optional frozen reference), optimizer and schedule.

    Takes its own config sections: `learner` (optimisation, device, micro-batching) and `algorithm`
    (the loss); the rest is what the learner cannot know alone: the sampling temperature (logprobs must
    be computed at the temperature vLLM sampled at), the run's length for the LR schedule, the token
    budget for dr_grpo's normaliser, and where the reference model and tokenizer live."""

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        *,
        total_steps: int,
        temperature: float = 1.0,
        max_completion_length: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        ref_model_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        skip_zero_advantage: bool = True,
    ):
        if learner.torch_threads:
            torch.set_num_threads(learner.torch_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size = _process_group()
        self.config, self.algorithm = learner, algorithm
        self.temperature, self.max_completion_length = temperature, max_completion_length
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self._load_models(learner.device, dtype, ref_model_path or model_path)
        # The schedule counts optimizer steps: every training step takes num_iterations x mini_batches.
        self._make_optimizer(total_steps * algorithm.num_iterations * learner.mini_batches)
        self.micro_batch_size = learner.micro_batch_size
        self.pad_id = self.model.config.pad_token_id or 0
        self.skip_zero_advantage = skip_zero_advantage and self.ref_model is None
        # Completions of one group share their prompt: its forward runs once and its KV cache is
        # repeated for the group (gradients flow through it), instead of once per completion. Pays
        # once the model is big enough for FLOPs, not per-call overhead, to dominate (None: auto).
        big = self.num_parameters >= 20_000_000
        share = big if learner.share_prompt is None else learner.share_prompt
        self.share_prompt = share and not learner.gradient_checkpointing

    def _load_models(self, device: str, dtype: str, ref_path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":  # a rank's own GPU (Ray gives each rank one, as device 0)
            device = f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.aliases = _aliases(self.model)  # left out of gathered full weights
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.ref_model = None
        if self.algorithm.beta > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=self.dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        if self.world_size > 1:
            for model in filter(None, (self.model, self.ref_model)):
                _shard(model, self.device, self.world_size)

    def _make_optimizer(self, total_steps: int) -> None:
        """AdamW and transformers' LR schedule (linear warm-up from 0, then constant/linear/cosine)."""
        from transformers import get_scheduler

        c = self.config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        name = {"constant": "constant_with_warmup"}.get(c.lr_schedule, c.lr_schedule)
        self.scheduler = get_scheduler(
            name, self.optimizer, num_warmup_steps=c.warmup_steps, num_training_steps=total_steps
        )

    # -- training ---------------------------------------------------------------------------

    def _collate(self, samples: list[TrainSample]):
        """Right-padded inputs plus [B, T] completion-aligned masks/logprobs and gather indices into
        the logprob grid, which starts at the first position that predicts a completion token."""
        L = max(len(s.input_ids) for s in samples)
        T = max(len(s.completion_mask) for s in samples)
        B = len(samples)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, T))
        behav = torch.zeros((B, T))
        first = min(s.prompt_len for s in samples) - 1
        index = torch.zeros((B, T), dtype=torch.long)  # position in the [B, L-1-first] logprob grid
        for i, s in enumerate(samples):
            n, t = len(s.input_ids), len(s.completion_mask)
            ids[i, :n] = torch.tensor(s.input_ids)
            attn[i, :n] = 1
            mask[i, :t] = torch.tensor(s.completion_mask, dtype=torch.float)
            behav[i, :t] = torch.tensor(s.behaviour_logprobs, dtype=torch.float)
            # completion token j sits at input position P+j and is predicted from position P+j-1
            index[i, :t] = torch.arange(s.prompt_len - 1 - first, s.prompt_len - 1 - first + t)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float)
        dev = self.device
        tensors = ids.to(dev), attn.to(dev), mask.to(dev), behav.to(dev), index.to(dev), adv.to(dev)
        return first, tensors

    def _completion_logprobs(self, model, ids, attn, index, first: int):
        lp = _logprobs_from(model, ids, attn, self.temperature, first)
        return lp.gather(1, index)

    def _micro_batch(self, model, mb: list[TrainSample]):
        """Completion logprobs [B, T] and the loss tensors of one micro-batch."""
        if self.share_prompt:
            return self._shared_prompt_logprobs(model, mb)
        first, (ids, attn, mask, behav, index, adv) = self._collate(mb)
        return self._completion_logprobs(model, ids, attn, index, first), mask, behav, adv

    def _shared_prompt_logprobs(self, model, mb: list[TrainSample]):
        """Like `_micro_batch`, with each distinct prompt of the micro-batch run once: the prompts
        (batch k) are left-padded to one length, with position ids counting from each prompt's first
        real token; each completion continues its prompt's KV cache row (gradients flow through it).
        The result is the padded full-sequence forward's (causal attention: a prompt's states ignore
        what follows; padding is masked out)."""
        rows: dict[tuple[int, ...], int] = {}
        which = [rows.setdefault(tuple(s.input_ids[: s.prompt_len]), len(rows)) for s in mb]
        prompts = list(rows)
        P, B = max(len(p) for p in prompts), len(mb)
        T = max(len(s.completion_mask) for s in mb)
        dev = self.device
        comp = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask, behav = torch.zeros((B, T)), torch.zeros((B, T))
        for i, s in enumerate(mb):
            t = len(s.completion_mask)
            comp[i, :t] = torch.tensor(s.input_ids[s.prompt_len :])
            mask[i, :t] = torch.tensor(s.completion_mask, dtype=torch.float)
            behav[i, :t] = torch.tensor(s.behaviour_logprobs, dtype=torch.float)
        head_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        head_attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for j, p in enumerate(prompts):
            head_ids[j, P - len(p) :] = torch.tensor(p)
            head_attn[j, P - len(p) :] = 1
        comp, index = comp.to(dev), torch.tensor(which, device=dev)
        ragged = any(len(p) != P for p in prompts)
        head_kw, tail_kw = {}, {}
        if ragged:  # equal lengths need no mask and count positions from 0 already
            lengths = torch.tensor([len(p) for p in prompts], device=dev)
            head_attn = head_attn.to(dev)
            head_kw = {"attention_mask": head_attn, "position_ids": (head_attn.cumsum(-1) - 1).clamp(min=0)}
            # Right padding after a completion's real tokens: causal attention keeps it out of them.
            tail_attn = torch.cat([head_attn[index], torch.ones((B, T), dtype=torch.long, device=dev)], 1)
            positions = lengths[index, None] + torch.arange(T, device=dev)
            tail_kw = {"attention_mask": tail_attn, "position_ids": positions}
        head = model(input_ids=head_ids.to(dev), use_cache=True, logits_to_keep=1, **head_kw)
        cache = head.past_key_values
        cache.batch_select_indices(index)  # prompt row -> one row per completion
        tail = model(input_ids=comp, past_key_values=cache, use_cache=True, **tail_kw).logits
        logits = torch.cat([head.logits[index, -1:], tail[:, :-1]], dim=1)
        adv = torch.tensor([s.advantage for s in mb], dtype=torch.float, device=dev)
        return _picked_logprobs(logits, comp, self.temperature), mask.to(dev), behav.to(dev), adv

    def _micro_batches(self, work: list[TrainSample]) -> list[list[TrainSample]]:
        n = self.micro_batch_size
        if not self.share_prompt:
            # Similar lengths share a micro-batch: less padding (the update is a sum, order-free).
            work = sorted(work, key=lambda s: (len(s.input_ids), s.prompt_len))
            return [work[i : i + n] for i in range(0, len(work), n)]
        # A group's completions stay together (one prompt row each), groups of similar prompt
        # lengths share a micro-batch (less padding), and small groups fill one micro-batch together.
        groups: dict[tuple[int, ...], list[TrainSample]] = {}
        for s in work:
            groups.setdefault(tuple(s.input_ids[: s.prompt_len]), []).append(s)
        work = [s for p in sorted(groups, key=len) for s in groups[p]]
        return [work[i : i + n] for i in range(0, len(work), n)]

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Update on one generation batch: `algorithm.num_iterations` passes, each split into
        `learner.mini_batches` optimizer steps, each micro-batched with gradient accumulation.

        With more than one update the policy's logprobs before the first update (pi_old) are kept for
        the ratio: the first part's come from its own first forward (nothing has moved yet), the other
        parts' from one no-grad forward before the first step. One update: the ratio is 1 and no extra
        forward runs."""
        t0 = time.perf_counter()
        if not samples:
            return {"train/samples": 0.0, "train/skipped": 1.0, "train/seconds": time.perf_counter() - t0}
        run = self.run_updates(samples)
        return step_metrics(run, len(samples), self.algorithm.num_iterations, time.perf_counter() - t0)

    def run_updates(self, samples: list[TrainSample]) -> StepRun:
        """The updates of `train_step` (on a rank of a sharded learner: this rank's share of them)."""
        self.optimizer.zero_grad(set_to_none=True)
        parts = [self._plan(part) for part in _split(samples, self.config.mini_batches)]
        iterations = self.algorithm.num_iterations
        old = self._old_logprobs(parts) if iterations * len(parts) > 1 else None
        refs: dict[tuple[int, int], torch.Tensor] = {}
        updates: list[tuple[int, int, dict[str, float]]] = []  # (iteration, work samples, metrics)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate the step's first update runs at
        for it in range(iterations):
            for j, part in enumerate(parts):
                self.optimizer.zero_grad(set_to_none=True)
                m = self._accumulate(part, j, old, refs)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
                m["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
                self.scheduler.step()
                updates.append((it, part.work_samples, m))
        return StepRun(updates, sum(p.tokens for p in parts), sum(p.skipped for p in parts), lr)

    def _local(self, part: _Part) -> list[tuple[list[TrainSample], bool]]:
        """This rank's micro-batches of a part, each with whether it counts: micro-batch i goes to rank
        i mod N, and a rank with one fewer runs a one-sample copy whose loss is multiplied by 0, because
        every rank must run as many forwards and backwards as the others (FSDP gathers each layer's
        parameters from all ranks in each)."""
        n, w = len(part.micro), self.world_size
        if w == 1:
            return [(mb, True) for mb in part.micro]
        rounds = -(-n // w)
        return [
            (part.micro[i], True) if i < n else (part.micro[0][:1], False)
            for i in (k * w + self.rank for k in range(rounds))
        ]

    def _plan(self, samples: list[TrainSample]) -> _Part:
        """One optimizer step's samples, micro-batched, with the normalisers of all of them.

        With no KL term a zero-advantage sample's loss and gradient are exactly 0 (every loss type
        multiplies each token by its advantage), so it skips the forward/backward but still counts in
        the normalisers: the update is the one all the samples give."""
        work = [s for s in samples if s.advantage != 0.0] if self.skip_zero_advantage else samples
        tokens = int(sum(sum(s.completion_mask) for s in samples))
        return _Part(self._micro_batches(work), len(samples), tokens, len(samples) - len(work))

    @torch.no_grad()
    def _old_logprobs(self, parts: list[_Part]) -> dict[tuple[int, int], torch.Tensor]:
        """pi_old of every micro-batch but the first part's (their own first forward gives those),
        keyed (part, micro-batch); the same micro-batches as the updates, so the values match."""
        return {
            (j, k): self._micro_batch(self.model, mb)[0]
            for j, part in enumerate(parts[1:], start=1)
            for k, (mb, _) in enumerate(self._local(part))
        }

    def _accumulate(self, part: _Part, j: int, old: dict | None, refs: dict) -> dict[str, float]:
        """Forward + backward of one part's micro-batches (gradients add up); its loss metrics."""
        pieces = []
        for k, (mb, counts) in enumerate(self._local(part)):
            logprobs, mask, behav, adv = self._micro_batch(self.model, mb)
            old_lp = None
            if old is not None:  # several updates: pi_old is kept; the first forward of all provides it
                old_lp = old.setdefault((j, k), logprobs.detach())
            ref = None
            if self.ref_model is not None:
                if (j, k) not in refs:
                    with torch.no_grad():
                        refs[(j, k)] = self._micro_batch(self.ref_model, mb)[0]
                ref = refs[(j, k)]
            loss, m = compute_loss(
                logprobs,
                behav,
                adv,
                mask,
                self.algorithm,
                old_logprobs=old_lp,
                ref_logprobs=ref,
                max_completion_length=self.max_completion_length,
                total_sequences=part.sequences,
                total_tokens=part.tokens,
            )
            # A sharded learner's gradients are averaged over ranks (FSDP's reduce-scatter): x N sums them.
            (loss * self.world_size if counts else loss * 0.0).backward()
            if counts:
                pieces.append((len(mb) / part.work_samples, 1.0, m))
        if not part.micro:
            # All advantages 0: the loss and gradient are 0, and Adam still steps on its moments.
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            return {"loss": 0.0}
        return _fold(pieces, ("loss",))

    def close(self) -> None:
        """Nothing to release: the model lives in this process (`PolicyLearner.close`)."""

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write the model (a complete model dir: safetensors, config, tokenizer), the optimizer (in
        torch.distributed.checkpoint format, which loads at any world size), the schedule and the RNG
        state into `directory`. Every rank of a sharded learner calls it; rank 0 writes the rest."""
        from transformers import AutoTokenizer

        directory = Path(directory)
        if self.world_size == 1:
            self.model.save_pretrained(directory / "model", safe_serialization=True)
        else:
            self.write_weights(directory / "model")
        self._save_optimizer(directory / OPTIMIZER_DIR)
        if self.rank != 0:
            return
        # The checkpoint's model dir is a complete model dir: vLLM and resume can load it alone.
        AutoTokenizer.from_pretrained(self.tokenizer_path).save_pretrained(directory / "model")
        torch.save(
            {
                "scheduler": self.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "world_size": self.world_size,
            },
            directory / "trainer_state.pt",
        )
        (directory / "learner.json").write_text(json.dumps({"tokenizer": self.tokenizer_path}))

    def write_weights(self, directory: Path) -> None:
        """The full weights as a model dir vLLM's reload and `from_pretrained` take (model.safetensors
        + config.json). A sharded learner gathers them one parameter at a time onto rank 0's CPU (the
        only full copy) and rank 0 writes; every rank calls it."""
        directory = Path(directory)
        if self.world_size == 1:
            save_weights(self.model, directory)
            return
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            for name in self.aliases:
                full.pop(name, None)
            write_safetensors(full, directory / "model.safetensors")
            (directory / "config.json").write_text(self.model.config.to_json_string())
        del full
        dist.barrier()  # the files exist once every rank returns

    def _save_optimizer(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(self.model, self.optimizer)
        with _one_process_dcp(self.world_size):
            dcp.save({"optimizer": state}, checkpoint_id=str(directory), no_dist=self.world_size == 1)

    def load_trainer_state(self, directory: Path) -> None:
        """Restore optimizer, scheduler and RNG from a checkpoint written by `save`, at this learner's
        world size whatever the writer's was (every rank calls it).

        The weights themselves are loaded by constructing the Learner on `directory / "model"`, so
        tied or renamed parameters go through transformers' own loading logic.
        """
        directory = Path(directory)
        trainer = torch.load(directory / "trainer_state.pt", weights_only=False)
        if (directory / OPTIMIZER_DIR).is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (
                get_optimizer_state_dict,
                set_optimizer_state_dict,
            )

            # The template (each rank's shard of every state tensor) is filled from the saved shards.
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            with _one_process_dcp(self.world_size):
                dcp.load(state, checkpoint_id=str(directory / OPTIMIZER_DIR), no_dist=self.world_size == 1)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        else:  # a checkpoint from before the optimizer went into DCP: one process's state dict
            if self.world_size > 1:
                raise ValueError(
                    f"{directory} holds a single-process optimizer state (trainer_state.pt); resume it "
                    "with learner.world_size 1 (its next checkpoint loads at any world size)"
                )
            self.optimizer.load_state_dict(trainer["optimizer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        # The configured learning rate wins over the checkpoint's (a retrain may change it): the
        # schedule keeps its place, scaled to the configured peak.
        lr = self.config.lr
        if any(base != lr for base in self.scheduler.base_lrs):
            self.scheduler.base_lrs = [lr] * len(self.scheduler.base_lrs)
            for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas, strict=True):
                group["initial_lr"] = lr
                group["lr"] = lr * factor(self.scheduler.last_epoch)
        torch.set_rng_state(trainer["torch_rng"])
        random.setstate(trainer["python_rng"])
