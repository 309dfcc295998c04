"""pdserve's benchmarks, apart from the library: each module runs as ``python -m bench.<name>``.

- ``bench.engine``: engine prefill / decode tokens/s against transformers, per weights mode;
- ``bench.features``: what logprobs, grammars and penalties cost per decoded token;
- ``bench.grammars``: llguidance against xgrammar on this model's tokenizer;
- ``bench.perplexity``: each weights mode's perplexity, beside llama.cpp's;
- ``bench.prefill``: the prefill scheduler's pass-size knee and a burst's TTFT by policy;
- ``bench.kvtransfer`` (peers in ``bench.kvtransfer_peers``): transfer engines vs ceilings and peers;
- ``bench.latency``: one request's TTFT / ITL, disaggregated cluster vs the single-process engine;
- ``bench.prefix``: prefix caching on / off and routing policies over fresh clusters.

Every one prints a table and, asked to, writes JSON that opens with `bench.common.header`
(where and when it ran). Benchmarks may import any package of the project; no package imports
them (tests/unit/test_layering.py).
"""
