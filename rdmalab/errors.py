"""Typed errors of the RDMA lab."""

from __future__ import annotations


class LabError(Exception):
    """Base class of every error the lab raises."""


class LabUnavailable(LabError):
    """The lab cannot run on this machine (a tool, package or kernel file is missing, not root);
    the message says what and how to fix it."""


class LabBootError(LabError):
    """The guest did not come up (no 'ready' from its init within the boot deadline, or its
    init reported an error). Carries the console output."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class LabTimeout(LabError):
    """The command ran past its deadline; the guest was killed. Carries the output so far."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output
