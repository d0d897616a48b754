"""Build a tiny random causal LM and a byte-level tokenizer with a ChatML template, offline.

Used by tests, benchmarks and the default demo: nothing can be downloaded here, and a real (if
random) model served by the real vLLM server is better than any stand-in. head_dim is 64 because
vLLM's CPU attention kernels only accept a few head sizes.
"""

from __future__ import annotations

from pathlib import Path

from grpoflow.storage.rollouts import atomic_publish_dir

# ChatML with Hermes-style tool schemas; the same shape Qwen2.5 uses, so tool-call parsing and
# masking are exercised the way they are with real tool-use models.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call tools. Available tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'To call a tool, write <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: they survive decoding, so tool-call markup stays in the text.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _publish(out: Path, model, tokenizer) -> Path:
    """Save `model` (safetensors) and `tokenizer` as the model dir `out`, published whole."""

    def write(d: Path) -> None:
        model.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)

    return atomic_publish_dir(out, write)


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Save a random Llama-architecture model + tokenizer to `out_dir`; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    # Exactly the tokenizer size: every id the model can sample decodes to text.
    vocab_size = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if config.head_dim != 64:
        raise ValueError(f"head_dim must be 64 for vLLM CPU attention, got {config.head_dim}")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    return _publish(out, model, tokenizer)


def build_tiny_gemma3(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    sliding_window: int = 16,
    seed: int = 0,
) -> Path:
    """Save a random Gemma 3 (text) model with Gemma's real tokenizer (`tasks.models.save_gemma3_tokenizer`)
    to `out_dir`: the tests' second model family, built in seconds. What sets it apart from the Llama
    family is kept: the 262k vocabulary, tied embeddings, a sliding-window layer beside a full one,
    grouped-query attention (two query heads share one KV head), Gemma's norms and embedding scale, a
    BOS-adding tokenizer and no chat template (Gemma 3 270M is a base model). head_dim is 64 for vLLM's
    CPU attention; the window is short so that prompts of the tests outgrow it. Weights are drawn wider
    than Gemma's 0.02 so that logits spread over the 262k tokens (at 0.02 every token scores about the
    same, and greedy choices would be near-ties that any rounding flips)."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        layer_types=layer_types,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    return _publish(out, model, tokenizer)
