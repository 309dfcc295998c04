"""verbs engine: the device-free helpers, and the device test that skips with the reason."""

from __future__ import annotations

import struct

import pytest

from kvtransfer import EngineUnavailableError, TransferError
from kvtransfer.verbs_support import (IBV_ACCESS_REMOTE_WRITE, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS,
                                      IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE_WITH_IMM, MTU_ENUM, QP_INFO_SIZE,
                                      QpInfo, init_attrs, rtr_attrs, rts_attrs, write_with_imm)

pytestmark = pytest.mark.unit

ROCE_GID = bytes.fromhex("00000000000000000000ffff0a000001")


def test_qp_info_roundtrip_and_validation():
    info = QpInfo(qp_num=0x123, psn=0xABCDEF, gid=ROCE_GID, lid=0, mtu=4096)
    data = info.to_bytes()
    assert len(data) == QP_INFO_SIZE and QpInfo.from_bytes(data) == info
    assert data[2:6] == b"\x00\x00\x01\x23"   # network byte order
    with pytest.raises(TransferError):
        QpInfo.from_bytes(data[:-1])
    with pytest.raises(TransferError):
        QpInfo.from_bytes(b"\x00\x02" + data[2:])
    with pytest.raises(ValueError):
        QpInfo(1, 1 << 24, ROCE_GID, 0, 4096)
    with pytest.raises(ValueError):
        QpInfo(1, 1, b"short", 0, 4096)


def test_transition_attributes():
    assert init_attrs(1) == {"qp_state": IBV_QPS_INIT, "pkey_index": 0, "port_num": 1,
                             "qp_access_flags": 1 | IBV_ACCESS_REMOTE_WRITE}
    remote = QpInfo(77, 1234, ROCE_GID, 0, 1024)
    rtr = rtr_attrs(remote, local_mtu=4096, port=1, gid_index=3)
    assert rtr["qp_state"] == IBV_QPS_RTR and rtr["dest_qp_num"] == 77 and rtr["rq_psn"] == 1234
    assert rtr["path_mtu"] == MTU_ENUM[1024]          # min of both sides
    assert rtr["ah_attr"]["is_global"] == 1 and rtr["ah_attr"]["dgid"] == ROCE_GID
    assert rtr["ah_attr"]["sgid_index"] == 3
    ib = rtr_attrs(QpInfo(5, 6, bytes(16), 9, 4096), 2048, 1, 0)
    assert ib["ah_attr"]["is_global"] == 0 and ib["ah_attr"]["dlid"] == 9 and ib["path_mtu"] == MTU_ENUM[2048]
    rts = rts_attrs(4321, timeout=14, retry_count=7, rnr_retry=7)
    assert rts == {"qp_state": IBV_QPS_RTS, "sq_psn": 4321, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7,
                   "max_rd_atomic": 1}


def test_write_with_imm_fields_use_network_order():
    wr = write_with_imm(9, 0x1000, 4096, 0x11, 0x2000, 0x22, imm=0x00012A05)
    assert wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM and wr.send_flags == IBV_SEND_SIGNALED
    assert (wr.local_addr, wr.length, wr.lkey, wr.remote_addr, wr.rkey) == (0x1000, 4096, 0x11, 0x2000, 0x22)
    assert struct.pack("=I", wr.imm_data) == b"\x00\x01\x2a\x05"   # the __be32 bytes in memory
    assert write_with_imm(1, 0, 1, 0, 0, 0, 5, signaled=False).send_flags == 0
    with pytest.raises(ValueError):
        write_with_imm(1, 0, 0, 0, 0, 0, 5)


def test_gid_conversion():
    from kvtransfer.verbs import bytes_to_gid, gid_to_bytes
    text = bytes_to_gid(ROCE_GID)
    assert text == "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert gid_to_bytes(text) == ROCE_GID


def _device_reason() -> str | None:
    from kvtransfer.verbs_support import list_rdma_devices
    try:
        list_rdma_devices()
    except EngineUnavailableError as exc:
        return str(exc)
    return None


@pytest.mark.rdma
def test_verbs_engine_loopback_write_with_imm():
    reason = _device_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch
    from kvtransfer import CompletionCounter, EngineConfig, WriteOp, create_engine, pack_immediate
    counter = CompletionCounter(4)
    cfg = EngineConfig(secret=b"s" * 16)
    with create_engine("verbs", cfg, arrivals=counter) as rx, create_engine("verbs", cfg) as tx:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        region = rx.register_memory(dst)
        local = tx.register_memory(src)
        peer = tx.connect(rx.describe())
        slot, gen = counter.acquire(10)
        ops = [WriteOp(local, i << 16, region.key, i << 16, 1 << 16, pack_immediate(slot, gen)) for i in range(16)]
        tx.wait(tx.post_writes(peer, ops), 10)
        counter.expect(slot, gen, 16)
        counter.wait(slot, gen, 10)
        assert torch.equal(src, dst)


def test_verbs_unavailable_reads_as_no_device_not_a_crash():
    reason = _device_reason()
    if reason is None:
        pytest.skip("an RDMA device is present")
    from kvtransfer import EngineConfig, create_engine
    with pytest.raises(EngineUnavailableError) as info:
        create_engine("verbs", EngineConfig(secret=b"s" * 16))
    assert "no RDMA device" in str(info.value) or "pyverbs is not installed" in str(info.value)
