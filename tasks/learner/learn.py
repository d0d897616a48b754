"""The learner: policy model, optimizer, LR schedule, GRPO train step, resumable checkpoints.

`Learner.train_step(batch)` recomputes the policy's logprobs on the completion tokens
(tasks/learner/logprobs.py), applies the loss from `tasks/learner/grpo.py` with the masks, and steps. Masked samples
(invalid reward, dropped group, stale) never reach the forward pass: they would contribute nothing but
cost compute. Its checkpoint files are tasks/learner/checkpoint_io.py's, its weights for the servers
tasks/push/weights.py's.

A Learner built inside an initialised `torch.distributed` process group of N > 1 ranks is one rank
of a sharded learner (tasks/learner/distributed.py starts them): its model is sharded with FSDP2
(tasks/learner/fsdp.py), every rank plans the step from the whole batch (so the loss normalisers are the
global ones) and runs its share of the micro-batches, and the gradients are summed over ranks, so the
update is the one a single process makes.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpoflow.tasks.learner import checkpoint_io
from grpoflow.tasks.learner.fsdp import aliases, process_group, shard, write_gathered_weights
from grpoflow.tasks.learner.grpo import compute_loss
from grpoflow.tasks.learner.learner_api import ADAPTER_DIR, MODEL_DIR, TrainSample
from grpoflow.tasks.learner.logprobs import MicroBatch, head_chunk_of, padded_logprobs, shared_prompt_logprobs
from grpoflow.tasks.learner.speed import compile_layers, one_cast_per_update
from grpoflow.tasks.learner.step_metrics import StepRun, empty_step_metrics, fold, step_metrics
from grpoflow.tasks.push.weights import save_weights

if TYPE_CHECKING:  # the learner runs with torch and transformers alone (a bare GPU worker)
    from grpoflow.tasks.config.algorithm import AlgorithmConfig
    from grpoflow.tasks.config.learner import LearnerConfig
    from grpoflow.tasks.config.model import ModelConfig
    from grpoflow.tasks.config.rollouts import GenerationConfig
    from grpoflow.tasks.learner.learner_api import LearnerRun


@dataclass
class Update:
    """The samples of one optimizer step: micro-batches of the ones that run, and the normalisers."""

    micro: list[list[TrainSample]]
    sequences: int  # every sample of the update, zero-advantage ones included
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


class Learner:
    """Holds the policy (and optional frozen reference), optimizer and schedule (a `PolicyLearner`).

    Takes its own config sections, `learner` (optimisation, device, micro-batching) and `algorithm`
    (the loss), and reads two more: `generation` (logprobs are computed at the temperature vLLM sampled
    at; the rollout token budget is dr_grpo's normaliser; None: temperature 1, no budget) and `model`
    (the dtype; None: auto). `run` is what the sections cannot say (tasks.learner_api.LearnerRun).
    `skip_zero_advantage=False` runs zero-advantage samples too (tests and benchmarks compare both)."""

    def __init__(
        self,
        model_path: str | Path,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        run: LearnerRun,
        generation: GenerationConfig | None = None,
        model: ModelConfig | None = None,
        *,
        skip_zero_advantage: bool = True,
    ):
        if learner.torch_threads:
            torch.set_num_threads(learner.torch_threads)
        torch.manual_seed(run.seed)
        self.rank, self.world_size = process_group()
        self.config, self.algorithm = learner, algorithm
        self.temperature = generation.temperature if generation is not None else 1.0
        self.max_completion_length = (
            (generation.max_rollout_tokens or generation.max_tokens) if generation is not None else None
        )
        self.model_path = str(model_path)
        self.tokenizer_path = str(run.tokenizer_path or model_path)
        dtype = model.dtype if model is not None else "auto"
        self._load_models(learner.device, dtype, run.ref_model_path or model_path, run.adapter_path)
        # The schedule counts optimizer steps: every training step takes num_iterations x mini_batches.
        self._make_optimizer(run.total_steps * algorithm.num_iterations * learner.mini_batches)
        self.micro_batch_size = learner.micro_batch_size
        self.pad_id = self.model.config.pad_token_id or 0
        self.skip_zero_advantage = skip_zero_advantage and algorithm.beta == 0
        # Completions of one group share their prompt: it runs once, followed by its completions in
        # one row with attention by segment, or with its KV cache repeated for them
        # (shared_prompt_logprobs), instead of once per completion. Pays on a CPU once the model is big
        # enough for FLOPs, not per-call overhead, to dominate. Not on a GPU, where the step waits on
        # kernel launches and the cache layout's second forward per micro-batch doubled them: 1.5B on an
        # H100, 1.95 s a step with it, 1.68 s without (BENCHMARKS.md). None: auto.
        auto = self.num_parameters >= 20_000_000 and self.device.type == "cpu"
        share = auto if learner.share_prompt is None else learner.share_prompt
        # Gradient checkpointing recomputes blocks the cache would span; compiled layers would be
        # traced again for each layer's cache state.
        self.share_prompt = share and not learner.gradient_checkpointing and not learner.compile
        self.head_chunk = head_chunk_of(self.model, learner.lm_head_chunk, self.world_size)

    def _load_models(self, device: str, dtype: str, ref_path: str | Path, adapter: str | Path | None) -> None:
        """The policy (with `learner.lora`: the base model plus a trainable adapter, new or the one
        saved under `adapter`) and, with `algorithm.beta` > 0, the frozen reference: a second model
        for full fine-tuning, the policy with its adapter disabled for LoRA (no second copy)."""
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":  # a rank's own GPU (Ray gives each rank one, as device 0)
            device = f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        # The precision recipe (docs/architecture.md, "Precision"): `dtype` is the compute dtype. The
        # weights that train stay float32 (master weights; AdamW's moments follow them), the forward
        # runs under autocast, so a bf16 run's matmuls are bf16 and its updates are float32's: plain
        # bf16 weights round away an update below 2^-8 of the weight, which RL's 1e-6..1e-5 rates are.
        # Frozen weights (a LoRA base, the KL reference) are held in the compute dtype.
        self.dtype = getattr(torch, dtype)
        trains = self.dtype if self.config.lora is not None else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=trains).to(self.device)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.aliases = aliases(self.model)  # left out of gathered full weights
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.lora = self.config.lora
        if self.lora is not None:
            from grpoflow.tasks.learner.lora import attach

            if self.config.gradient_checkpointing:  # checkpointed blocks need an input that wants grad
                self.model.enable_input_require_grads()
            self.model = attach(self.model, self.lora, adapter).to(self.device)
        self.model.train()
        self.ref_model = None
        if self.algorithm.beta > 0 and self.lora is None:
            self.ref_model = AutoModelForCausalLM.from_pretrained(ref_path, dtype=self.dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        if self.world_size > 1:
            for m in filter(None, (self.model, self.ref_model)):
                shard(m, self.device, self.world_size)
        if self.config.compile:  # after sharding, so that dynamo traces the layers FSDP2 wraps
            compile_layers(self.model)
        # After sharding: FSDP2 replaces the parameters (the optimizer must hold the sharded ones).
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]

    def _make_optimizer(self, total_steps: int) -> None:
        """AdamW and transformers' LR schedule (linear warm-up from 0, then constant/linear/cosine)."""
        from transformers import get_scheduler

        c = self.config
        # One process: the fused kernel, one pass over each tensor instead of several per tensor (on a
        # GPU one launch for them all; on a CPU about 0.05-0.08 s for SmolLM2's AdamW step against the
        # multi-tensor kernel's 0.18-0.4 s). FSDP2's sharded parameters keep the multi-tensor one.
        fused = self.world_size == 1
        self.optimizer = torch.optim.AdamW(self.trainable, lr=c.lr, weight_decay=c.weight_decay, fused=fused)
        name = {"constant": "constant_with_warmup"}.get(c.lr_schedule, c.lr_schedule)
        self.scheduler = get_scheduler(
            name, self.optimizer, num_warmup_steps=c.warmup_steps, num_training_steps=total_steps
        )

    # -- training ---------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Update on one generation batch: `algorithm.num_iterations` passes, each split into
        `learner.mini_batches` optimizer steps, each micro-batched with gradient accumulation.

        With more than one update the policy's logprobs before the first update (pi_old) are kept for
        the ratio: the first update's come from its own first forward (nothing has moved yet), the
        others' from one no-grad forward before the first step. One update: the ratio is 1 and no extra
        forward runs."""
        t0 = time.perf_counter()
        if not samples:
            self.advance_schedule(0)
            return empty_step_metrics(time.perf_counter() - t0)
        run = self.run_updates(samples)
        return step_metrics(run, len(samples), self.algorithm.num_iterations, time.perf_counter() - t0)

    def plan(self, samples: list[TrainSample]) -> list[Update]:
        """The optimizer updates of one pass of `train_step(samples)`, as it runs them: the batch cut
        in order into `learner.mini_batches` parts, each micro-batched.

        With no KL term a zero-advantage sample's loss and gradient are exactly 0 (every loss type
        multiplies each token by its advantage), so it skips the forward/backward but still counts in
        the normalisers: the update is the one all the samples give."""
        out = []
        for part in _split(samples, self.config.mini_batches):
            work = [s for s in part if s.advantage != 0.0] if self.skip_zero_advantage else part
            tokens = int(sum(sum(s.completion_mask) for s in part))
            out.append(Update(self._micro_batches(work), len(part), tokens, len(part) - len(work)))
        return out

    def run_updates(self, samples: list[TrainSample]) -> StepRun:
        """The updates of `train_step` (on a rank of a sharded learner: this rank's share of them)."""
        self.optimizer.zero_grad(set_to_none=True)
        parts = self.plan(samples)
        iterations = self.algorithm.num_iterations
        old = self._old_logprobs(parts) if iterations * len(parts) > 1 else None
        refs: dict[tuple[int, int], torch.Tensor] = {}
        updates: list[tuple[int, int, dict[str, float]]] = []  # (iteration, work samples, metrics)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate the step's first update runs at
        for it in range(iterations):
            for j, part in enumerate(parts):
                self.optimizer.zero_grad(set_to_none=True)
                m = self._accumulate(part, j, old, refs)
                norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.max_grad_norm)
                m["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
                self.scheduler.step()
                updates.append((it, part.work_samples, m))
        self.advance_schedule(len(updates))
        return StepRun(updates, sum(p.tokens for p in parts), sum(p.skipped for p in parts), lr)

    def advance_schedule(self, taken: int) -> None:
        """Bring the LR schedule to where a whole training step leaves it: each one counts
        num_iterations x mini_batches optimizer steps, taken or not (a batch smaller than
        `mini_batches` makes fewer parts, an empty one none), so a run whose steps filter groups
        (filter_zero_std, dynamic sampling) still ends its decay at its last step."""
        missing = self.algorithm.num_iterations * self.config.mini_batches - taken
        with warnings.catch_warnings():  # a step with no update before any: the schedule alone moves
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            for _ in range(missing):
                self.scheduler.step()

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

    def _micro_batch(self, model, mb: list[TrainSample]) -> MicroBatch:
        forward = shared_prompt_logprobs if self.share_prompt else padded_logprobs
        kw = {"temperature": self.temperature, "pad_id": self.pad_id, "device": self.device}
        with self.autocast():
            return forward(model, mb, head_chunk=self.head_chunk, head_apart=self.world_size == 1, **kw)

    def autocast(self) -> torch.autocast:
        """The forward's precision: the compute dtype over float32 master weights (off for float32)."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _local(self, part: Update) -> list[tuple[list[TrainSample], bool]]:
        """This rank's micro-batches of an update, each with whether it counts: micro-batch i goes to
        rank i mod N, and a rank with one fewer runs a one-sample copy whose loss is multiplied by 0,
        because every rank must run as many forwards and backwards as the others (FSDP gathers each
        layer's parameters from all ranks in each)."""
        n, w = len(part.micro), self.world_size
        if w == 1:
            return [(mb, True) for mb in part.micro]
        rounds = -(-n // w)
        return [
            (part.micro[i], True) if i < n else (part.micro[0][:1], False)
            for i in (k * w + self.rank for k in range(rounds))
        ]

    @torch.no_grad()
    def _old_logprobs(self, parts: list[Update]) -> dict[tuple[int, int], torch.Tensor]:
        """pi_old of every micro-batch but the first update's (their own first forward gives those),
        keyed (update, micro-batch); the same micro-batches as the updates, so the values match."""
        return {
            (j, k): self._micro_batch(self.model, mb).logprobs
            for j, part in enumerate(parts[1:], start=1)
            for k, (mb, _) in enumerate(self._local(part))
        }

    def _accumulate(self, part: Update, j: int, old: dict | None, refs: dict) -> dict[str, float]:
        """Forward + backward of one update's micro-batches (gradients add up); its loss metrics."""
        pieces = []
        with one_cast_per_update(self.device, self.dtype, self.world_size):
            for k, (mb, counts) in enumerate(self._local(part)):
                pieces += self._accumulate_one(part, j, k, mb, counts, old, refs)
        if not part.micro:
            # All advantages 0: the loss and gradient are 0, and Adam still steps on its moments.
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            return {"loss": 0.0}
        return fold(pieces, ("loss",))

    def _accumulate_one(self, part: Update, j: int, k: int, mb, counts: bool, old, refs) -> list:
        """Forward + backward of micro-batch k of update j; its (weight, scale, metrics) when it counts."""
        logprobs, mask, behav, adv = self._micro_batch(self.model, mb)
        old_lp = None
        if old is not None:  # several updates: pi_old is kept; the first forward of all provides it
            old_lp = old.setdefault((j, k), logprobs.detach())
        ref = None
        if self.algorithm.beta > 0:
            if (j, k) not in refs:
                refs[(j, k)] = self._reference_logprobs(mb)
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
        return [(len(mb) / part.work_samples, 1.0, m)] if counts else []

    @torch.no_grad()
    def _reference_logprobs(self, mb: list[TrainSample]) -> torch.Tensor:
        """The KL reference's logprobs: the frozen reference model's, or for LoRA the policy's with its
        adapter disabled (the base model)."""
        if self.ref_model is not None:
            return self._micro_batch(self.ref_model, mb).logprobs
        with self.model.disable_adapter():
            return self._micro_batch(self.model, mb).logprobs

    def close(self) -> None:
        """Nothing to release: the model lives in this process (`PolicyLearner.close`)."""

    # -- weights and checkpoints ----------------------------------------------------------------

    def write_weights(self, directory: Path) -> None:
        """The full weights as a model dir vLLM's reload and `from_pretrained` take (model.safetensors
        + config.json); for LoRA the adapter in PEFT's format, as vLLM loads it. A sharded learner
        gathers them onto rank 0, which writes; every rank calls it."""
        if self.lora is not None:
            from grpoflow.tasks.learner.lora import write_adapter

            write_adapter(self.model, Path(directory))
        elif self.world_size == 1:  # float32 master weights go out in the compute dtype the servers run
            save_weights(self.model, Path(directory), dtype=self.dtype)
        else:
            write_gathered_weights(
                self.model, Path(directory), rank=self.rank, skip=self.aliases, dtype=self.dtype
            )

    def save(self, directory: Path) -> None:
        """Write the model (a complete model dir: safetensors, config, tokenizer), the optimizer (in
        torch.distributed.checkpoint format, which loads at any world size), the schedule and the RNG
        state into `directory`. Every rank of a sharded learner calls it; rank 0 writes the rest."""
        directory = Path(directory)
        if self.lora is not None:
            self.write_weights(directory / ADAPTER_DIR)
        elif self.world_size == 1:
            self.model.save_pretrained(directory / MODEL_DIR, safe_serialization=True)
        else:
            self.write_weights(directory / MODEL_DIR)
        checkpoint_io.save_optimizer(self.model, self.optimizer, directory, self.world_size)
        if self.rank == 0:
            checkpoint_io.save_trainer_state(
                directory, self.scheduler, self.world_size, self.tokenizer_path, base_model=self._base()
            )

    def _base(self) -> str | None:
        """The base model a LoRA checkpoint's adapter goes on (None: the checkpoint holds the model)."""
        return self.model_path if self.lora is not None else None

    def load_trainer_state(self, directory: Path) -> None:
        """Restore optimizer, scheduler and RNG from a checkpoint written by `save`, at this learner's
        world size whatever the writer's was (every rank calls it). The configured learning rate wins
        over the checkpoint's: the schedule keeps its place, scaled to the configured peak.

        The weights themselves are loaded by constructing the Learner on `directory / "model"`, so
        tied or renamed parameters go through transformers' own loading logic.
        """
        checkpoint_io.load_trainer_state(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            world_size=self.world_size,
            lr=self.config.lr,
        )
