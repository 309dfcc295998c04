"""Worker configuration: one frozen dataclass, validated when built; CLI flags mirror the fields.

The cluster secret comes from ``--secret-file``, else ``$PDSERVE_SECRET`` (`rpc.auth.read_secret`).
"""

from __future__ import annotations

import argparse
import socket
import uuid
from dataclasses import dataclass, fields

from engine.config import kv_cache_dtype, weights_dtype
from rpc.auth import DEV_SECRET, read_secret

ROLES = ("prefill", "decode")
TRANSFER_ENGINES = ("auto", "tcp", "shm", "verbs", "cuda_ipc")
ATTENTION_BACKENDS = ("grouped", "compiled", "auto")
LINEAR_BACKENDS = ("auto", "onednn", "torch", "template")   # engine.linear.BACKENDS (no torch import here)
KV_SEND_MODES = ("auto", "layer", "pass")
# KV pool blocks per role when --num-blocks is not given. A decode worker holds every running
# sequence's KV (2048 blocks: 32 sequences of 1,024 tokens). A prefill worker holds a prompt
# from its pass until its KV is sent, plus the prefix cache: 1024 blocks fit two prompts of the
# model's longest context (SmolLM2: 8,192 tokens = 512 blocks), far above what a prefill worker
# uses under load (measured: docs/PERFORMANCE.md, "KV pool and worker memory"). Half the blocks
# is 0.75 GB less RSS in float32.
DEFAULT_NUM_BLOCKS = {"prefill": 1024, "decode": 2048}


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one prefill or decode worker.

    Fields:
        role: "prefill" or "decode".
        router: host:port of the router's Registry gRPC service.
        listen: host:port this worker's gRPC server binds (port 0: pick a free one).
        advertise_host: host the router and peers should dial (default: the listen host).
        worker_id: unique name (default: role-hostname-random).
        model: GGUF file or HF directory (None: SmolLM2-135M-Instruct).
        weights: "fp32", "bf16" or "native" (the GGUF's 4-bit projections as stored; bfloat16
            activations and KV pool): `engine.config.WEIGHT_MODES`; or "auto", resolved when the
            model loads (`engine.loader.resolve_weights`). Prefill and decode workers
            of one cluster must agree (it is part of the compatibility hash).
        device: "cpu" or "cuda[:n]": where weights and the KV pool live. A CUDA pool is registered
            for GPUDirect RDMA with verbs, and staged through a pinned host mirror with tcp and
            shm (`kvtransfer.staging`).
        num_blocks: KV pool blocks of ``block_size`` tokens; 0: the role's default,
            `DEFAULT_NUM_BLOCKS` (a prefill worker holds only the prompts it computes or sends
            and its prefix cache; docs/PERFORMANCE.md "KV pool and worker memory" has the
            measurement).
        block_size: tokens per KV block.
        max_num_seqs: decode: most sequences in the running batch (vLLM's default, 256);
            requests whose KV arrived beyond it wait, their blocks held, for a place.
        max_num_batched_tokens: prefill: most prompt tokens per forward pass (longer prompts are
            chunked).
        max_prefill_tokens_while_decoding: decode, colocated and auto modes: most prompt tokens
            a pass carries beside running sequences (chunked prefill, Sarathi-Serve's token
            budget); the default is vLLM's CPU server budget (2048 tokens a step): fewer steps
            that hold up every decoding sequence, each longer. A smaller budget bounds how long
            a prompt chunk holds up a decoding sequence's next token (ITL p99) and spreads a
            burst over more steps, each of which delays them all (measured: docs/PERFORMANCE.md,
            "Colocated steps at vLLM's budget").
        max_prefill_seconds_while_decoding: decode, colocated and auto modes: a pass beside
            running sequences also carries at most the prompt tokens the worker's measured rate
            computes in this many seconds (`engine.config.SchedulerConfig`), so such a pass takes
            about this long on a slow CPU too, where the token budget above alone held decoding
            sequences up many times longer (measured: docs/PERFORMANCE.md, "Prompt tokens beside
            decoding sequences, bounded in time"). 0: the token budget alone.
        prefill_batch_tokens: prompts after a pass's first join it only while its prompt
            tokens stay within this (`engine.scheduling`). 0: the prefill worker batches to the
            device's throughput knee, on the CPU timed at start-up (`engine.prefill_knee`, kept
            per machine; 128 where it is not timed: compiled layers, tensor parallelism, a pool
            too small to time in), ``max_num_batched_tokens`` on CUDA; a decode worker's passes
            (colocated and auto modes) batch to ``max_num_batched_tokens``, as vLLM's scheduler:
            each of them holds up its decoding sequences, so fewer of them is the gain.
        prefix_caching: keep a prefix cache of full KV blocks (engine.kv_cache): the prefill worker
            computes only what follows a prompt's cached prefix; the decode worker holds the
            cached blocks of a prompt at Reserve so they are not sent again (delta transfer)
            and caches what it decodes; both publish their cache's changes on the heartbeat
            (KV-aware routing).
        warmup_chunk_tokens: prefill with prefix caching: most tokens per forward pass of a
            prefix-cache warm-up (`prefill.worker`; a prefill arriving stops the pass).
        threads: torch threads of this process (and of each tensor-parallel rank).
        tensor_parallel_size: N > 1 shards the model over N processes (`engine.tp`): this one
            and N - 1 rank processes it starts, each its own data-plane endpoint (`worker.tp_rank`;
            with a fixed ``transfer_port``, rank r listens on ``transfer_port + r``).
        enforce_eager: run the model's layers eagerly (vLLM's name); False: as compiled graphs
            (`engine.compiled`: ``torch.compile``, built at start-up, their build time logged,
            inductor's caches on disk so a restart reuses them), and on a GPU a decode worker
            replays its decode steps from CUDA graphs (`engine.cuda_graphs`).
        attention_backend: a CPU worker's attention: "grouped" (a decode worker's decode
            attention: each group of sequences' K/V gathered, cast and attended by SDPA; prompts
            by SDPA), or "compiled" (decode workers: `engine.paged_decode.CompiledDecode`, the
            pool read through the block table by inductor's code; every worker: the attention of
            prompt chunks (cached context too) through FlexAttention,
            `engine.flex_prefill.CompiledPrefill`; both AOTInductor packages, loaded from disk or
            built at start-up (`engine.aot_kernel`), their time logged;
            needs a C++ compiler for inductor: refused to start without one), or "auto"
            (compiled where it builds, else grouped with a warning saying why, the prompt kernel
            kept only for the chunk lengths it beat SDPA at, timed at start-up by
            `engine.prefill_choice`; ``pdserve up``'s default). CUDA pools (Triton) ignore it.
        linear_backend: the projections' kernels (`engine.linear`): "auto" (oneDNN's packed
            weights on the CPU), "onednn", "torch", or "template" (oneDNN, and a decode step's
            bfloat16 dense matmuls of 2 to `engine.linear.TEMPLATE_MAX_ROWS` rows through inductor's
            GEMM template, `engine.gemm_template`: a second copy of the layers' projection weights, each weight
            shape's package loaded or built at start-up on every thread count a decode pass may
            take, its time logged; refused to start where it cannot be built; tensor parallel size
            1, CPU only).
        parallel_min_tokens: with ``threads`` > 1, forward passes of fewer tokens run on one
            thread (a pass of a few rows gains little from a second thread and waits at each
            operator's barrier for a thread another process took off a shared core), longer
            ones, decode steps of 8 rows and more included, on all ``threads``
            (`engine.runner.ModelRunner`); 0: every pass on all (measured: docs/PERFORMANCE.md,
            "Threads per pass" and "Decode attention on the pass's threads, and where a served
            core goes").
        cpu_board / borrow_cpus: lending idle CPUs between the workers of one host
            (`worker.cpu_board`): the board file the launcher made, and the CPUs ("1,3") this
            worker may add a thread on for a pass of at least ``parallel_min_tokens`` tokens while
            their owners wait for work; its own CPUs, which it marks on the board, are the rest of
            its affinity. Both empty: no lending. CPU workers at TP 1 only.
        transfer_engine: kvtransfer engine name ("auto" picks verbs/tcp, shm per same-host peer).
        transfer_port: port of the data-plane listener (0: ephemeral).
        max_write_bytes: largest single KV write (bytes); writes are split above it.
        kv_send: prefill: when the pass holding a prompt's last chunk posts its KV writes: "layer"
            (each layer's as it finishes: the transfer overlaps the rest of the pass), "pass"
            (every layer's once the pass ends), or "auto": "pass" on the CPU (the pass keeps every
            CPU it has busy, and each layer's posting, the sender's copies and the receiver's
            wake-ups take one of them from its thread team, which then waits at the next
            operator), "layer" on a GPU (the copy engine or the NIC moves the bytes). The first
            token is returned once every write completed, either way.
        heartbeat_interval_s: seconds between heartbeats (the router may override at register).
        transfer_timeout_s: decode: deadline for a reservation's KV to arrive, from Reserve.
        prefill_timeout_s: prefill: lease of a request (compute + transfer), seconds.
        quarantine_s: decode: how long blocks of a failed transfer stay out of the pool when the
            writer's stop cannot be confirmed (must exceed every writer's lease).
        rdma_device: verbs engine: RDMA device name (empty: the first one found).
        rdma_port: verbs engine: HCA port (1-based).
        rdma_gid_index: verbs engine: GID table index; -1 = choose (a RoCE v2 GID, IPv4-mapped first).
        rdma_mtu: verbs engine: path MTU in bytes (256..4096).
        tls_cert / tls_key / tls_ca: PEM files enabling TLS on gRPC (all three, or none).
        secret: cluster secret authenticating data-plane peers (>= 16 bytes).
    """

    role: str
    router: str = "127.0.0.1:50050"
    listen: str = "127.0.0.1:0"
    advertise_host: str = ""
    worker_id: str = ""
    model: str | None = None
    weights: str = "fp32"
    device: str = "cpu"
    num_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 2048
    max_prefill_seconds_while_decoding: float = 1.0
    prefill_batch_tokens: int = 0
    prefix_caching: bool = False
    warmup_chunk_tokens: int = 128
    threads: int = 1
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    attention_backend: str = "grouped"
    linear_backend: str = "auto"
    parallel_min_tokens: int = 8
    cpu_board: str = ""
    borrow_cpus: str = ""
    transfer_engine: str = "auto"
    transfer_port: int = 0
    max_write_bytes: int = 4 << 20
    kv_send: str = "auto"
    heartbeat_interval_s: float = 1.0
    transfer_timeout_s: float = 60.0
    prefill_timeout_s: float = 60.0
    quarantine_s: float = 90.0
    rdma_device: str = ""
    rdma_port: int = 1
    rdma_gid_index: int = -1
    rdma_mtu: int = 4096
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    secret: bytes = DEV_SECRET

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.num_blocks == 0:
            object.__setattr__(self, "num_blocks", DEFAULT_NUM_BLOCKS[self.role])
        if self.transfer_engine not in TRANSFER_ENGINES:
            raise ValueError(f"transfer_engine must be one of {TRANSFER_ENGINES}, got {self.transfer_engine!r}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "warmup_chunk_tokens",
                     "threads", "tensor_parallel_size",
                     "max_write_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_send not in KV_SEND_MODES:
            raise ValueError(f"kv_send must be one of {KV_SEND_MODES}, got {self.kv_send!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend != "grouped" and self.tensor_parallel_size > 1:
            raise ValueError(f"attention_backend {self.attention_backend} runs at tensor parallel size 1 only; "
                             f"use grouped")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        if self.linear_backend == "template" and (self.tensor_parallel_size > 1 or self.device != "cpu"):
            raise ValueError("linear_backend template runs on the CPU at tensor parallel size 1 only")
        if self.parallel_min_tokens < 0:
            raise ValueError(f"parallel_min_tokens must be >= 0, got {self.parallel_min_tokens}")
        if bool(self.cpu_board) != bool(self.borrow_cpus):
            raise ValueError("cpu_board and borrow_cpus go together (both or neither)")
        if self.borrow_cpus:
            self.lent_cpus()   # ValueError when malformed
            if self.device != "cpu" or self.tensor_parallel_size > 1:
                raise ValueError("borrow_cpus: CPU lending is for CPU workers at tensor parallel size 1")
        if self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1, "
                             f"got {self.max_prefill_tokens_while_decoding}")
        if not self.max_prefill_seconds_while_decoding >= 0:
            raise ValueError("max_prefill_seconds_while_decoding must be >= 0 seconds (0: tokens only), "
                             f"got {self.max_prefill_seconds_while_decoding}")
        if self.prefill_batch_tokens < 0:
            raise ValueError(f"prefill_batch_tokens must be >= 0 (0: the device's default), "
                             f"got {self.prefill_batch_tokens}")
        for name in ("heartbeat_interval_s", "transfer_timeout_s", "prefill_timeout_s", "quarantine_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.weights != "auto":   # auto: resolved when the model loads (`worker.runtime.build_resources`)
            weights_dtype(self.weights)   # ValueError for an unknown mode
        if self.weights == "native" and self.device != "cpu":
            raise ValueError("native (4-bit) weights run on the CPU only; use --weights bf16 on CUDA")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {self.device!r}")
        if self.transfer_engine == "cuda_ipc" and not self.device.startswith("cuda"):
            raise ValueError("the cuda_ipc transfer engine moves GPU pools: it needs --device cuda")
        if self.tensor_parallel_size > 1 and not self.enforce_eager:
            raise ValueError("compiled layers do not run tensor-parallel yet; use --enforce-eager")
        if self.quarantine_s <= self.prefill_timeout_s:
            raise ValueError("quarantine_s must exceed prefill_timeout_s (a writer's lease)")
        if len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        _split_hostport(self.listen)
        _split_hostport(self.router)
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")

    @property
    def dtype(self) -> str:
        """Activation dtype of ``weights`` ("float32" or "bfloat16")."""
        return weights_dtype(self.weights)

    @property
    def kv_dtype(self) -> str:
        """KV pool dtype of ``weights`` ("float32" or "bfloat16"; `engine.config.KV_CACHE_DTYPES`)."""
        return kv_cache_dtype(self.weights)

    @property
    def kv_send_per_layer(self) -> bool:
        """``kv_send`` resolved: True to post each layer's KV writes as it finishes."""
        return self.kv_send == "layer" or (self.kv_send == "auto" and self.device != "cpu")

    @property
    def listen_host(self) -> str:
        return _split_hostport(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return _split_hostport(self.listen)[1]

    @property
    def host_for_peers(self) -> str:
        return self.advertise_host or self.listen_host

    def lent_cpus(self) -> tuple[int, ...]:
        """``borrow_cpus`` as CPU numbers. Raises ValueError naming the field when malformed."""
        try:
            cpus = tuple(int(c) for c in self.borrow_cpus.split(",") if c.strip())
        except ValueError:
            raise ValueError(f"borrow_cpus must list CPU numbers like '1,3', got {self.borrow_cpus!r}") from None
        if any(c < 0 for c in cpus):
            raise ValueError(f"borrow_cpus must list CPU numbers >= 0, got {self.borrow_cpus!r}")
        return cpus

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field (``secret`` becomes ``--secret-file``)."""
        for f in fields(cls):
            if f.name in ("role", "secret"):
                continue
            flag = "--" + f.name.replace("_", "-")
            if str(f.type) == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, dest=f.name)
                continue
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, dest=f.name)
        parser.add_argument("--secret-file", default=None,
                            help="file holding the cluster secret (default: $PDSERVE_SECRET)")

    @classmethod
    def from_args(cls, role: str, args: argparse.Namespace) -> "WorkerConfig":
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in ("role", "secret")}
        return cls(role=role, secret=read_secret(args.secret_file), **values)


def _split_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)
