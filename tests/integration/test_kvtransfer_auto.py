"""Engine selection: ``auto`` routes same-host peers over shm and others over tcp; threads stop."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvtransfer import (CompletionCounter, EndpointInfo, EngineConfig, EngineUnavailableError,
                        WriteOp, allocate_shared_buffer, create_engine, pack_immediate)

pytestmark = pytest.mark.integration
CFG = EngineConfig(secret=b"auto-test-secret-0123")


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


@pytest.mark.parametrize("same_host", [True, False])
def test_auto_picks_shm_on_same_host_else_tcp(same_host):
    counter = CompletionCounter(2)
    rx = create_engine("auto", CFG, arrivals=counter)
    tx = create_engine("auto", CFG)
    try:
        raw, shared = allocate_shared_buffer(1 << 20)
        region = rx.register_memory(raw, shared=shared)
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        local = tx.register_memory(src)
        info = rx.describe()
        if not same_host:
            info = dataclasses.replace(info, host_id="another-host")
        info = EndpointInfo.from_bytes(info.to_bytes())
        peer = tx.connect(info)
        assert tx.route(peer) == ("shm" if same_host else "tcp")
        slot, gen = counter.acquire(10)
        ops = [WriteOp(local, i << 16, region.key, i << 16, 1 << 16, pack_immediate(slot, gen)) for i in range(16)]
        tx.wait(tx.post_writes(peer, ops), 10)
        counter.expect(slot, gen, 16)
        counter.wait(slot, gen, 10)
        assert torch.equal(src, raw)
        assert kv_threads()
    finally:
        tx.close()
        rx.close()
    assert kv_threads() == []


def test_unknown_engine_name():
    with pytest.raises(EngineUnavailableError):
        create_engine("carrier-pigeon", CFG)
