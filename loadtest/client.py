"""One streaming request to an OpenAI-compatible server, timed per chunk.

Timing follows vLLM's request functions (vllm/benchmarks/lib/endpoint_request_func.py), with
``time.perf_counter`` (seconds):

- ``start_time``: just before the POST is sent.
- ``ttft``: first SSE data chunk carrying a non-empty ``choices`` minus ``start_time``.
- ``itl``: for every later such chunk, its time minus the previous one's (one entry per chunk,
  so a chunk that bundles several tokens yields one gap).
- ``latency`` (E2EL): the last such chunk minus ``start_time`` (the trailing usage chunk and
  ``[DONE]`` do not count).
- ``output_tokens``: ``usage.completion_tokens`` when the server sends usage (requested with
  ``stream_options.include_usage``), else the number of such chunks; ``prompt_len`` likewise
  becomes ``usage.prompt_tokens`` when given.

A request succeeds when the status is 200 and at least one such chunk arrived; otherwise
``success`` is False and ``error`` holds the message.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from loadtest.config import BenchmarkConfig
from loadtest.sample import SampleRequest

ERROR_BODY_CHARS = 500


@dataclass
class RequestOutput:
    """What one request measured. Times in seconds (``time.perf_counter`` clock)."""

    prompt_len: int = 0
    """Prompt tokens: the server's usage count if sent, else the dataset's estimate."""
    output_tokens: int = 0
    """Generated tokens: usage ``completion_tokens`` if sent, else the chunk count."""
    success: bool = False
    error: str = ""
    """Empty on success, else why it failed (HTTP status and body, exception, timeout)."""
    start_time: float = 0.0
    """``perf_counter`` when the request was sent."""
    ttft: float = 0.0
    """Time to first token, s."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks, s."""
    latency: float = 0.0
    """End-to-end latency (send to last content chunk), s."""
    generated_text: str = ""
    chunks: int = 0
    """Content chunks received."""


def build_payload(config: BenchmarkConfig, sample: SampleRequest) -> dict:
    """The JSON body for ``sample`` on ``config.endpoint`` (always streaming, usage included)."""
    body: dict = {"model": config.model, "stream": True,
                  "stream_options": {"include_usage": True}}
    if config.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
        body["max_tokens"] = sample.expected_output_len  # servers predating max_completion_tokens
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    if config.effective_ignore_eos is not None:
        body["ignore_eos"] = config.effective_ignore_eos
    if config.temperature is not None:
        body["temperature"] = config.temperature
    body.update(config.extra_body)
    return body


def chunk_text(choice: dict) -> str:
    """The text of one streamed choice (completions ``text`` or chat ``delta.content``)."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def _on_event(data: dict, output: RequestOutput, last: float) -> float:
    """Account one decoded SSE event; returns the time of the latest content chunk."""
    usage = data.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            output.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            output.prompt_len = int(usage["prompt_tokens"])
    choices = data.get("choices")
    if not choices:
        return last
    now = time.perf_counter()
    if output.chunks == 0:
        output.ttft = now - output.start_time
    else:
        output.itl.append(now - last)
    output.chunks += 1
    output.generated_text += chunk_text(choices[0])
    return now


async def _read_stream(response: httpx.Response, output: RequestOutput) -> None:
    last = output.start_time
    got_usage = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments (":ping"), event/id fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ValueError(f"SSE event is not a JSON object: {payload[:100]}")
        got_usage = got_usage or bool(data.get("usage"))
        last = _on_event(data, output, last)
    output.latency = last - output.start_time
    if not got_usage:
        output.output_tokens = output.chunks


async def send_request(client: httpx.AsyncClient, url: str, body: dict,
                       output: RequestOutput) -> RequestOutput:
    """POST ``body`` to ``url`` and stream the answer into ``output`` (also returned).

    Never raises for a server or network failure: ``output.success`` is False and
    ``output.error`` says why. Cancellation propagates (the caller records it).
    """
    output.start_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                output.error = f"HTTP {response.status_code}: {text[:ERROR_BODY_CHARS]}"
                return output
            await _read_stream(response, output)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, OSError) as exc:
        output.error = f"{type(exc).__name__}: {exc}"
        return output
    if output.chunks == 0:
        output.error = "no content chunk received (cannot measure TTFT)"
        return output
    output.success = True
    return output
