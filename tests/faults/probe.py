"""Read the cluster's state from inside a namespace: the router's /admin/workers and /metrics,
and every worker's gRPC Stats. Prints one JSON object. Used by the fault tests, whose own process
lives outside the lab's namespaces.

    python -m tests.faults.probe --url http://10.77.0.1:8000
"""

from __future__ import annotations

import argparse
import json

import grpc
import httpx

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pbg
from rpc.auth import call_metadata
from rpc.auth import read_secret


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    args = ap.parse_args()
    out = {"workers": {}, "metrics": {}}
    members = httpx.get(f"{args.url}/admin/workers", timeout=10).json()
    md = call_metadata(read_secret(None))
    for m in members:
        entry = {"role": m["role"], "state": m.get("state")}
        try:
            with grpc.insecure_channel(m["grpc_address"]) as ch:
                stub = (pbg.PrefillStub if m["role"] == "prefill" else pbg.DecodeStub)(ch)
                s = stub.Stats(pb.StatsRequest(), timeout=5, metadata=md)
            entry.update(free=s.load.free_blocks, total=s.load.total_blocks,
                         held_blocks=s.load.total_blocks - s.load.free_blocks, running=s.load.running,
                         waiting=s.load.waiting, counters=dict(s.counters))
        except grpc.RpcError as exc:
            entry["error"] = str(exc.code())
        out["workers"][m["id"]] = entry
    for line in httpx.get(f"{args.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out["metrics"][name] = float(value)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
