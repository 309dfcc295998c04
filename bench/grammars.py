"""llguidance vs xgrammar on this model's tokenizer: what choosing the structured-output library
rests on (`engine.grammar` says which one pdserve uses and why).

    python -m bench.grammars [--model PATH] [--out grammars.json]

For each grammar (JSON schemas of growing size, a regex, a choice) and each library: the time to
build its tokenizer view (once per process), to compile the grammar, and to compute the
next-token mask at every step of a fixed valid output (p50 / p99 / max microseconds, one
thread), and whether every token of that output was allowed. xgrammar is optional (``pip install
xgrammar``; it pulls torch, transformers and triton): without it only llguidance is measured.
Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import time

import torch

from bench.common import arg_parser, write_json

CASES = {
    "json-small": ({"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
                    "required": ["answer", "confidence"]},
                   {"answer": "Paris is the capital of France.", "confidence": 9}),
    "json-nested": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "role": {"enum": ["student", "engineer", "artist"]}},
        "required": ["name", "age", "tags", "address", "role"]},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"},
         "role": "engineer"}),
}
REGEX = (r"\d{4}-\d{2}-\d{2}", "1969-07-20")
# The JSON layout pdserve generates (router.structured.JSON_LAYOUT; the router is not imported here).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICE = (["yes", "no", "maybe"], "maybe")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_us": 1e6 * s[len(s) // 2], "p99_us": 1e6 * s[min(len(s) - 1, int(len(s) * 0.99))],
            "max_us": 1e6 * s[-1]}


def _walk(fill, allowed_bit, consume, ids: list[int]) -> tuple[list[float], bool]:
    times, ok = [], True
    for t in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        ok = ok and allowed_bit(t)
        consume(t)
    return times, ok


def bench_llguidance(tk, cases: dict) -> dict:
    import llguidance
    import llguidance.torch as lgt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tk.backend.to_str(), n_vocab=tk.vocab_size, eos_token=tk.eos_token_id)
    out = {"tokenizer_ms": 1e3 * (time.perf_counter() - t0), "version": _version("llguidance"), "cases": {}}
    for name, (kind, spec, text) in cases.items():
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        mask = lgt.allocate_token_bitmask(1, tk.vocab_size)
        ids = tk.encode(text)
        times, ok = _walk(lambda: lgt.fill_next_token_bitmask(m, mask),
                          lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1), m.consume_token, ids)
        out["cases"][name] = {"compile_ms": compile_ms, "tokens": len(ids), "all_allowed": ok, **_percentiles(times)}
    return out


def bench_xgrammar(tk, cases: dict) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tk.token_bytes(i) for i in range(tk.vocab_size)], vocab_type=xgr.VocabType.RAW,
                             vocab_size=tk.vocab_size, stop_token_ids=[tk.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    out = {"tokenizer_ms": 1e3 * (time.perf_counter() - t0), "version": _version("xgrammar"), "cases": {}}
    for name, (kind, spec, text) in cases.items():
        t0 = time.perf_counter()
        if kind == "json":
            cg = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(", ", ": "))
        elif kind == "regex":
            cg = compiler.compile_regex(spec)
        else:
            cg = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        compile_ms = 1e3 * (time.perf_counter() - t0)
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, tk.vocab_size)
        ids = tk.encode(text)
        times, ok = _walk(lambda: m.fill_next_token_bitmask(mask),
                          lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1), m.accept_token, ids)
        out["cases"][name] = {"compile_ms": compile_ms, "tokens": len(ids), "all_allowed": ok, **_percentiles(times)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = arg_parser("bench.grammars", __doc__)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    ap.add_argument("--out", default="grammars.json")
    args = ap.parse_args(argv)
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tk = Tokenizer.from_file(args.model)
    cases = {name: ("json", schema, json.dumps(value)) for name, (schema, value) in CASES.items()}
    cases["regex-date"] = ("regex", REGEX[0], REGEX[1])
    cases["choice-3"] = ("choice", CHOICE[0], CHOICE[1])
    results = {"vocab_size": tk.vocab_size, "llguidance": bench_llguidance(tk, cases),
               "xgrammar": bench_xgrammar(tk, cases)}
    print(f"vocabulary: {tk.vocab_size} tokens")
    print(f"{'library':12} {'case':12} {'compile ms':>10} {'tokens':>6} {'mask p50 us':>11} {'p99 us':>8} "
          f"{'max us':>8} {'all allowed':>11}")
    for lib in ("llguidance", "xgrammar"):
        r = results[lib]
        if r is None:
            print(f"{lib:12} (not installed: pip install xgrammar)")
            continue
        print(f"{lib:12} {'tokenizer':12} {r['tokenizer_ms']:10.1f}")
        for name, c in r["cases"].items():
            print(f"{lib:12} {name:12} {c['compile_ms']:10.2f} {c['tokens']:6} {c['p50_us']:11.1f} "
                  f"{c['p99_us']:8.1f} {c['max_us']:8.1f} {str(c['all_allowed']):>11}")
    print(f"wrote {write_json(args.out, results, args)}")
    return results


if __name__ == "__main__":
    main()
