"""The ``pdserve`` command.

    pdserve generate "prompt"     # the single-process engine answers one prompt

Every flag mirrors a config field; environment variables are not read here (see
`engine.loader.set_torch_threads` for ``PDSERVE_THREADS``).
"""

from __future__ import annotations

import argparse
import sys


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")


def _generate(args: argparse.Namespace) -> int:
    from engine.config import CacheConfig
    from engine.errors import EngineError
    from engine.loader import build_generator, load_model, set_torch_threads
    from engine.sampling import SamplingParams

    set_torch_threads(args.threads)
    try:
        loaded = load_model(args.model, args.dtype)
        gen = build_generator(loaded, CacheConfig(num_blocks=args.num_blocks, dtype=args.dtype))
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
    return 0


def main(argv: list[str] | None = None) -> int:
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
    _add_model_flags(g)
    g.set_defaults(func=_generate)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
