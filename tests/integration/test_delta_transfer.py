"""Delta transfer between a prefill and a decode worker with prefix caching, in process on the
real model over the tcp data plane: the decode worker holds the cached blocks of a prompt at
Reserve, the prefill worker writes only the rest (the immediate count covers only those), greedy
output equals the engine's without any cache, and an aborted transfer into a shared prefix
neither poisons the cache nor lets a block it could still write reach another request.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from decode.arrivals import DecodeArrivals
from decode.server import NUM_TRANSFER_SLOTS
from decode.sink import QueueSink
from decode.worker import DecodeWorker
from engine.block_hash import block_hashes
from engine.config import CacheConfig
from engine.loader import build_generator
from engine.sampling import SamplingParams
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig
from worker.runtime import build_resources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BS = 16
QUARANTINE_S = 8.0   # long enough for the checks below, short enough to wait out
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def running_pair(smollm, decode: dict, prefill: dict):
    """A decode and a prefill worker (tcp data plane, prefill connected to decode as "d") with
    the given `WorkerConfig` fields; both closed, and their loops checked stopped, on exit."""
    arrivals = DecodeArrivals(NUM_TRANSFER_SLOTS)
    dres = build_resources(WorkerConfig(role="decode", transfer_engine="tcp", **decode), arrivals, smollm)
    dworker = DecodeWorker(dres, arrivals)
    pres = build_resources(WorkerConfig(role="prefill", transfer_engine="tcp", **prefill), None, smollm)
    pworker = PrefillWorker(pres)
    try:
        pworker.connect("d", dres.endpoint())
        yield pworker, dworker
    finally:
        pworker.close()
        dworker.close()
        pres.close()
        dres.close()
    assert not dworker._thread.is_alive() and not pworker._thread.is_alive()


@pytest.fixture(scope="module")
def pair(smollm):
    with running_pair(smollm, dict(num_blocks=96, prefix_caching=True, quarantine_s=QUARANTINE_S,
                                   prefill_timeout_s=QUARANTINE_S / 2),
                      dict(num_blocks=96, prefix_caching=True)) as workers:
        yield workers


@pytest.fixture(scope="module")
def reference(smollm):
    gen = build_generator(smollm, CacheConfig(num_blocks=128))   # no prefix cache
    return lambda prompt: gen.generate([prompt], PARAMS)[0].token_ids


def _prefill(prefill, r, rid, prompt):
    job = prefill.submit(rid, prompt, PARAMS, "d", r.blocks[r.num_held_blocks:], r.transfer.slot,
                         r.transfer.generation, num_held_blocks=r.num_held_blocks)
    assert job.finished.wait(120)
    return job.result()


def _run(prefill, decode, rid: str, prompt: list[int]):
    """Reserve (with the prompt), prefill the rest, decode; (reservation, prefill result, tokens)."""
    r = decode.reserve(rid, len(prompt), PARAMS.max_tokens, prompt)
    res = _prefill(prefill, r, rid, prompt)
    return r, res, decode_all(decode, rid, res, prompt, PARAMS)


def decode_all(decode, rid: str, res, prompt: list[int], params: SamplingParams) -> list[int]:
    """Decode a prefilled request to its end; its tokens, the prefill's first token first."""
    sink = QueueSink()
    decode.start_decode(rid, res.first_tokens, res.num_writes, prompt, params, sink)
    tokens = list(res.first_tokens)
    while True:
        out = sink.items.get(timeout=120)
        assert not isinstance(out, Exception), out
        tokens += out.new_token_ids
        if out.request_finished:
            return tokens


def _block_bytes(decode) -> int:
    return decode.res.layout.bytes_per_block


