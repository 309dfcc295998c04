"""The guest's RDMA network: two Soft-RoCE (rxe) devices over one veth pair.

The guest has no NIC (``-nic none``): these addresses exist only inside it. ``rxe0`` sits on
``veth0`` (:data:`ADDR0`), ``rxe1`` on ``veth1`` (:data:`ADDR1`); tests name a device per engine
to send between the two, or the same device for a loopback connection.
"""

from __future__ import annotations

VETH0, VETH1 = "veth0", "veth1"
RXE0, RXE1 = "rxe0", "rxe1"
ADDR0, ADDR1 = "10.77.0.1", "10.77.0.2"


def shell_assignments() -> str:
    """The values above as ``NAME=value`` lines for the guest's init script."""
    values = {"VETH0": VETH0, "VETH1": VETH1, "RXE0": RXE0, "RXE1": RXE1, "ADDR0": ADDR0, "ADDR1": ADDR1}
    return "".join(f"{k}={v}\n" for k, v in values.items())
