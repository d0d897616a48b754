"""vLLM worker extension: weight reloads that keep a tied LM head current, and a PEFT LoRA adapter merged
into the served weights (`sync.backend: lora_merged`).

Every server grpoflow starts runs with `--worker-extension-cls grpoflow.server.merge.LoraMerge`, which adds two
methods to vLLM's workers, called over `/collective_rpc` (their names: protocol.RELOAD_RPC,
protocol.MERGE_LORA_RPC):

`grpoflow_reload_weights(weights_path)` loads the version at `weights_path`. On CPU it writes the new
values into plain weights and packs again each layer written (reload.py), in 0.67-0.77x the time of
vLLM's own reload (SmolLM2, bf16 and float32); elsewhere, or where that does not apply, it is vLLM's
`reload_weights`, then the tied LM heads re-packed: on CPU, vLLM packs an LM head's weight for oneDNN
when the layer is processed. A model with tied embeddings (Gemma 3, SmolLM2, Qwen2.5's small ones) has
no LM head weight in its checkpoint: vLLM's reload copies the new embedding into the head's (shared)
weight but processes only the layers it loaded, so the head would go on multiplying by the old
embedding's pack, and the server would sample from a mix of two policies.

`grpoflow_merge_lora(adapter_path)` reads the adapter (safetensors + `adapter_config.json`, as PEFT
writes it), reads the weights of the modules it adapts from its base model's safetensors (the
adapter's `base_model_name_or_path`, else the model the server started with), and reloads those
modules in place as W + scale * B @ A. Each merge starts from the base model's files, never from what
the server holds, so merges do not accumulate. A fused vLLM layer (q/k/v, gate/up:
`packed_modules_mapping`) is reloaded whole: its modules the adapter leaves alone get their base
weights, and biases come from the base files too.

Runs inside vLLM's worker process: torch, safetensors and vllm (the environment's own, imported inside
the functions that use them: grpoflow.server PROVIDED_BY_VLLM).
The server should be paused around the call (tasks/push/lora_push.py: MergedLoraPush), as for a reload.
"""

from __future__ import annotations

import json
import os

from grpoflow.server import invariant, reload

# vLLM imports this module into every worker of a server grpoflow starts, before the model loads: where
# the linear layers are made batch-invariant (invariant.py) and what each is packed from is recorded
# (reload.py, whose packing goes through invariant's wrapper: installed after it).
invariant.install()
reload.install()

LORA_A, LORA_B, PREFIX = ".lora_A.weight", ".lora_B.weight", "base_model.model."


def _deltas(adapter_path: str):
    """{module name: scale * B @ A (fp32)} of a PEFT adapter dir; a clear error for anything but plain
    LoRA on linear layers."""
    import torch
    from safetensors.torch import load_file

    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("use_dora") or cfg.get("modules_to_save"):
        raise ValueError(
            f"{adapter_path}: only plain LoRA adapters can be merged (no DoRA, no modules_to_save)"
        )
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / (r**0.5 if cfg.get("use_rslora") else r)
    tensors = load_file(os.path.join(adapter_path, "adapter_model.safetensors"))
    unknown = [k for k in tensors if not (k.endswith(LORA_A) or k.endswith(LORA_B))]
    if unknown:
        raise ValueError(f"{adapter_path}: tensors that are not LoRA A/B matrices: {unknown[:3]}")
    out = {}
    for key, a in tensors.items():
        if key.endswith(LORA_A):
            module = key[: -len(LORA_A)].removeprefix(PREFIX)
            b = tensors[key[: -len(LORA_A)] + LORA_B]
            out[module] = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return out, cfg.get("base_model_name_or_path")