def test_second_turn_receives_only_the_blocks_the_decode_worker_lacks(pair, smollm, reference):
    prefill, decode = pair
    tk = smollm.tokenizer
    turn1 = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Describe a forest at dawn. " * 4}]))
    r1, res1, out1 = _run(prefill, decode, "t1", turn1)
    assert out1 == reference(turn1) and r1.num_held_blocks == 0
    # turn 2 = turn 1 + its answer + a new message: the decode worker computed the answer's K/V
    turn2 = turn1 + out1 + tk.encode("<|im_start|>user\nAnd at night?<|im_end|>\n<|im_start|>assistant\n")
    computed = len(turn1) + len(out1) - 1          # the last sampled token's K/V is never computed
    held = min(computed // BS, len(turn2) // BS)
    r2, res2, out2 = _run(prefill, decode, "t2", turn2)
    assert out2 == reference(turn2)
    assert r2.num_held_blocks == held > len(turn1) // BS   # more than the prompt: the decoded blocks too
    need = -(-len(turn2) // BS)
    assert res2.bytes_written == (need - held) * _block_bytes(decode)
    assert res2.bytes_skipped == held * _block_bytes(decode)
    layout = decode.res.layout   # one run of blocks per layer, K|V and head
    assert res2.num_writes == 2 * layout.num_layers * layout.num_kv_heads
    assert res2.prefix_hit_tokens == (len(turn1) - 1) // BS * BS   # the prefill worker's own cache
    assert decode.res.pool.allocator.num_free == decode.res.pool.num_blocks


def test_a_fully_held_prompt_needs_no_write(pair, smollm, reference):
    prefill, decode = pair
    tk = smollm.tokenizer
    base = tk.encode(tk.apply_chat_template([{"role": "user", "content": "List the planets of the solar system."}]))
    _, _, out = _run(prefill, decode, "full-1", base)
    prompt = (base + out)[:(len(base) + len(out) - 1) // BS * BS]   # whole blocks, all cached
    r, res, tokens = _run(prefill, decode, "full-2", prompt)
    assert r.num_held_blocks == len(prompt) // BS and res.num_writes == 0 and res.bytes_written == 0
    assert tokens == reference(prompt)


def test_aborted_transfer_into_a_shared_prefix_never_poisons_the_cache(pair, smollm, reference):
    prefill, decode = pair
    tk = smollm.tokenizer
    alloc = decode.res.pool.allocator
    base = tk.encode(tk.apply_chat_template([{"role": "user", "content": "Explain how tides work. " * 5}]))
    _, _, out = _run(prefill, decode, "shared-1", base)
    prompt = base + out + tk.encode("<|im_start|>user\nShorter, please.<|im_end|>\n<|im_start|>assistant\n")
    quarantined = decode.metrics["blocks_quarantined"]
    # the victim holds the shared prefix; its transfer is aborted on the decode side while the
    # prefill worker may be writing (no writer_stopped: the written blocks must be quarantined)
    victim = decode.reserve("victim", len(prompt), PARAMS.max_tokens, prompt)
    held, written = victim.blocks[:victim.num_held_blocks], victim.blocks[victim.num_held_blocks:]
    assert victim.num_held_blocks > 0 and written
    t = victim.transfer
    job = prefill.submit("victim", prompt, PARAMS, "d", written, t.slot, t.generation,
                         num_held_blocks=victim.num_held_blocks)
    assert decode.abort("victim")
    assert job.finished.wait(120)
    # held blocks went straight back to the cache, still registered; written ones are
    # quarantined (referenced: nobody can allocate them) and were never registered
    assert all(alloc.ref_count(b) == 0 and b in alloc._hash_of for b in held)
    assert all(alloc.ref_count(b) == 1 and b not in alloc._hash_of for b in written)
    assert decode.metrics["blocks_quarantined"] - quarantined == len(written)
    # the same prompt again: the shared prefix is reused, no quarantined block is handed out,
    # and the output is the engine's (the aborted writes corrupted nothing it reads)
    r, _, tokens = _run(prefill, decode, "after-victim", prompt)
    assert r.num_held_blocks == victim.num_held_blocks and not set(r.blocks) & set(written)
    assert tokens == reference(prompt)
    assert all(h not in {alloc._hash_of.get(b) for b in written}
               for h in block_hashes(prompt, BS))
    # the quarantine ends (QUARANTINE_S): every block is free again, none leaked
    end = time.monotonic() + QUARANTINE_S + 20
    while alloc.num_free != alloc.num_blocks and time.monotonic() < end:
        time.sleep(0.2)
    assert alloc.num_free == alloc.num_blocks
    assert not any(b in alloc._hash_of for b in written)
