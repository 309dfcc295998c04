"""Immediates, frame header, endpoint description, config validation."""

from __future__ import annotations

import struct

import pytest

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
    from kvtransfer.frame import DESC, DESC_SIZE, F_HAS_IMM
    raw = DESC.pack(0xAABBCCDD, 0x01020304, 1 << 33, 12288, F_HAS_IMM)
    assert DESC_SIZE == 28 and raw[:8] == b"\xaa\xbb\xcc\xdd\x01\x02\x03\x04"
    assert list(DESC.iter_unpack(raw * 2)) == [(0xAABBCCDD, 0x01020304, 1 << 33, 12288, F_HAS_IMM)] * 2
