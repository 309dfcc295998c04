"""How long each tier of the suite took: a line in pytest's terminal summary.

A test's tier is the folder under tests/ it lives in (unit, integration, e2e, faults); its time is
the sum of its setup, call and teardown (fixtures shared by a module or the session count where
they are set up), so the tiers add up to the run's test time. rdma-marked tests count in their
folder's tier with their host proxy's time: what the run waited for the lab at its end, which
runs beside the host's tests (tests/lab_runner.py prints the lab's own time).
"""

from __future__ import annotations

from collections import defaultdict

_SECONDS: dict[str, float] = defaultdict(float)
_TESTS: dict[str, set[str]] = defaultdict(set)


def tier_of(nodeid: str) -> str:
    """``tests/<tier>/...::name`` -> ``<tier>`` ("other" for a test outside a tier folder)."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def summary(seconds: dict[str, float], tests: dict[str, set[str]]) -> str:
    """One line: each tier's tests and minutes, slowest first."""
    rows = sorted(seconds.items(), key=lambda kv: -kv[1])
    return "tier times: " + ", ".join(f"{t} {len(tests[t])} tests {s / 60:.1f} min" for t, s in rows)


def pytest_runtest_logreport(report):
    tier = tier_of(report.nodeid)
    _SECONDS[tier] += report.duration
    _TESTS[tier].add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SECONDS:
        terminalreporter.write_line(summary(_SECONDS, _TESTS))
