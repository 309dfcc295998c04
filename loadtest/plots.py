"""PNG plots of a run, drawn from its result dict alone (so saved JSON can be re-plotted).

Files written into the given directory, ``{prefix}`` being e.g. the run's label:

- ``{prefix}latency_cdf.png``: empirical CDFs of TTFT, TPOT and E2EL, ms.
- ``{prefix}throughput_over_time.png``: output tokens (content chunks) per one-second bucket and
  requests completed per bucket, against seconds since the run started.
- ``{prefix}ttft_over_time.png``: each successful request's TTFT (ms) at its send time (s).

matplotlib is imported lazily with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loadtest.errors import LoadTestError
from loadtest.metrics import chunks_per_second


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise LoadTestError("matplotlib is not installed: pip install 'pdserve[loadtest]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _successful(result: dict) -> list[int]:
    return [i for i, err in enumerate(result.get("errors", [])) if not err]


def latency_samples_ms(result: dict) -> dict[str, np.ndarray]:
    """TTFT, TPOT (requests with > 1 output token) and E2EL of successful requests, ms."""
    ok = _successful(result)
    ttft = np.array([result["ttfts"][i] for i in ok])
    e2el = np.array([result["latencies"][i] for i in ok])
    tpot = np.array([(result["latencies"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1)
                     for i in ok if result["output_lens"][i] > 1])
    return {"TTFT": ttft * 1000, "TPOT": tpot * 1000, "E2EL": e2el * 1000}


def plot_latency_cdf(result: dict, path: Path) -> Path:
    plt = _pyplot()
    samples = latency_samples_ms(result)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, samples.items()):
        if values.size:
            xs = np.sort(values)
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(result: dict, path: Path) -> Path:
    plt = _pyplot()
    ok = _successful(result)
    starts = [result["start_times"][i] for i in ok]
    tokens = chunks_per_second(starts, [result["ttfts"][i] for i in ok],
                               [result["itls"][i] for i in ok], origin=0.0)
    ends = np.array([starts[k] + result["latencies"][i] for k, i in enumerate(ok)])
    done = np.bincount(ends.astype(int), minlength=tokens.size) if ends.size else np.zeros(0)
    fig, ax = plt.subplots(figsize=(8, 4))
    tok_line = ax.stairs(tokens, np.arange(tokens.size + 1), label="output tokens/s")
    ax.set(title="Throughput over time", xlabel="time since start (s)", ylabel="output tokens/s")
    ax2 = ax.twinx()
    req_line = ax2.stairs(done, np.arange(done.size + 1), color="tab:orange",
                          label="completed requests/s")
    ax2.set_ylabel("completed requests/s")
    ax.legend(handles=[tok_line, req_line], loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_ttft_over_time(result: dict, path: Path) -> Path:
    plt = _pyplot()
    ok = _successful(result)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.scatter([result["start_times"][i] for i in ok],
               [result["ttfts"][i] * 1000 for i in ok], s=8)
    ax.set(title="TTFT over time", xlabel="request send time since start (s)", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(result: dict, out_dir: str | Path, prefix: str = "") -> list[Path]:
    """All three plots of ``result`` into ``out_dir`` (created); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_latency_cdf(result, out / f"{prefix}latency_cdf.png"),
            plot_throughput(result, out / f"{prefix}throughput_over_time.png"),
            plot_ttft_over_time(result, out / f"{prefix}ttft_over_time.png")]
