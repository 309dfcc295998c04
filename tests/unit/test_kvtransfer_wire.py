"""Immediates, frame header, endpoint description, config validation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvtransfer import EndpointInfo, EngineConfig, MemoryRegion, TransferError, TransportAddress, TransportKind
from kvtransfer.config import VerbsConfig
from kvtransfer.frame import HEADER_SIZE, Frame, FrameFlag, FrameType, WireStatus, unpack_frame
from kvtransfer.immediate import (from_network_u32, from_wire, pack_immediate, to_network_u32, to_wire,
                                  unpack_immediate)

pytestmark = pytest.mark.unit


def test_immediate_bit_split_and_network_order():
    imm = pack_immediate(0x123456, 0x78)
    assert imm == 0x12345678
    assert to_wire(imm) == b"\x12\x34\x56\x78"
    assert from_wire(b"\x12\x34\x56\x78") == imm
    decoded = unpack_immediate(imm)
    assert (decoded.slot, decoded.generation) == (0x123456, 0x78)
    # verbs __be32: the integer whose little-endian memory bytes are big-endian
    assert struct.pack("=I", to_network_u32(imm)) == b"\x12\x34\x56\x78"
    assert from_network_u32(to_network_u32(imm)) == imm
    for bad in [(1 << 24, 0), (0, 256), (-1, 0)]:
        with pytest.raises(ValueError):
            pack_immediate(*bad)
    with pytest.raises(ValueError):
        from_wire(b"\x00")


def test_frame_header_roundtrip_and_layout():
    f = Frame(FrameType.WRITE, FrameFlag.HAS_IMM | FrameFlag.ACK_REQ, key=0xDEADBEEF, imm=0x01020304,
              offset=1 << 40, length=4 << 20, seq=99)
    data = f.pack()
    assert len(data) == HEADER_SIZE == 40
    assert data[:2] == b"KV" and data[12:16] == b"\x01\x02\x03\x04"   # big-endian immediate
    assert unpack_frame(data) == f
    ack = Frame(FrameType.ACK, seq=5, status=WireStatus.OUT_OF_BOUNDS, length=2)
    assert unpack_frame(ack.pack()) == ack
    with pytest.raises(TransferError):
        unpack_frame(b"XX" + data[2:])
    with pytest.raises(TransferError):
        unpack_frame(data[:3] + b"\x09" + data[4:])   # unknown type


def test_endpoint_roundtrip_and_version_check():
    info = EndpointInfo("abc", "boot/host", (MemoryRegion(0x7F0000001000, 1 << 30, 0x1234),),
                        (TransportAddress(TransportKind.SHM, path="@x"),
                         TransportAddress(TransportKind.TCP, "10.0.0.1", 5555)))
    assert EndpointInfo.from_bytes(info.to_bytes()) == info
    assert info.transport(TransportKind.TCP).port == 5555 and info.region(0x1234).length == 1 << 30
    with pytest.raises(TransferError):
        EndpointInfo.from_bytes(info.to_bytes().replace(b'"version":1', b'"version":2'))
    with pytest.raises(TransferError):
        EndpointInfo.from_bytes(b"{}")
    with pytest.raises(TransferError):
        EndpointInfo.from_bytes(b"\xff")


def test_config_validation():
    EngineConfig(secret=b"s" * 16)
    with pytest.raises(ValueError):
        EngineConfig(secret=b"short")
    with pytest.raises(ValueError):
        EngineConfig(secret=b"s" * 16, streams_per_peer=0)
    with pytest.raises(ValueError):
        VerbsConfig(mtu=1500)
    with pytest.raises(ValueError):
        VerbsConfig(srq_depth=10000, cq_depth=100)


def test_write_descriptor_layout():
    from kvtransfer.frame import D_HAS_IMM, DESC, DESC_SIZE
    raw = DESC.pack(0xAABBCCDD, 0x01020304, 1 << 33, 12288, D_HAS_IMM)
    assert DESC_SIZE == 28 and raw[:8] == b"\xaa\xbb\xcc\xdd\x01\x02\x03\x04"
    assert list(DESC.iter_unpack(raw * 2)) == [(0xAABBCCDD, 0x01020304, 1 << 33, 12288, D_HAS_IMM)] * 2


def _ops(n: int, imm: int) -> list:
    from kvtransfer import MemoryRegion, WriteOp
    region = MemoryRegion(0x1000, 1 << 30, 7)
    return [WriteOp(region, i * 64, 9, i * 64, 64, imm) for i in range(n)]


def test_group_frames_pack_parts_back_to_back():
    from kvtransfer.frame import (D_END_BATCH, D_HAS_IMM, DESC_DTYPE, DESC_SIZE, F_ACK_REQ, F_FLUSH, HEADER,
                                  MAX_DESCS, T_WRITE, group_frames)
    parts = [(_ops(2, 1), 5), (_ops(MAX_DESCS + 500, 2), 6), (_ops(1, 3), 7)]
    frames = group_frames(T_WRITE, parts)
    assert len(frames) == 2 and [len(ops) for _, ops in frames] == [MAX_DESCS, 503]
    heads = [HEADER.unpack(raw[:HEADER_SIZE]) for raw, _ in frames]
    # frame 1 ends part 5 only (part 6 continues): ACK_REQ, seq 5, no FLUSH
    assert heads[0][2] == T_WRITE and heads[0][3] == F_ACK_REQ and heads[0][8] == MAX_DESCS and heads[0][9] == 5
    # frame 2 ends parts 6 and 7: ACK_REQ with the first of them, FLUSH (last frame of the group)
    assert heads[1][3] == F_ACK_REQ | F_FLUSH and heads[1][9] == 6
    descs = np.concatenate([np.frombuffer(raw[HEADER_SIZE:], DESC_DTYPE) for raw, _ in frames])
    assert len(frames[0][0]) == HEADER_SIZE + MAX_DESCS * DESC_SIZE
    ends = np.flatnonzero(descs["flags"] & D_END_BATCH).tolist()
    assert ends == [1, 2 + MAX_DESCS + 500 - 1, len(descs) - 1]
    assert (descs["flags"] & D_HAS_IMM).all() and descs["imm"].tolist() == [1] * 2 + [2] * (MAX_DESCS + 500) + [3]
    # a part that ends exactly at a frame boundary, and a single part
    frames = group_frames(T_WRITE, [(_ops(MAX_DESCS, 1), 1), (_ops(3, 1), 2)])
    assert [HEADER.unpack(r[:HEADER_SIZE])[3::6] for r, _ in frames] == [(F_ACK_REQ, 1), (F_ACK_REQ | F_FLUSH, 2)]
    with pytest.raises(ValueError):
        group_frames(T_WRITE, [(_ops(1, 1), 1), (_ops(1, 1), 3)])   # not consecutive
    with pytest.raises(ValueError):
        group_frames(T_WRITE, [(_ops(1, 1), 1), ([], 2)])
    with pytest.raises(ValueError):
        group_frames(T_WRITE, [])


def test_check_descs_rejects_bad_keys_and_ranges_without_overflow():
    from kvtransfer.frame import DESC, D_HAS_IMM, check_descs, imm_runs
    from kvtransfer.memory import MemoryTable
    table = MemoryTable()
    region = table.register(torch.zeros(4096, dtype=torch.uint8), None).region
    k = region.key
    raw = b"".join([DESC.pack(k, 1, 0, 4096, D_HAS_IMM),            # whole region: ok
                    DESC.pack(k, 2, 4095, 2, D_HAS_IMM),            # one byte past the end
                    DESC.pack(k, 2, 2**64 - 8, 16, D_HAS_IMM),      # offset + length wraps 2**64
                    DESC.pack(k, 2, 0, 0, D_HAS_IMM),               # empty
                    DESC.pack(k ^ 1, 2, 0, 8, D_HAS_IMM),           # unknown key
                    DESC.pack(k, 3, 8, 8, 0),                       # ok, no immediate
                    DESC.pack(k, 4, 16, 8, D_HAS_IMM), DESC.pack(k, 4, 24, 8, D_HAS_IMM)])
    c = check_descs(raw, table)
    assert c.status.tolist() == [WireStatus.OK, WireStatus.OUT_OF_BOUNDS, WireStatus.OUT_OF_BOUNDS,
                                 WireStatus.OUT_OF_BOUNDS, WireStatus.BAD_KEY, WireStatus.OK, WireStatus.OK,
                                 WireStatus.OK]
    assert c.rejected == 4 and c.first_error == WireStatus.OUT_OF_BOUNDS and c.nbytes == 4096 + 24
    assert imm_runs(c.imms) == [(1, 1), (4, 2)]
    assert check_descs(raw, table, need_shared=True).rejected == 8   # not shared memory: BAD_KEY
