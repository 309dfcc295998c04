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
    plan = copy_plan(ops)
    assert plan == {(1, 9): [(0, 0, 150), (400, 150, 10), (410, 500, 10)], (1, 8): [(0, 0, 16)]}


def test_cuda_ipc_is_refused_with_the_reason_where_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the engine runs (contract suite)")
    with pytest.raises(EngineUnavailableError, match="cupy|CUDA device"):
        create_engine("cuda_ipc", EngineConfig(secret=b"0123456789abcdef"))
    assert TransportKind("cuda_ipc") is TransportKind.CUDA_IPC
