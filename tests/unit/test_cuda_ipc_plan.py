"""The CPU-side logic of the cuda_ipc engine (`kvtransfer.cuda_ipc`): the export table a receiver
sends, the device copies a batch of writes becomes, and the refusal where it cannot run. The
engine itself runs in the contract suite on a GPU (test_kvtransfer_contract.py, cuda marker)."""

from __future__ import annotations

import base64

import pytest
import torch

from kvtransfer import EngineConfig, EngineUnavailableError, MemoryRegion, TransferError, WriteOp, create_engine
from kvtransfer.cuda_ipc import IPC_HANDLE_BYTES, IpcExport, copy_plan, decode_exports, encode_exports
from kvtransfer.endpoint import TransportKind

pytestmark = pytest.mark.unit


def test_the_export_table_round_trips():
    exports = [IpcExport(0x1234, bytes(range(64)), 4096, 1 << 20, 0), IpcExport(7, b"\xff" * 64, 0, 8, 3)]
    blob = encode_exports(exports)
    assert int.from_bytes(blob[:4], "big") == len(blob) - 4
    assert decode_exports(blob[4:]) == exports


HANDLE = base64.b64encode(bytes(IPC_HANDLE_BYTES))   # a well-sized handle


@pytest.mark.parametrize("body", [b"{", b'[[1, "AAAA", 0, 8, 0]]', b'[[1, "' + HANDLE + b'", -1, 8, 0]]',
                                  b'[[1, "' + HANDLE + b'", 0, 0, 0]]', b'[[1, 2]]', b'[[1, "!!", 0, 8, 0]]'])
def test_a_malformed_export_table_is_a_transfer_error(body):
    with pytest.raises(TransferError):
        decode_exports(body)
    assert decode_exports(b'[[1, "' + HANDLE + b'", 0, 8, 0]]')[0].length == 8   # the same, well formed


def test_copies_merge_writes_contiguous_on_both_sides_only():
    local = MemoryRegion(0, 1 << 20, 1)
    ops = [WriteOp(local, 0, 9, 0, 100), WriteOp(local, 100, 9, 100, 50),    # contiguous: one copy
           WriteOp(local, 150, 9, 400, 10),                                   # a gap on the reader's side
           WriteOp(local, 500, 9, 410, 10),                                   # a gap on the writer's side
           WriteOp(local, 0, 8, 0, 16)]                                       # another region
    plan = {pair: ranges.tolist() for pair, ranges in copy_plan(ops).items()}   # (copies, 3) int64 arrays
    assert plan == {(1, 9): [[0, 0, 150], [400, 150, 10], [410, 500, 10]], (1, 8): [[0, 0, 16]]}


def test_cuda_ipc_is_refused_with_the_reason_where_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the engine runs (contract suite)")
    with pytest.raises(EngineUnavailableError, match="cupy|CUDA device"):
        create_engine("cuda_ipc", EngineConfig(secret=b"0123456789abcdef"))
    assert TransportKind("cuda_ipc") is TransportKind.CUDA_IPC


def test_a_stream_thread_sends_what_it_deferred_once_idle_and_before_bye():
    """`OutboundStream`'s ``flush`` hook, as cuda_ipc uses it (NOTIFYs held until their copies
    complete): nothing deferred is left unsent once the queue is empty, ordering is kept, BYE comes
    last, and the handles complete from the receiver's ACKs. Real sockets and threads; the deferring
    ``send_batches`` stands in for the CUDA copies."""
    import socket
    import threading

    from kvtransfer.connection import OutboundStream, Shared, ThreadGroup
    import numpy as np

    from kvtransfer.frame import (D_END_BATCH, DESC_DTYPE, DESC_SIZE, HEADER, HEADER_SIZE, MAGIC, T_ACK, T_BYE, T_NOTIFY,
                                  VERSION, group_frames, recv_exact)

    writer, reader = socket.socketpair()
    deferred: list[bytes] = []
    flushes = []

    def send(sock, batches):   # launch (nothing here) and defer the NOTIFY
        deferred.append(b"".join(frame for frame, _ in group_frames(T_NOTIFY, batches)))

    def flush(sock):
        flushes.append(len(deferred))
        while deferred:
            sock.sendall(deferred.pop(0))

    shared = Shared.create(EngineConfig(secret=b"s" * 32), None)
    threads = ThreadGroup()
    stream = OutboundStream(writer, "kv-test", shared, "peer", threads, send, flush)
    local = MemoryRegion(0, 1 << 20, 1)
    handles = []
    for i in range(3):
        handles.append(h := shared.tracker.new("peer", 1, 1, 8))
        stream.submit(h, [WriteOp(local, 8 * i, 9, 8 * i, 8, imm=i)], 8)
    seen: list[tuple[int, int]] = []   # (frame type, seq) in wire order

    def receive():
        head = memoryview(bytearray(HEADER_SIZE))
        while recv_exact(reader, head):
            _, _, ftype, flags, _, _, _, _, count, seq = HEADER.unpack(head)
            descs = bytearray(count * DESC_SIZE if ftype == T_NOTIFY else 0)
            recv_exact(reader, memoryview(descs))
            parts = int((np.frombuffer(bytes(descs), DESC_DTYPE)["flags"] & D_END_BATCH).astype(bool).sum())
            for i in range(parts):   # a group's frame ends parts seq, seq + 1, ...: ACK each
                seen.append((ftype, seq + i))
                reader.sendall(HEADER.pack(MAGIC, VERSION, T_ACK, 0, 0, 0, 0, 0, 0, seq + i))
            if ftype == T_BYE:
                seen.append((ftype, seq))
                reader.shutdown(socket.SHUT_WR)   # as a receiver does: the writer's ack thread ends
                return

    rx = threading.Thread(target=receive, name="test-ipc-reader", daemon=True)
    rx.start()
    for h in handles:   # completed only if their deferred NOTIFYs went out with no further submit
        assert shared.tracker.wait(h, 10).error is None
    stream.close(10)
    rx.join(10)
    assert not rx.is_alive() and threads.join_all(5) == []
    assert [t for t, _ in seen][-1] == T_BYE and not deferred
    assert [seq for t, seq in seen if t == T_NOTIFY] == [1, 2, 3]   # every part, in order
    assert flushes and flushes[-1] == 0   # the last flush, before BYE, found nothing left
    reader.close()
