"""The 32-bit immediate carried by every write: transfer slot + generation.

Bit split (host order value)::

    31                               8 7            0
    +---------------------------------+--------------+
    |          slot (24 bits)         | gen (8 bits) |
    +---------------------------------+--------------+

``slot`` indexes the decode worker's transfer table (up to 16,777,216 slots); ``generation``
changes every time a slot is released, so writes of an aborted transfer that land late are
recognised as stale (it wraps modulo 256). On the wire the value is big-endian (network byte
order): :func:`to_wire` / :func:`from_wire` for byte strings, :func:`to_network_u32` /
:func:`from_network_u32` for the ``__be32`` integer fields of verbs work requests and completions.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import NewType

SlotId = NewType("SlotId", int)
Generation = NewType("Generation", int)

SLOT_BITS = 24
GENERATION_BITS = 8
MAX_SLOTS = 1 << SLOT_BITS
GENERATION_MODULUS = 1 << GENERATION_BITS

_U32_BE = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class Immediate:
    """A decoded immediate value."""

    slot: SlotId
    generation: Generation


def pack_immediate(slot: int, generation: int) -> int:
    """Encode ``(slot, generation)`` into a host-order 32-bit value.

    Raises ``ValueError`` if ``slot`` is outside ``[0, 2**24)`` or ``generation`` outside
    ``[0, 2**8)``.
    """
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot {slot} outside [0, {MAX_SLOTS})")
    if not 0 <= generation < GENERATION_MODULUS:
        raise ValueError(f"generation {generation} outside [0, {GENERATION_MODULUS})")
    return (slot << GENERATION_BITS) | generation


def unpack_immediate(value: int) -> Immediate:
    """Decode a host-order 32-bit value; ``ValueError`` if it does not fit in 32 bits."""
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"immediate {value} is not a 32-bit unsigned value")
    return Immediate(SlotId(value >> GENERATION_BITS), Generation(value & (GENERATION_MODULUS - 1)))


def next_generation(generation: int) -> Generation:
    """The generation after ``generation`` (wraps modulo 256)."""
    return Generation((generation + 1) % GENERATION_MODULUS)


def to_wire(value: int) -> bytes:
    """4 bytes, network byte order."""
    return _U32_BE.pack(value)


def from_wire(data: bytes) -> int:
    """Inverse of :func:`to_wire`; ``ValueError`` unless exactly 4 bytes."""
    if len(data) != 4:
        raise ValueError(f"an immediate is 4 bytes, got {len(data)}")
    return _U32_BE.unpack(data)[0]


def to_network_u32(value: int) -> int:
    """The integer whose in-memory bytes are ``value`` big-endian (``htonl``).

    This is what goes into ``ibv_send_wr.imm_data`` (a ``__be32``).
    """
    return socket.htonl(value)


def from_network_u32(value: int) -> int:
    """Inverse of :func:`to_network_u32` (``ntohl``), for ``ibv_wc.imm_data``."""
    return socket.ntohl(value)
