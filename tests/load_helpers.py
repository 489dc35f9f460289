"""Concurrent streaming clients for the server load tests (bounded in count
and time): each records its status, Retry-After, error and client-side TTFT."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import httpx

from tests.server_helpers import MODEL_NAME


@dataclass
class Outcome:
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_chunks: int = 0
    text: str = ""
    retry_after: str | None = None
    error: dict | None = None
    finish_reason: str | None = None
    headers: dict = field(default_factory=dict)


def body(prompt: str = "x" * 20, max_tokens: int = 40, **fields) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **fields}


async def stream_one(client: httpx.AsyncClient, payload: dict, headers: dict | None = None,
                     read_chunks: int | None = None) -> Outcome:
    """POST a streaming completion; stop after `read_chunks` chunks (a
    client that disconnects mid-stream) when given."""
    out = Outcome()
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as response:
        out.status = response.status_code
        out.headers = dict(response.headers)
        if response.status_code != 200:
            out.retry_after = response.headers.get("retry-after")
            out.error = json.loads(await response.aread())["error"]
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                continue
            if out.ttft_s is None:
                out.ttft_s = time.monotonic() - start
            out.num_chunks += 1
            out.text += chunk["choices"][0]["text"]
            out.finish_reason = chunk["choices"][0]["finish_reason"] or out.finish_reason
            if read_chunks is not None and out.num_chunks >= read_chunks:
                return out  # leaving the context manager closes the connection
    out.e2e_s = time.monotonic() - start
    return out


def run_clients(base_url: str, coros_factory, timeout_s: float = 60.0) -> list[Outcome]:
    """Run `coros_factory(client)` -> list of coroutines concurrently, bounded in time."""
    async def main():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*coros_factory(client)), timeout_s)
    return asyncio.run(main())


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (labels as written by the server)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        metric_name, _, label_text = key.partition("{")
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += value
    return total


def wait_until(predicate, timeout_s: float = 10.0, period_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return predicate()


def warm_up(base_url: str, num_requests: int = 4, max_tokens: int = 16) -> None:
    """A few requests first, so admission has measured drain and step times
    (before any measurement it admits only one cache / batch worth of queue)."""
    outs = run_clients(base_url, lambda c: [stream_one(c, body(max_tokens=max_tokens))
                                            for _ in range(num_requests)])
    assert all(o.status == 200 for o in outs), [o.error for o in outs]


async def after(delay_s: float, coro):
    await asyncio.sleep(delay_s)
    return await coro
