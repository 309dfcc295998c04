"""`loadtest.budget`: how py-spy samples are bucketed (pure logic; the script itself runs pdserve)."""

from __future__ import annotations

from loadtest.budget import classify, parse_raw


def test_the_innermost_project_frame_decides_the_bucket():
    step = ("MainThread;_loop (decode/worker.py:470);_step (decode/worker.py:453);step (engine/generator.py:190);"
            "forward (engine/models/llama.py:95);__call__ (engine/quant.py:178)")
    assert classify(step, "decode") == "engine step"
    finish = "decode-loop;_loop (decode/worker.py:470);_finish (decode/worker.py:380);put (worker/async_sink.py:40)"
    assert classify(finish, "decode") == "gRPC"
    assert classify("decode-loop;_loop (decode/worker.py:470);_admit_arrived (decode/worker.py:390)",
                    "decode") == "worker bookkeeping"
    assert classify("Thread-3;run (threading.py:982);_poll (kvtransfer/connection.py:88)", "prefill") == "kv send"
    sse = "MainThread;run (uvicorn/server.py:60);app (starlette/routing.py:70);chunk (router/response_bodies.py:33)"
    assert classify(sse, "router") == "JSON/SSE"
    assert classify("MainThread;run (uvicorn/server.py:60);recv (h11/_connection.py:400)", "router") == "HTTP"
    assert classify("MainThread;select (selectors.py:468)", "router") == "other"


def test_raw_files_sum_per_bucket(tmp_path):
    raw = tmp_path / "decode.txt"
    raw.write_text("a;forward (engine/models/llama.py:1) 30\n"
                   "a;_loop (decode/worker.py:2) 5\n"
                   "a;forward (engine/models/llama.py:1);x (engine/attention.py:3) 7\n"
                   "garbage line\n")
    assert parse_raw(raw, "decode") == {"engine step": 37, "worker bookkeeping": 5}
    assert parse_raw(tmp_path / "missing.txt", "decode") == {}
