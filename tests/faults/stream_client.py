"""A steady stream of streaming completions, run inside a client namespace by the fault tests.

    python -m tests.faults.stream_client --url http://10.77.0.1:8000 --requests FILE --out FILE
        [--interval 0.5] [--concurrency 8] [--api-key KEY]

``--requests`` is a JSON list of ``{"id", "prompt" (token ids), "max_tokens"}``, optionally
with ``"sampling"``: fields merged into the body (default greedy: temperature 0). Request i starts
at ``i * interval`` seconds (at most ``concurrency`` at once). For each request the output JSON
records the concatenated streamed text, the finish reason, the HTTP status and any error message.
Bounded: every request has a 300 s timeout; the client exits when all are done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

RECONNECT_S = 90.0


async def one(client: httpx.AsyncClient, url: str, req: dict, headers: dict) -> dict:
    """One request; a refused connection (router down, e.g. restarting) is retried for up to
    ``RECONNECT_S`` seconds, as any client would. Nothing else is retried: a stream cut after
    tokens were delivered is recorded as an error (re-sending would repeat tokens)."""
    end = time.time() + RECONNECT_S
    reconnects = 0
    while True:
        out = await _one(client, url, req, headers)
        if out.get("connect_error") and time.time() < end:
            reconnects += 1
            await asyncio.sleep(0.5)
            continue
        out["reconnects"] = reconnects
        return out


async def _one(client: httpx.AsyncClient, url: str, req: dict, headers: dict) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "stream": True, **req.get("sampling", {})}
    out = {"id": req["id"], "text": "", "finish_reason": None, "status": None, "error": None,
           "chunks": 0, "start": time.time()}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["error"] = (await resp.aread()).decode(errors="replace")[:500]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"].get("message", str(event["error"]))
                    break
                for choice in event.get("choices", []):
                    out["text"] += choice.get("text", "")
                    out["chunks"] += 1
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
    except httpx.ConnectError as exc:
        out["error"] = f"ConnectError: {exc}"
        out["connect_error"] = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["end"] = time.time()
    return out


async def main_async(args) -> list[dict]:
    requests = json.loads(open(args.requests).read())
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def paced(i, req):
            await asyncio.sleep(i * args.interval)
            async with sem:
                return await one(client, args.url, req, headers)
        return await asyncio.gather(*(paced(i, r) for i, r in enumerate(requests)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    import os
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
