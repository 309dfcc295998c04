"""Many streaming clients at once against an OpenAI-compatible URL; one result per request.

    python -m tests.e2e.overload_client --url http://127.0.0.1:8000 --requests req.json --out out.json

``req.json``: ``[{"prompt": [token ids], "max_tokens": n}, ...]``, all sent at the same moment.
For each request the output records the HTTP status, seconds from connecting until the status
line arrived, the ``Retry-After`` header, the streamed text, the finish reason, and an error
(body or exception).

It speaks HTTP/1.1 over asyncio streams itself (one connection per request, chunked SSE
decoding), because what it measures is the server: on two cores, a thousand httpx requests cost
the client about a millisecond of CPU each, which delayed its own sends by seconds and showed up
as a slow server. Runs in its own process so the caller's measurements share no interpreter
with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


async def _read_chunked(reader: asyncio.StreamReader):
    """Yield the decoded body chunks of a ``Transfer-Encoding: chunked`` response."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def one(host: str, port: int, req: dict, start: asyncio.Event) -> dict:
    out = {"status": None, "t_status": None, "retry_after": None, "text": "", "finish": None, "error": None}
    body = json.dumps({"prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    await start.wait()
    t0 = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        out["t_status"] = time.monotonic() - t0
        out["status"] = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        out["retry_after"] = headers.get("retry-after")
        if headers.get("transfer-encoding") == "chunked":
            chunks = _read_chunked(reader)
        else:
            chunks = _one(await reader.readexactly(int(headers.get("content-length", 0))))
        if out["status"] != 200:
            out["error"] = json.loads(b"".join([c async for c in chunks]))
            return out
        buffer = b""
        async for data in chunks:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event
                        continue
                    choice = event["choices"][0]
                    out["text"] += choice["text"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
    except Exception as exc:  # recorded, judged by the caller
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    out["t_total"] = time.monotonic() - t0
    return out


async def _one(data: bytes):
    yield data


async def main_async(url: str, requests: list[dict]) -> list[dict]:
    parts = urlsplit(url)
    start = asyncio.Event()
    tasks = [asyncio.create_task(one(parts.hostname, parts.port or 80, r, start)) for r in requests]
    await asyncio.sleep(0.5)
    start.set()
    return await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    t0 = time.monotonic()
    results = asyncio.run(main_async(args.url, requests))
    with open(args.out, "w") as f:
        json.dump({"wall_s": time.monotonic() - t0, "results": results}, f)


if __name__ == "__main__":
    main()
