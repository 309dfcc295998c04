"""Perplexity of each ``--weights`` mode on a fixed text, beside llama.cpp's for the same file.

    python -m bench.perplexity [--weights fp32,native,bf16] [--text FILE] [--ctx 512]
                               [--chunks N] [--llama-perplexity PATH] [--json PATH]

The protocol is llama.cpp's ``llama-perplexity`` (``tools/perplexity/perplexity.cpp``,
``perplexity()``), so the figures compare: the text is tokenized once (BOS first when the GGUF
says ``add_bos_token``), cut into ``len // ctx`` chunks of ``ctx`` tokens (``--chunks`` caps
them), each chunk's first token replaced by BOS when the model adds one, and every chunk scored
independently on its second half only: positions ``ctx/2 .. ctx-2`` predict the next token,
``nll += -log_softmax(logits)[next]`` (float32, over ``ctx - 1 - ctx/2`` tokens per chunk);
``PPL = exp(nll / count)``. ``--llama-perplexity`` runs the binary on the same file with the same
``-c`` and ``--chunks`` and one thread, and reads its "Final estimate: PPL = ..." line.

The default text is the GNU GPL v3 (``/usr/share/common-licenses/GPL-3``: on every Debian system,
fixed, English prose); any UTF-8 file works with ``--text``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import arg_parser, write_json
from engine.attention import ForwardBatch, SeqChunk
from engine.config import CacheConfig
from engine.kv_cache import KVPool, blocks_needed
from engine.loader import LoadedModel, load_model

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def chunks_of(tokens: list[int], ctx: int, max_chunks: int | None) -> list[list[int]]:
    """``len(tokens) // ctx`` consecutive chunks of ``ctx`` tokens (at most ``max_chunks``).
    Raises ValueError when the text holds fewer than two chunks (llama.cpp's own minimum)."""
    if ctx < 4:
        raise ValueError(f"ctx must be >= 4 tokens, got {ctx}")
    if len(tokens) < 2 * ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; perplexity with ctx {ctx} needs >= {2 * ctx}")
    n = len(tokens) // ctx
    if max_chunks is not None:
        n = min(n, max_chunks)
    return [tokens[i * ctx:(i + 1) * ctx] for i in range(n)]


@torch.inference_mode()
def chunk_nll(loaded: LoadedModel, pool: KVPool, chunk: list[int], bos: int | None) -> tuple[float, int]:
    """Negative log-likelihood (nats, summed) of the second half of one chunk and its token count.

    Args:
        chunk: ``ctx`` token ids; its first is replaced by ``bos`` when not None.
        pool: a pool of at least ``ceil(ctx / block_size)`` free blocks (returned afterwards).
    """
    ids = list(chunk)
    if bos is not None:
        ids[0] = bos
    ctx, first = len(ids), len(ids) // 2
    blocks = pool.allocator.allocate(blocks_needed(ctx, pool.block_size))
    try:
        fb = ForwardBatch.build([SeqChunk(ids, 0, blocks)], pool.block_size)
        fb = dataclasses.replace(fb, logits_indices=torch.arange(first, ctx - 1))
        logits = loaded.model.forward(fb, pool).float()          # [ctx - 1 - first, vocab]
    finally:
        pool.allocator.free(blocks)
    target = torch.tensor(ids[first + 1:], dtype=torch.long)
    logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])
    return float(-logp.double().sum()), int(target.numel())


def perplexity(loaded: LoadedModel, tokens: list[int], ctx: int, max_chunks: int | None) -> dict:
    """llama.cpp's perplexity of ``tokens`` (see module docstring): ``{"ppl", "chunks", "tokens_scored",
    "seconds"}``."""
    tk = loaded.tokenizer
    bos = tk.bos_token_id if tk.add_bos else None
    parts = chunks_of(tokens, ctx, max_chunks)
    pool = KVPool(loaded.config, CacheConfig(num_blocks=blocks_needed(ctx, 16), dtype=loaded.kv_dtype))
    nll, count, t0 = 0.0, 0, time.perf_counter()
    for part in parts:
        a, b = chunk_nll(loaded, pool, part, bos)
        nll, count = nll + a, count + b
    return {"ppl": math.exp(nll / count), "chunks": len(parts), "tokens_scored": count,
            "seconds": time.perf_counter() - t0}


def llama_cpp_perplexity(binary: str, gguf: Path, text: Path, ctx: int, chunks: int | None,
                         threads: int = 1) -> dict:
    """Run ``llama-perplexity`` and parse its final estimate: ``{"ppl", "stderr", "command"}``.
    Raises RuntimeError when it fails or prints no final estimate."""
    cmd = [binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    match = _FINAL.search(out)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-2000:]}")
    return {"ppl": float(match.group(1)), "stderr": float(match.group(2)), "command": cmd}


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser("bench.perplexity", __doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32,native,bf16", help="comma-separated --weights modes")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary, run on the same file")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        print(f"error: no text file {args.text} (pass --text FILE)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    text = args.text.read_text(encoding="utf-8")
    rows = []
    path = None
    for mode in [m.strip() for m in args.weights.split(",") if m.strip()]:
        loaded = load_model(weights=mode)
        path = loaded.path
        tokens = loaded.tokenizer.encode(text)
        try:
            r = perplexity(loaded, tokens, args.ctx, args.chunks)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rows.append({"engine": "pdserve", "weights": mode, **r})
        del loaded
    if args.llama_perplexity:
        path = path or load_model(weights="fp32").path
        r = llama_cpp_perplexity(args.llama_perplexity, path, args.text, args.ctx, args.chunks, args.threads)
        rows.append({"engine": "llama.cpp", "weights": "file (as stored)", **r})
    print(f"text={args.text} ctx={args.ctx} model={path.name if path else '?'}")
    print(f"{'engine':10} {'weights':18} {'PPL':>9} {'chunks':>7} {'scored':>7}")
    for r in rows:
        print(f"{r['engine']:10} {r['weights']:18} {r['ppl']:>9.4f} {r.get('chunks', ''):>7} "
              f"{r.get('tokens_scored', ''):>7}")
    if args.json:
        write_json(args.json, {"text": str(args.text), "ctx": args.ctx, "rows": rows}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
