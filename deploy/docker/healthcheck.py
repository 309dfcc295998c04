#!/usr/bin/env python3
"""Container health check of a pdserve role (Docker HEALTHCHECK; exit 0 healthy, 1 not).

It reads the serving process's own command line (PID 1, started by ``pdserve-entrypoint``):
- router: ``GET http://127.0.0.1:<--http-port>/health`` must answer 200, which the router does once
  at least one prefill and one decode worker are connected (503 before).
- prefill / decode: the gRPC port of ``--listen`` must accept a TCP connection. (The data-plane
  port is left alone: a connection that sends no handshake counts as an authentication failure.)
Standard library only; finishes within ``TIMEOUT_S``.
"""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def _flag(argv: list[str], name: str, default: str) -> str:
    """The last value of ``--name VALUE`` or ``--name=VALUE`` (argparse semantics), else default."""
    value = default
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _role(argv: list[str]) -> str:
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in ("router", "prefill", "decode"):
            return argv[i + 1]
    raise SystemExit(f"healthcheck: PID 1 is not a pdserve role: {' '.join(argv)!r}")


def _router_ok(argv: list[str]) -> bool:
    port = _flag(argv, "--http-port", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT_S) as resp:
            print(resp.read(300).decode(errors="replace"))
            return resp.status == 200
    except urllib.error.HTTPError as exc:
        print(f"/health answered {exc.code}: {exc.read(300).decode(errors='replace')}")
    except OSError as exc:
        print(f"/health unreachable: {exc}")
    return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S):
            return True
    except OSError as exc:
        print(f"port {port}: {exc}")
        return False


def _worker_ok(argv: list[str]) -> bool:
    port = int(_flag(argv, "--listen", "127.0.0.1:0").rpartition(":")[2])
    return _port_open(port) if port else True


def main() -> int:
    with open("/proc/1/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    ok = _router_ok(argv) if _role(argv) == "router" else _worker_ok(argv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
