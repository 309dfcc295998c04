"""Single-request latency: disaggregated cluster vs the single-process engine, in one run.

    python -m bench.latency [--prompt-tokens 512] [--max-tokens 64] [--repeats 5]
                            [--transfer-engine auto] [--json PATH]

For one greedy request at a time (nothing else running), measures TTFT (request sent -> first
token) and ITL (mean gap between later tokens), as medians over ``--repeats``:
- ``engine``: the single-process `Generator` in this process (one torch thread), timed around
  `Generator.step`;
- ``disaggregated``: router + 1 prefill + 1 decode started by the launcher, timed by a streaming
  HTTP client (so it includes HTTP, tokenization, two gRPC hops, the KV transfer and SSE).
The engine runs first, before the cluster starts, so neither competes with the other for cores.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import httpx

from bench.common import arg_parser, write_json
from deploy.launcher import WEIGHT_MODES, Cluster, LauncherConfig


def _prompt_ids(tokenizer, n: int) -> list[int]:
    text = "Summarise the following notes. " + " ".join(f"note {i}: the meeting moved to room {i % 7}." for i in range(n))
    return tokenizer.encode(text)[:n]


def measure_engine(prompt: list[int], max_tokens: int, repeats: int,
                   weights: str = "fp32") -> tuple[list[float], list[float]]:
    from engine.config import CacheConfig
    from engine.loader import build_generator, load_model, set_torch_threads
    from engine.sampling import SamplingParams

    set_torch_threads(1)
    loaded = load_model(weights=weights)
    gen = build_generator(loaded, CacheConfig(num_blocks=512, dtype=loaded.kv_dtype))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ttfts, itls = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        gen.add_request(f"lat-{r}", prompt, params)
        stamps = []
        while gen.has_unfinished():
            if gen.step():
                stamps.append(time.perf_counter())
        if r:  # the first run warms up
            ttfts.append(stamps[0] - t0)
            itls.append(statistics.mean(b - a for a, b in zip(stamps, stamps[1:])))
    return ttfts, itls


def measure_cluster(url: str, prompt: list[int], max_tokens: int, repeats: int) -> tuple[list[float], list[float]]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    ttfts, itls = [], []
    with httpx.Client(timeout=300) as http:
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            stamps = []
            with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        stamps.append(time.perf_counter())
            if r:
                ttfts.append(stamps[0] - t0)
                itls.append(statistics.mean(b - a for a, b in zip(stamps, stamps[1:])))
    return ttfts, itls


def main(argv=None) -> dict:
    ap = arg_parser("bench.latency", __doc__)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transfer-engine", default="auto")
    ap.add_argument("--weights", default="fp32", choices=WEIGHT_MODES)
    ap.add_argument("--json", default=None)
    ap.add_argument("--settle-s", type=float, default=20.0,
                    help="idle time after the cluster is up before measuring (workers finish warming up)")
    args = ap.parse_args(argv)
    from engine.tokenizer import Tokenizer
    from engine.modelfile import default_model_path

    prompt = _prompt_ids(Tokenizer.from_file(default_model_path()), args.prompt_tokens)
    rows = {"engine": measure_engine(prompt, args.max_tokens, args.repeats, args.weights)}
    config = LauncherConfig(http_port=0, registry_port=0, transfer_engine=args.transfer_engine, weights=args.weights,
                            log_dir=tempfile.mkdtemp(prefix="pdserve-latency-"))
    with Cluster(config).start() as cluster:
        time.sleep(args.settle_s)
        rows["disaggregated"] = measure_cluster(cluster.url, prompt, args.max_tokens, args.repeats)
    result = {"prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "transfer_engine": args.transfer_engine, "weights": args.weights, "rows": {}}
    print(f"prompt {len(prompt)} tokens, {args.max_tokens} new tokens, median of {args.repeats}, "
          f"transfer engine {args.transfer_engine}, weights {args.weights}")
    print(f"{'path':14} {'TTFT ms':>9} {'ITL ms':>8}")
    for name, (ttfts, itls) in rows.items():
        ttft, itl = statistics.median(ttfts) * 1e3, statistics.median(itls) * 1e3
        result["rows"][name] = {"ttft_ms": ttft, "itl_ms": itl, "ttfts_ms": [t * 1e3 for t in ttfts],
                                "itls_ms": [t * 1e3 for t in itls]}
        print(f"{name:14} {ttft:9.1f} {itl:8.1f}")
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
