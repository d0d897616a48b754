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


# The linear layers' check, with stand-in kernels (vLLM's oneDNN kernels run only in its environment; their
# bits, one row alone against beside others, are tests/integration/test_inference.py's).


def _kernel(calls: list, single_row_differs: bool):
    """A stand-in for a layer's `cpu_linear`: each row's products summed alone (the same bits at any row
    count), its last bits changed when called with one row if `single_row_differs` (as vLLM's oneDNN
    kernel for SmolLM2's down projection does)."""
    import torch

    def cpu_linear(x, weight, bias):
        calls.append(x.shape[0])
        out = (x[:, None, :] * weight).sum(-1) + (bias if bias is not None else 0)
        if single_row_differs and x.shape[0] == 1:
            out = (out.view(torch.int32) ^ 1).view(torch.float32)
        return out

    return cpu_linear


def test_each_kind_of_linear_layer_is_checked_once_and_reloads_check_nothing(monkeypatch):
    import torch

    from grpoflow.server import invariant

    monkeypatch.setattr(invariant, "_variants", {})
    calls: list[int] = []
    kernel = _kernel(calls, single_row_differs=True)
    w = torch.randn(4, 8)
    assert invariant._kind_variant_rows(kernel, w, None, (4, 8), torch.float32) == [1]
    checked = len(calls)
    assert checked == len(invariant.ROWS) + 1  # the whole call, then each row count
    # another layer of the kind, other weights (a push's reload of the same layer): no call at all
    assert invariant._kind_variant_rows(kernel, torch.randn(4, 8), None, (4, 8), torch.float32) == [1]
    assert len(calls) == checked
    # another shape, a bias, another dtype: each a kind of its own, checked on its own
    assert invariant._kind_variant_rows(kernel, torch.randn(8, 8), None, (8, 8), torch.float32) == [1]
    assert invariant._kind_variant_rows(kernel, w, torch.randn(4), (4, 8), torch.float32) == [1]
    assert len(calls) == 3 * checked


def test_a_kernel_that_vllm_chose_otherwise_is_a_kind_of_its_own(monkeypatch):
    import torch

    from grpoflow.server import invariant

    monkeypatch.setattr(invariant, "_variants", {})
    calls: list[int] = []
    w = torch.randn(4, 8)
    assert invariant._kind_variant_rows(_kernel(calls, True), w, None, (4, 8), torch.float32) == [1]

    # the same shape through a kernel of other code (vLLM's sgl or fallback branch): its own verdict
    def other(x, weight, bias):
        calls.append(x.shape[0])
        return (x[:, None, :] * weight).sum(-1)

    assert invariant._kind_variant_rows(other, w, None, (4, 8), torch.float32) == []
    assert len(calls) == 2 * (len(invariant.ROWS) + 1)
