"""verbs engine: the device-free parts (connection record, transition attributes, GID choice,
work-request ids, the send budget, bootstrap messages) and the pyverbs compatibility layer
against the pyverbs installed here. The engine itself runs on a real stack in
tests/integration/test_kvtransfer_contract.py and test_verbs_engine.py (rdma marker)."""

from __future__ import annotations

import struct

import pytest

from kvtransfer import EngineUnavailableError, TransferError, VerbsConfig
from kvtransfer.verbs.support import (HELLO, IBV_ACCESS_REMOTE_WRITE, IBV_LINK_LAYER_ETHERNET,
                                      IBV_LINK_LAYER_INFINIBAND, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS,
                                      IBV_SEND_SIGNALED, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, MSG_RECONNECT,
                                      MTU_ENUM, QP_INFO_SIZE, Credits, GidEntry, QpInfo, WrKind, bytes_to_gid,
                                      choose_gid, gid_to_bytes, init_attrs, make_wr_id, pack_hello, pack_qp_list,
                                      path_mtu, rtr_attrs, rts_attrs, split_wr_id, unpack_hello, write_with_imm)

pytestmark = pytest.mark.unit

ROCE_GID = bytes.fromhex("00000000000000000000ffff0a000001")
LINK_LOCAL = bytes.fromhex("fe80000000000000507ae0fffedaeee8")
GLOBAL6 = bytes.fromhex("20010db8000000000000000000000001")


def test_qp_info_roundtrip_and_validation():
    info = QpInfo(qp_num=0x123, psn=0xABCDEF, gid=ROCE_GID, lid=0, mtu=1024)
    data = info.to_bytes()
    assert len(data) == QP_INFO_SIZE and QpInfo.from_bytes(data) == info
    assert data[2:6] == b"\x00\x00\x01\x23"   # network byte order
    with pytest.raises(TransferError):
        QpInfo.from_bytes(data[:-1])
    with pytest.raises(TransferError):
        QpInfo.from_bytes(b"\x00\x01" + data[2:])        # another version
    with pytest.raises(TransferError):
        QpInfo.from_bytes(data[:-6] + struct.pack("!I", 1000) + data[-2:])   # not an IB MTU
    with pytest.raises(ValueError):
        QpInfo(1, 1 << 24, ROCE_GID, 0, 4096)


def test_path_mtu_is_clamped_to_the_active_mtu_and_the_peer():
    assert path_mtu(4096, 1024, 4096) == 1024    # rxe over 1500-byte Ethernet
    assert path_mtu(2048, 4096, 4096) == 2048
    assert path_mtu(4096, 4096, 512) == 512


def test_transition_attributes():
    assert init_attrs(1) == {"qp_state": IBV_QPS_INIT, "pkey_index": 0, "port_num": 1,
                             "qp_access_flags": 1 | IBV_ACCESS_REMOTE_WRITE}
    remote = QpInfo(77, 1234, ROCE_GID, 0, 1024)
    rtr = rtr_attrs(remote, mtu=1024, port=1, gid_index=3, min_rnr_timer=24)
    assert rtr["qp_state"] == IBV_QPS_RTR and rtr["dest_qp_num"] == 77 and rtr["rq_psn"] == 1234
    assert rtr["path_mtu"] == MTU_ENUM[1024] and rtr["min_rnr_timer"] == 24
    ah = rtr["ah_attr"]
    assert ah["is_global"] == 1   # RoCE: always a GRH, with a GID *string* pyverbs' GID() accepts
    assert ah["grh"]["dgid"] == "0000:0000:0000:0000:0000:ffff:0a00:0001" and ah["grh"]["sgid_index"] == 3
    ib = rtr_attrs(QpInfo(5, 6, bytes(16), 9, 4096), 2048, 1, 0, 12)
    assert ib["ah_attr"]["is_global"] == 0 and ib["ah_attr"]["dlid"] == 9 and "grh" not in ib["ah_attr"]
    rts = rts_attrs(4321, timeout=14, retry_count=7, rnr_retry=6)
    assert rts == {"qp_state": IBV_QPS_RTS, "sq_psn": 4321, "timeout": 14, "retry_cnt": 7, "rnr_retry": 6,
                   "max_rd_atomic": 1}


def test_config_refuses_infinite_rnr_retry_and_a_cq_smaller_than_its_users():
    with pytest.raises(ValueError):
        VerbsConfig(rnr_retry=7)
    with pytest.raises(ValueError):
        VerbsConfig(srq_depth=4096, cq_depth=4100)
    assert VerbsConfig(srq_depth=16, cq_depth=128).send_budget == 48
    assert VerbsConfig().gid_index == -1   # chosen, not index 0


