"""Seconds to parse and load a GGUF checkpoint (default: SmolLM2-135M-Instruct), each row in a fresh
process, rounds alternating:

    package-reader    gguf.GGUFReader(path): the gguf package's parser as it ships
    reader            engine.modelfile.gguf_reader(path): the same parser over a plain ndarray
                      view of the file map (what every pdserve worker and test process uses)
    model-native      engine.loader.load_model(path, "native"): reader, weights, tokenizer
    model-fp32        engine.loader.load_model(path, "fp32")

Every worker start and every test cluster in CI pays the model rows once per process (under the
RDMA lab's emulated CPU, many times over). Prints the median and the spread per row and writes
them to ``--json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import arg_parser, write_json

ROWS = ("package-reader", "reader", "model-native", "model-fp32")


def child(row: str, path: str) -> float:
    """Seconds ``row`` takes in this process (call it in a fresh one)."""
    if row == "package-reader":
        import gguf

        t0 = time.perf_counter()
        gguf.GGUFReader(path)
    elif row == "reader":
        from engine.modelfile import gguf_reader

        t0 = time.perf_counter()
        gguf_reader(path)
    else:
        from engine.loader import load_model

        t0 = time.perf_counter()
        load_model(path, weights=row.split("-", 1)[1])
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = arg_parser("bench.gguf_load", __doc__)
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help="run one row in this process (internal)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.model is None:
        from engine.modelfile import default_model_path

        args.model = str(default_model_path())
    if args.child:
        print(json.dumps({"seconds": child(args.child, args.model)}))
        return {}
    rows = args.rows.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seconds: dict[str, list[float]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for row in rows:
            out = subprocess.run([sys.executable, "-m", "bench.gguf_load", "--child", row, "--model", args.model],
                                 capture_output=True, text=True, env=env, check=True)
            seconds[row].append(round(json.loads(out.stdout.strip().splitlines()[-1])["seconds"], 3))
    result = {"model": args.model, "rounds": args.rounds, "rows": []}
    print(f"{args.model}, {args.rounds} rounds, one torch thread")
    print(f"{'row':16} {'median s':>9} {'min s':>7} {'max s':>7}")
    for row in rows:
        s = seconds[row]
        result["rows"].append({"row": row, "seconds": s, "median_s": statistics.median(s)})
        print(f"{row:16} {statistics.median(s):>9.2f} {min(s):>7.2f} {max(s):>7.2f}")
    if args.json:
        write_json(args.json, result, args)
    return result


if __name__ == "__main__":
    main()
