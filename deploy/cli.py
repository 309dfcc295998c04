"""The ``pdserve`` command.

    pdserve generate "prompt"     # the single-process engine answers one prompt
    pdserve up                    # router + 1 prefill + 1 decode on http://127.0.0.1:8000
    pdserve doctor                # pyverbs, RDMA ports and GIDs, memlock, GPUDirect, auto's choice

Every flag mirrors a config field; environment variables are not read here (see
`engine.loader.set_torch_threads` for ``PDSERVE_THREADS``).
"""

from __future__ import annotations

import argparse
import os
import sys

from deploy.launcher import TRANSFER_ENGINES, WEIGHT_MODES


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                   help="auto (default: the checkpoint's own format where this machine runs it natively), "
                        "fp32 (reference), bf16, or native: the GGUF's 4-bit projections as stored")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")


def _generate(args: argparse.Namespace) -> int:
    from engine.config import CacheConfig
    from engine.errors import EngineError
    from engine.loader import build_generator, load_model, set_torch_threads
    from engine.sampling import SamplingParams

    set_torch_threads(args.threads)
    loaded = None
    try:
        loaded = load_model(args.model, args.weights, tensor_parallel_size=args.tensor_parallel_size)
        gen = build_generator(loaded, CacheConfig(num_blocks=args.num_blocks, dtype=loaded.kv_dtype))
        tk = loaded.tokenizer
        text = args.prompt if args.raw else tk.apply_chat_template([{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
        gen.add_request("cli", tk.encode(text), params)
        while gen.has_unfinished():
            for out in gen.step():
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        close = getattr(loaded.model, "close", None) if loaded is not None else None
        if close is not None:   # a tensor-parallel model's rank processes
            close()
    return 0


def attention_backend(args: argparse.Namespace) -> str:
    """``--attention-backend`` as given, else ``auto`` when every worker runs at tensor parallel
    size 1 (the compiled kernel does not run sharded), else ``grouped``."""
    if args.attention_backend is not None:
        return args.attention_backend
    return "auto" if args.decode_tp == 1 and args.prefill_tp == 1 else "grouped"


def launcher_config(args: argparse.Namespace):
    """The `deploy.launcher.LauncherConfig` that ``pdserve up`` flags describe.
    Raises ValueError for settings that do not fit together (`LauncherConfig`)."""
    from deploy.launcher import LauncherConfig

    return LauncherConfig(
        num_prefill=args.prefill, num_decode=args.decode, http_host=args.http_host,
        http_port=args.http_port, registry_port=args.registry_port,
        transfer_engine=args.transfer_engine, model=args.model, weights=args.weights,
        num_blocks=args.num_blocks,
        threads=args.threads or 1, log_dir=args.log_dir, startup_timeout_s=args.startup_timeout,
        grace_s=args.grace, serving_mode=args.serving_mode,
        colocated_threshold_tokens=args.colocated_threshold_tokens,
        cpu_affinity=default_affinity(args) if args.cpu_affinity is None else args.cpu_affinity, lend_idle_cpus=args.lend_idle_cpus, decode_tp=(args.decode_tp,), prefill_tp=(args.prefill_tp,), device=args.device,
        worker_args=(("--prefix-caching",) if args.prefix_caching else ())
        + (() if args.enforce_eager else ("--no-enforce-eager",))
        + (("--linear-backend", args.linear_backend) if args.linear_backend != "auto" else ())
        + (("--prefill-batch-tokens", str(args.prefill_batch_tokens)) if args.prefill_batch_tokens else ())
        + ("--attention-backend", attention_backend(args), "--kv-send", args.kv_send,
           "--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding),
           "--max-prefill-seconds-while-decoding", str(args.max_prefill_seconds_while_decoding)),
        router_args=("--policy", args.policy or ("kv" if args.prefix_caching else "load")))


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from deploy.launcher import Cluster, LaunchError

    try:
        config = launcher_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The handlers only append: a handler runs in the main thread, possibly while it holds a lock
    # (an Event's, inside wait()), and one that takes that lock again blocks the process forever
    # (`worker.runtime.install_stop_signals`). The loop below polls the lists.
    stop_signal: list[int] = []
    child_exited: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_signal.append(signum))
    signal.signal(signal.SIGCHLD, lambda signum, _frame: child_exited.append(signum))
    cluster = Cluster(config)
    print(f"starting router + {config.num_prefill} prefill + {config.num_decode} decode "
          f"(logs in {cluster.log_dir}) ...", flush=True)
    try:
        cluster.start()
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if stop_signal:  # Ctrl-C during start-up
        cluster.stop()
        return 0
    print(f"pdserve is up: {cluster.url}/v1  (OpenAI API; Ctrl-C stops)", flush=True)
    try:
        if args.ask:
            _ask(cluster.url, args.ask)
        checked = time.monotonic()
        while not stop_signal:
            time.sleep(0.2)
            if not child_exited and time.monotonic() - checked < 5.0:
                continue
            child_exited.clear()
            checked = time.monotonic()
            dead = cluster.dead_children()
            if dead and not stop_signal:
                for child in dead:
                    print(f"error: {child.name} exited with code {child.popen.returncode}; log "
                          f"{child.log_path}:\n{child.log_tail()}", file=sys.stderr)
                return 1
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
    return 0


def _ask(url: str, question: str) -> None:
    """Send ``question`` through the OpenAI chat API (streamed), to the model ``/v1/models``
    lists, and print the answer."""
    import json

    import httpx

    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]   # the name the router serves
    body = {"model": models[0]["id"], "messages": [{"role": "user", "content": question}],
            "max_tokens": 128, "temperature": 0, "stream": True}
    print(f"> {question}", flush=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            print(f"error: HTTP {resp.status_code}: {resp.read().decode(errors='replace')}", file=sys.stderr)
            return
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    sys.stdout.write(choice.get("delta", {}).get("content") or "")
                    sys.stdout.flush()
    print(flush=True)


def _doctor(args: argparse.Namespace) -> int:
    import json

    from kvtransfer import EngineConfig, VerbsConfig
    from kvtransfer.doctor import diagnose
    from rpc.auth import read_secret

    verbs = VerbsConfig(device=args.rdma_device, port=args.rdma_port, gid_index=args.rdma_gid_index)
    report = diagnose(EngineConfig(secret=read_secret(None), verbs=verbs))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def default_affinity(args: argparse.Namespace) -> tuple[int, ...]:
    """``pdserve up``'s pinning when ``--cpu-affinity`` is not given: each worker on a CPU of its
    own, in start order, when every worker runs one torch thread on the CPU and this process may
    use a CPU for each (then idle CPUs are lent, `worker.cpu_board`); otherwise none. Measured
    against no pinning: docs/PERFORMANCE.md, "Lending idle CPUs"."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    workers = args.prefill + args.decode
    if ((args.threads or 1) > 1 or args.device != "cpu" or args.prefill_tp > 1 or args.decode_tp > 1
            or not 2 <= workers <= len(cpus)):
        return ()
    return tuple(cpus[:workers])


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPU numbers like 0,1: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """``pdserve``'s command line: the ``generate``, ``up`` and ``doctor`` subcommands."""
    ap = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregated LLM serving")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt with the single-process engine")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the text as is")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks (16 tokens each)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N processes (engine.tp; each with --threads torch threads)")
    _add_model_flags(g)
    g.set_defaults(func=_generate)
    u = sub.add_parser("up", help="run router + prefill + decode workers on this host")
    u.add_argument("--prefill", type=int, default=1,
                   help="prefill workers (0 allowed with --serving-mode colocated|auto)")
    u.add_argument("--decode", type=int, default=1, help="decode workers")
    u.add_argument("--decode-tp", type=int, default=1, help="tensor parallel size of each decode worker")
    u.add_argument("--prefill-tp", type=int, default=1, help="tensor parallel size of each prefill worker")
    u.add_argument("--device", default="cpu", help="where every worker's weights and KV pool live: cpu or cuda[:n]")
    u.add_argument("--http-host", default="127.0.0.1")
    u.add_argument("--http-port", type=int, default=8000, help="OpenAI API port (0: any free port)")
    u.add_argument("--registry-port", type=int, default=50050, help="router's worker registry port")
    u.add_argument("--transfer-engine", default="auto", choices=list(TRANSFER_ENGINES))
    u.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool blocks per worker (default: 1024 per prefill worker, 2048 per decode worker)")
    u.add_argument("--log-dir", default=None, help="per-process logs (default: a temp dir)")
    u.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds every worker may take to register (default 600: a first start on a new machine builds and times its kernels)")
    u.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    u.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    u.add_argument("--threads", type=int, default=None, help="torch threads per worker (default 1)")
    u.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                   help="every worker's weights: auto (default: the checkpoint's own format where this "
                        "machine runs it natively: a 4-bit GGUF native, a bfloat16 checkpoint bf16 on a CPU "
                        "with bfloat16 matmuls), fp32 (reference), bf16, or native (the GGUF's 4-bit "
                        "projections as stored)")
    u.add_argument("--serving-mode", default="auto",
                   choices=["disaggregated", "colocated", "auto"],
                   help="auto (default): disaggregated, but prompts under --colocated-threshold-tokens "
                        "colocated, and longer ones while the prefill workers are backed up (router's "
                        "--auto-prefill-backlog-tokens): on two cores the higher throughput and the lower "
                        "TTFT p99 and TPOT p50 (docs/PERFORMANCE.md, \"Auto mode by default\"); "
                        "disaggregated: every prompt on a prefill worker, decode never held up by one; "
                        "colocated: decode workers run whole requests (no KV transfer)")
    u.add_argument("--colocated-threshold-tokens", type=int, default=0,
                   help="with --serving-mode auto: prompts with fewer tokens run colocated (0: never)")
    u.add_argument("--max-prefill-tokens-while-decoding", type=int, default=2048, metavar="TOKENS",
                   help="colocated and auto modes: most prompt tokens a decode worker's pass carries "
                        "beside decoding sequences (default: vLLM's CPU budget; smaller: a lower ITL "
                        "p99, more steps holding up decode)")
    u.add_argument("--max-prefill-seconds-while-decoding", type=float, default=1.0, metavar="SECONDS",
                   help="colocated and auto modes: and at most the prompt tokens the decode worker's measured "
                        "rate computes in this long, so a step beside decoding sequences takes about this "
                        "long on a slow CPU too (0: the token budget alone)")
    u.add_argument("--prefill-batch-tokens", type=int, default=0, metavar="TOKENS",
                   help="prompts after a pass's first join it only while the pass stays within this "
                        "many prompt tokens (engine.scheduling; 0: the prefill worker's knee, timed once per "
                        "machine on the CPU, engine.prefill_knee, a pass's token cap on CUDA; a decode "
                        "worker's colocated prompts up to its step budget, as vLLM)")
    u.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching on every worker (recompute and resend only what no cache "
                        "holds) and KV-aware routing (--policy kv unless --policy says otherwise); on by "
                        "default, as in vLLM V1 and SGLang (a worker turns it off, and logs why, for a "
                        "model whose rope depends on the sequence's length)")
    u.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="run the model eagerly (default; vLLM's name); --no-enforce-eager: every worker "
                        "runs its layers as torch.compile graphs built at start-up (engine.compiled; "
                        "no faster on the CPU, measured: docs/PERFORMANCE.md, 'Compiled layers'), and "
                        "with --device cuda a decode worker replays its decode steps from CUDA graphs")
    u.add_argument("--linear-backend", default="auto", choices=["auto", "onednn", "torch", "template"],
                   help="CPU workers' projection kernels (engine.linear): auto (oneDNN's packed weights), "
                        "or template: oneDNN, and decode steps' bfloat16 matmuls of 2-64 rows through "
                        "inductor's GEMM template (engine.gemm_template; a second copy of those weights, "
                        "packages built at the first start and kept on disk; measured: docs/PERFORMANCE.md, "
                        "'A step's projections through inductor's GEMM template')")
    u.add_argument("--attention-backend", default=None, choices=["auto", "grouped", "compiled"],
                   help="CPU workers' attention: compiled (decode attention reads the pool through the block "
                        "table, engine.paged_decode.CompiledDecode; prompts attend through FlexAttention, "
                        "engine.flex_prefill.CompiledPrefill; AOTInductor packages built at the first start and kept on disk; "
                        "measured: docs/PERFORMANCE.md, 'Decode attention through the block table' and "
                        "'Prefill attention through FlexAttention'), grouped (K/V gathered per group and "
                        "attended by SDPA; prompts by SDPA), or auto (compiled where inductor can build it, "
                        "else grouped with a warning; the prompt kernel kept only for the lengths it beats SDPA at, "
                        "timed at start-up, engine.prefill_choice); default: auto at tensor parallel size 1, "
                        "grouped with TP")
    u.add_argument("--kv-send", default="auto", choices=["auto", "layer", "pass"],
                   help="when prefill workers post a prompt's KV writes: layer (each layer's as it "
                        "finishes, overlapping the rest of the pass), pass (all once the pass ends), or "
                        "auto (pass on the CPU, where the pass keeps every CPU busy; layer on a GPU; "
                        "measured: docs/PERFORMANCE.md, 'When the KV is sent')")
    u.add_argument("--policy", default=None, choices=["load", "kv", "round_robin"],
                   help="the router's placement policy (default: kv with prefix caching, load with --no-prefix-caching)")
    u.add_argument("--ask", default=None, metavar="QUESTION",
                   help="once up, send QUESTION through the OpenAI API and print the answer; keep serving")
    u.add_argument("--cpu-affinity", type=_cpu_list, default=None, metavar="CPU,CPU,...",
                   help="pin workers --threads CPUs each, in order prefill-0.., decode-0.. (cycling); default: "
                        "a CPU each when every worker runs one thread and there are CPUs enough; '' pins none")
    u.add_argument("--lend-idle-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="with --cpu-affinity giving each worker a CPU of its own: a worker's prompt chunks "
                        "also run on the other workers' CPUs while those wait for work (worker.cpu_board)")
    u.set_defaults(func=_up)
    d = sub.add_parser("doctor", help="check this host's RDMA / GPU data plane and what auto would pick")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--rdma-device", default="", help="device auto would use (default: the first)")
    d.add_argument("--rdma-port", type=int, default=1)
    d.add_argument("--rdma-gid-index", type=int, default=-1, help="-1: let the engine choose")
    d.set_defaults(func=_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
