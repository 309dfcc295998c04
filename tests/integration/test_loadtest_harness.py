"""The load-test harness against a real HTTP server on 127.0.0.1 with known timings.

The server is a test double started in a subprocess (this file run as a script): it streams
``max_tokens`` chunks, the first after ``TTFT_MS`` and each next one ``ITL_MS`` later, so the
harness's measurements can be checked against known values.
"""

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

TTFT_MS = 120.0
ITL_MS = 30.0
# Upper bounds allow for scheduling delays: two cores are shared with other test processes.
SLACK_MS = 80.0


# ---------------------------------------------------------------- the test double (subprocess)

def make_fake_server(ttft_ms: float, itl_ms: float, unready_s: float = 0.0):
    """Test double of an OpenAI-compatible server: streams ``max_tokens`` chunks, the first
    after ``ttft_ms`` and the others ``itl_ms`` apart; reports usage (prompt tokens = words)
    when asked. Model ``fail`` answers 503; model ``no-usage`` never sends usage. For the first
    ``unready_s`` seconds it lists its model but answers ``/health`` and every completion 503,
    as a pdserve router does until a worker pair has joined."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    ready_at = time.monotonic() + unready_s

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if time.monotonic() >= ready_at else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        for i in range(n):
            await asyncio.sleep((ttft_ms if i == 0 else itl_ms) / 1000)
            choice = ({"index": 0, "delta": {"content": f" t{i}"}} if chat
                      else {"index": 0, "text": f" t{i}"})
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage") and body["model"] != "no-usage":
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if body["model"] == "fail" or time.monotonic() < ready_at:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


def _serve() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=TTFT_MS)
    p.add_argument("--itl-ms", type=float, default=ITL_MS)
    p.add_argument("--unready-s", type=float, default=0.0)
    args = p.parse_args()
    uvicorn.run(make_fake_server(args.ttft_ms, args.itl_ms, args.unready_s), host="127.0.0.1", port=args.port,
                log_level="warning")


# ---------------------------------------------------------------- fixtures

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1, trust_env=False).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("fake server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _config(url: str, **kw):
    from loadtest import BenchmarkConfig

    base = dict(base_url=url, model="fake-model", num_prompts=16, random_input_len=20,
                random_output_len=8, max_concurrency=4, progress=False, max_duration_s=30)
    base.update(kw)
    return BenchmarkConfig(**base)


# ---------------------------------------------------------------- tests

pytestmark = pytest.mark.integration


def test_measures_known_delays(server_url):
    from loadtest import run_benchmark

    r = run_benchmark(_config(server_url, goodput_slos_ms={"ttft": 1000, "e2el": 2000}))
    e2el_ms = TTFT_MS + 7 * ITL_MS  # 8 chunks
    assert r["completed"] == 16 and r["failed"] == 0
    assert r["output_lens"] == [8] * 16 and r["total_output_tokens"] == 128
    assert r["input_lens"] == [20] * 16  # the server's usage count (words)
    assert TTFT_MS * 0.95 <= r["median_ttft_ms"] <= TTFT_MS + SLACK_MS
    assert ITL_MS * 0.9 <= r["median_itl_ms"] <= ITL_MS + SLACK_MS / 4
    assert ITL_MS * 0.9 <= r["median_tpot_ms"] <= ITL_MS + SLACK_MS / 4
    assert e2el_ms * 0.95 <= r["median_e2el_ms"] <= e2el_ms + 2 * SLACK_MS
    assert all(len(itl) == 7 for itl in r["itls"])
    # 16 requests, 4 at a time: 4 waves of one E2EL each, never faster than the known delays.
    expected_rps = 16 / (4 * e2el_ms / 1000)
    assert expected_rps * 0.5 <= r["request_throughput"] <= expected_rps * 1.05
    assert r["request_throughput"] == pytest.approx(16 / r["duration"])
    assert r["output_throughput"] == pytest.approx(8 * r["request_throughput"])
    assert r["max_concurrent_requests"] == 4
    assert r["goodput_ratio"] == 1.0
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])


def test_cli_writes_json_and_plots(server_url, tmp_path):
    from loadtest.cli import main

    argv = ["--base-url", server_url, "--num-prompts", "8", "--random-input-len", "10",
            "--random-output-len", "4", "--request-rate", "40", "--burstiness", "2",
            "--endpoint", "/v1/chat/completions", "--goodput", "ttft:1000", "tpot:100",
            "--metric-percentiles", "50,99.9", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path / "res"), "--result-filename", "out.json",
            "--plot", str(tmp_path / "plots"), "--label", "fake"]
    assert main(argv) == 0  # no --model: taken from /v1/models
    result = json.loads((tmp_path / "res" / "out.json").read_text())
    assert result["completed"] == 8 and result["model_id"] == "fake-model"
    assert result["backend"] == "openai-chat" and result["burstiness"] == 2.0
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "mean_ttft_ms", "std_tpot_ms", "p99.9_itl_ms", "p50_e2el_ms",
                "ttfts", "itls", "input_lens", "output_lens", "errors", "duration"):
        assert key in result, key
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["latency_cdf.png", "throughput_over_time.png", "ttft_over_time.png"]
    for png in (tmp_path / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_are_recorded(server_url):
    from loadtest import ServerError, run_benchmark

    r = run_benchmark(_config(server_url, model="fail", num_prompts=3, ready_check=False))
    assert r["completed"] == 0 and r["failed"] == 3
    assert all(e.startswith("HTTP 503") for e in r["errors"])
    with pytest.raises(ServerError, match="503"):
        run_benchmark(_config(server_url, model="fail", num_prompts=3))


def test_chunk_count_without_usage(server_url):
    from loadtest import run_benchmark

    r = run_benchmark(_config(server_url, model="no-usage", num_prompts=2, random_output_len=5))
    assert r["output_lens"] == [5, 5]
    assert r["input_lens"] == [20, 20]  # the dataset's estimate: one word ~ one token


def test_max_duration_stops_the_run(server_url):
    from loadtest import run_benchmark

    start = time.perf_counter()
    r = run_benchmark(_config(server_url, num_prompts=4, random_output_len=400,
                              max_duration_s=0.6, ready_check=False))
    assert time.perf_counter() - start < 3
    assert r["failed"] == 4 and set(r["errors"]) == {"max duration reached"}


def test_sweep_finds_highest_passing_rate(server_url):
    from loadtest import run_sweep

    cfg = _config(server_url, num_prompts=4, random_output_len=4, max_concurrency=None,
                  goodput_slos_ms={"e2el": 1000})
    sweep = run_sweep(cfg, [8, 4])
    assert [row["request_rate"] for row in sweep["rows"]] == [4, 8]
    assert sweep["max_rate_meeting_slo"] == 8
    strict = run_sweep(cfg.__class__(**{**cfg.__dict__, "goodput_slos_ms": {"ttft": 10}}), [4, 8])
    assert len(strict["rows"]) == 1 and strict["max_rate_meeting_slo"] is None


if __name__ == "__main__":
    _serve()
