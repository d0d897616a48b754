"""How grpoflow.server.invariant (run inside vLLM's workers) cuts a step's attention call
into pieces: hand-derived cases. The real kernel's bits, alone against beside other prompts, are
tests/integration/test_inference.py's."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pieces():
    from grpoflow.server.invariant import _pieces

    return _pieces


def test_decodes_and_short_prompts_stay_whole(pieces):
    # three decodes at positions 40, 7, 300 and a 5-token prompt over nothing cached
    assert pieces([1, 1, 1, 5], [41, 8, 301, 5], 8) == ([0, 1, 2, 3], [1, 1, 1, 5], [41, 8, 301, 5])


def test_a_prompt_becomes_pieces_that_end_where_their_last_token_stands(pieces):
    # 20 query tokens at positions 10..29 (10 cached): pieces 10-17, 18-25, 26-29
    assert pieces([1, 20], [50, 30], 8) == ([0, 1, 1, 1], [1, 8, 8, 4], [50, 18, 26, 30])


def test_one_token_a_piece_is_a_decode_per_row(pieces):
    assert pieces([3], [3], 1) == ([0, 0, 0], [1, 1, 1], [1, 2, 3])


def test_a_request_without_query_tokens_keeps_its_place(pieces):
    assert pieces([0, 2], [12, 2], 8) == ([0, 1], [0, 2], [12, 2])