def test_gid_choice_prefers_roce_v2_ipv4_like_mooncake():
    table = [GidEntry(0, LINK_LOCAL, "IB/RoCE v1", "eth0"), GidEntry(1, LINK_LOCAL, "RoCE v2", "eth0"),
             GidEntry(2, ROCE_GID, "IB/RoCE v1", "eth0"), GidEntry(3, ROCE_GID, "RoCE v2", "eth0")]
    index, reason = choose_gid(table, IBV_LINK_LAYER_ETHERNET)
    assert index == 3 and "RoCE v2" in reason and "10.0.0.1" in reason
    assert choose_gid(table[:2], IBV_LINK_LAYER_ETHERNET)[0] == 1          # v2 link-local before v1
    assert choose_gid([GidEntry(0, LINK_LOCAL, "RoCE v2"), GidEntry(5, GLOBAL6, "RoCE v2")],
                      IBV_LINK_LAYER_ETHERNET)[0] == 5                     # global IPv6 before link-local
    assert choose_gid(table[:1], IBV_LINK_LAYER_ETHERNET)[0] == 0          # v1 only if nothing else
    assert choose_gid([], IBV_LINK_LAYER_INFINIBAND)[0] == 0               # IB: LID routing
    with pytest.raises(EngineUnavailableError):
        choose_gid([GidEntry(0, bytes(16), "")], IBV_LINK_LAYER_ETHERNET)


def test_gid_strings():
    text = bytes_to_gid(ROCE_GID)
    assert text == "0000:0000:0000:0000:0000:ffff:0a00:0001" and gid_to_bytes(text) == ROCE_GID


def test_write_fields_use_network_order_and_plain_writes_have_no_immediate():
    wr = write_with_imm(9, 0x1000, 4096, 0x11, 0x2000, 0x22, imm=0x00012A05)
    assert wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM and wr.send_flags == IBV_SEND_SIGNALED
    assert struct.pack("=I", wr.imm_data) == b"\x00\x01\x2a\x05"   # the __be32 bytes in memory
    assert write_with_imm(1, 0, 1, 0, 0, 0, None).opcode == IBV_WR_RDMA_WRITE
    with pytest.raises(ValueError):
        write_with_imm(1, 0, 0, 0, 0, 0, 5)


def test_wr_ids_tell_the_completion_kind_without_the_opcode():
    for kind in WrKind:
        assert split_wr_id(make_wr_id(kind, 12345)) == (kind, 12345)
    assert split_wr_id(make_wr_id(WrKind.WRITE, (1 << 70) + 7))[0] == WrKind.WRITE


def test_credits_never_go_negative_or_over():
    credits = Credits(10)
    assert credits.take(4) == 4 and credits.take(10) == 6 and credits.take(1) == 0
    credits.give(10)
    with pytest.raises(AssertionError):
        credits.give(1)


def test_bootstrap_messages():
    infos = [QpInfo(1, 2, ROCE_GID, 0, 1024), QpInfo(3, 4, ROCE_GID, 0, 1024)]
    data = pack_hello(infos)
    assert unpack_hello(data[:HELLO.size]) == 2 and len(data) == HELLO.size + 2 * QP_INFO_SIZE
    with pytest.raises(TransferError):
        unpack_hello(b"XXXX" + data[4:HELLO.size])
    with pytest.raises(TransferError):
        unpack_hello(HELLO.pack(b"PDVB", 1, 0))
    assert pack_qp_list(MSG_RECONNECT, infos)[:3] == MSG_RECONNECT + b"\x00\x02"


def _pyverbs_or_skip():
    from kvtransfer.verbs.compat import import_pyverbs
    try:
        import_pyverbs()
    except EngineUnavailableError as exc:
        pytest.skip(str(exc))


def test_compat_resolves_enum_names_in_this_pyverbs():
    _pyverbs_or_skip()
    from kvtransfer.verbs.compat import enum, version
    from kvtransfer.verbs.support import IBV_QPS_ERR, IBV_WC_RECV_RDMA_WITH_IMM, QP_DEST_QPN
    assert enum("IBV_QPT_RC") == 2
    assert enum("IBV_QPS_ERR") == IBV_QPS_ERR and enum("IBV_WC_RECV_RDMA_WITH_IMM") == IBV_WC_RECV_RDMA_WITH_IMM
    assert enum("IBV_QP_DEST_QPN") == QP_DEST_QPN   # the ABI constants used without pyverbs agree
    with pytest.raises(EngineUnavailableError):
        enum("IBV_NO_SUCH_THING")
    v = version()
    assert v.version and v.origin and v.path.endswith("__init__.py")


def test_compat_resolves_names_held_in_enum_classes(monkeypatch):
    """v59+ has no pyverbs.enums; libibverbs_enums holds the names in enum classes."""
    import enum as std_enum
    import types

    from kvtransfer.verbs import compat

    class ibv_qp_type(std_enum.IntEnum):
        IBV_QPT_RC = 2

    fake = types.ModuleType("pyverbs.libibverbs_enums")
    fake.ibv_qp_type = ibv_qp_type
    monkeypatch.setattr(compat, "_enum_modules", lambda: (fake,))
    compat.enum.cache_clear()
    try:
        assert compat.enum("IBV_QPT_RC") == 2
    finally:
        compat.enum.cache_clear()


def test_without_a_device_verbs_says_why_and_auto_falls_back_to_tcp():
    from kvtransfer.verbs.support import rdma_device_available
    if rdma_device_available():
        pytest.skip("an RDMA device is present")
    from kvtransfer import EngineConfig, create_engine
    with pytest.raises(EngineUnavailableError) as info:
        create_engine("verbs", EngineConfig(secret=b"s" * 16))
    assert "no RDMA device" in str(info.value) or "pyverbs is not installed" in str(info.value)
    with create_engine("auto", EngineConfig(secret=b"s" * 16)) as auto:
        assert auto.primary.name == "tcp" and "verbs not possible" in auto.choice.reason
