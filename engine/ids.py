"""Typed identifiers shared by the engine and its users."""

from __future__ import annotations

from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", int)
TokenId = NewType("TokenId", int)
