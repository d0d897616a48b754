"""Model preparation from the registry's GGUF files (tasks/models.py): `gguf_tokenizer` keeps the BOS rule
a GGUF states, which transformers' own GGUF loader drops (Gemma 3's real tokenizer, from its GGUF)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpoflow.tasks.models import gemma3_gguf_path

pytestmark = pytest.mark.unit


def test_gguf_tokenizer_keeps_the_bos_gemma3s_gguf_states_where_transformers_drops_it(
    gemma3_tokenizer_dir, tmp_path
):
    """The tokenizer dir `save_gemma3_tokenizer` writes (through `gguf_tokenizer`) adds Gemma's BOS; the
    same GGUF loaded by transformers alone does not: why `gguf_tokenizer` exists (a base model reading a
    prompt without its BOS answers with noise). Assembling the GGUF (~250 MB) and loading it: ~20 s."""
    ours = AutoTokenizer.from_pretrained(gemma3_tokenizer_dir)
    assert ours.bos_token_id == 2 and ours("Question").input_ids[0] == 2
    gguf = gemma3_gguf_path(tmp_path)
    plain = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert plain.bos_token_id == 2  # it knows the token, but does not add it
    assert 2 not in plain("Question").input_ids
    assert ours("Question").input_ids == [2, *plain("Question").input_ids]  # otherwise the same ids
