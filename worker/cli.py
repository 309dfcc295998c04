"""Command line shared by both worker roles (``python -m prefill`` / ``python -m decode``)."""

from __future__ import annotations

import argparse

from worker.config import WorkerConfig


def parse_config(role: str, argv: list[str] | None = None) -> WorkerConfig:
    """Flags (one per `WorkerConfig` field) -> a validated config."""
    ap = argparse.ArgumentParser(prog=f"python -m {role}", description=f"pdserve {role} worker")
    WorkerConfig.add_arguments(ap)
    return WorkerConfig.from_args(role, ap.parse_args(argv))