def _base_files(base: str) -> list[str]:
    index = os.path.join(base, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(base, n) for n in names]
    single = os.path.join(base, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no safetensors weights in the base model dir {base}")
    return [single]


def tied_heads(model) -> list[str]:
    """The names of the LM heads that share their weight with an embedding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = dict(model.named_modules())
    embeddings = {
        id(m.weight)
        for m in modules.values()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    return [
        name for name, m in modules.items() if isinstance(m, ParallelLMHead) and id(m.weight) in embeddings
    ]


def refresh_tied_heads(model) -> list[str]:
    """Re-pack, on CPU, the LM heads that share their weight with an embedding (the module doc); their
    names. Off CPU the head multiplies by the weight itself: nothing to do."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    tied = tied_heads(model)
    for name in tied:
        dispatch_cpu_unquantized_gemm(model.get_submodule(name), remove_weight=False)
    return tied


def _load_from(runner, model, weights_path: str) -> int:
    """`_plain_reload` of the version at `weights_path`, read by the server's own model loader (its
    safetensors files and index), which reads the model's path from the config as vLLM's reload does:
    pointed there, and back where it was when the load fails."""
    from vllm.model_executor.model_loader import get_model_loader

    cfg = runner.vllm_config.model_config
    was = cfg.model, cfg.model_weights, cfg.revision
    cfg.model, cfg.model_weights, cfg.revision = weights_path, "", None
    try:
        return _plain_reload(
            runner, model, get_model_loader(runner.vllm_config.load_config).get_all_weights(cfg, model)
        )
    except BaseException:
        cfg.model, cfg.model_weights, cfg.revision = was
        raise


def _plain_reload(runner, model, weights) -> int:
    """reload.py's reload of `weights`, then the caches vLLM's reload resets after it, reset; the layers
    packed again."""
    packed = reload.reload(model, weights)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(runner, reset, lambda: None)()
    return packed


class LoraMerge:
    """Mixed into vLLM's worker class (`--worker-extension-cls`)."""

    def grpoflow_reload_weights(self, weights_path: str, plain: bool = True) -> dict:
        """Serve the version at `weights_path` (the module doc): {"reload": "plain", "packed": the layers
        packed again} or {"reload": "vllm", "tied_heads": those re-packed}. `plain` False: vLLM's reload
        even where reload.py's applies (tests compare the two)."""
        runner = self.model_runner
        model = runner.get_model()
        if not (plain and reload.can_reload(model, runner.vllm_config)):
            self.reload_weights(weights_path=weights_path)
            return {"reload": "vllm", "tied_heads": refresh_tied_heads(model)}
        return {"reload": "plain", "packed": _load_from(runner, model, weights_path)}

    def grpoflow_merge_lora(self, adapter_path: str) -> list[str]:
        """Serve base + the adapter at `adapter_path`, merged (the module doc); the modules merged."""
        import torch
        from safetensors import safe_open

        deltas, base = _deltas(adapter_path)
        if not base or not os.path.isdir(base):
            base = self.model_runner.model_config.model
        model = self.model_runner.get_model()
        modules = set(deltas)
        for packed in getattr(model, "packed_modules_mapping", {}).values():
            for m in deltas:
                parent, _, leaf = m.rpartition(".")
                if leaf in packed:
                    modules.update(f"{parent}.{sibling}" for sibling in packed)
        weights, merged = [], set()
        for path in _base_files(base):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    module, _, kind = name.rpartition(".")
                    if module not in modules:
                        continue
                    t = f.get_tensor(name)
                    if kind == "weight" and module in deltas:
                        # fp32, never rounded to the file's dtype: the loader casts to the served one.
                        t = t.to(torch.float32) + deltas[module]
                        merged.add(module)
                    weights.append((name, t))
        missing = sorted(set(deltas) - merged)
        if missing:
            raise ValueError(f"{adapter_path}: modules not in the base model {base}: {missing[:3]}")
        if reload.can_reload(model, self.model_runner.vllm_config):
            _plain_reload(self.model_runner, model, iter(weights))
        else:
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            refresh_tied_heads(model)  # adapters never touch the embedding; kept current all the same
        return sorted(merged)
