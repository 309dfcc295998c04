"""Skip or fail when a test's environment is missing, by ``PDSERVE_REQUIRE``.

A test that needs something the machine may lack (network namespaces, a Docker engine, the
Soft-RoCE lab, openssl, a CUDA device) calls :func:`unavailable` instead of ``pytest.skip``.
``PDSERVE_REQUIRE`` lists the capabilities this machine must have, comma separated
(``netns,docker,rdma-lab,openssl``), or ``all``; CI sets it, so a capability that silently went
missing there fails the run instead of hiding a regression behind a skip. Unset: every missing
capability is a skip with its reason (a developer's laptop).

Capabilities used by the suite: ``netns`` (root + ``ip netns``), ``docker`` (root + dockerd),
``rdma-lab`` (the Soft-RoCE QEMU lab or a host RDMA device), ``openssl``, ``cuda``.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ENV = "PDSERVE_REQUIRE"


def required() -> frozenset[str]:
    """The capabilities ``PDSERVE_REQUIRE`` names (``{"all"}`` for all)."""
    return frozenset(p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip())


def is_required(capability: str) -> bool:
    names = required()
    return "all" in names or capability in names


def unavailable(capability: str, reason: str) -> NoReturn:
    """Skip the test (``reason``), or fail it when ``PDSERVE_REQUIRE`` names ``capability``."""
    if is_required(capability):
        pytest.fail(f"{capability} is required here ({ENV}={os.environ.get(ENV)!r}) but "
                    f"unavailable: {reason}", pytrace=False)
    pytest.skip(reason)
