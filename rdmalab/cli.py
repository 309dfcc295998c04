"""``python -m rdmalab``: set up, build and run the RDMA lab.

    python -m rdmalab setup                 # apt-get install the lab's Debian packages (root)
    python -m rdmalab build                 # fetch the kernel, build the initramfs (cached)
    python -m rdmalab run -- CMD ARGS...    # boot the guest, run CMD in the repo, exit with its status
    python -m rdmalab check                 # say whether this host can boot the lab, and why not

``run`` prints the command's output as it arrives, then the boot and total time on stderr.
Exit status: the command's, or 125 when the guest could not boot or ran out of time.
"""

from __future__ import annotations

import argparse
import sys

from rdmalab.assets import install_packages, missing, prepare
from rdmalab.config import LabConfig
from rdmalab.errors import LabBootError, LabError, LabTimeout
from rdmalab.guest import INIT_FAILED, run


def _config(args: argparse.Namespace) -> LabConfig:
    overrides = {k: v for k, v in (("memory_mib", args.memory_mib), ("accel", args.accel)) if v is not None}
    return LabConfig.from_env(**overrides)


def _setup(args: argparse.Namespace) -> int:
    install_packages()
    prepare(_config(args))
    print("rdmalab: packages installed, kernel and initramfs built", file=sys.stderr)
    return 0


def _build(args: argparse.Namespace) -> int:
    assets = prepare(_config(args))
    print(f"kernel {assets.kernel_version}: {assets.kernel}\ninitramfs: {assets.initramfs}")
    return 0


def _check(args: argparse.Namespace) -> int:
    gaps = missing()
    if gaps:
        print("cannot boot the lab; missing: " + ", ".join(gaps))
        return 1
    print("the lab can boot here")
    return 0


def _run(args: argparse.Namespace) -> int:
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        print("error: give a command after --", file=sys.stderr)
        return 2
    config = _config(args)
    assets = prepare(config)
    try:
        result = run(config, assets, argv, args.timeout, echo=lambda line: print(line, end="", flush=True))
    except (LabBootError, LabTimeout) as exc:
        print(exc.output[-4000:], end="")
        print(f"\nrdmalab: {exc}", file=sys.stderr)
        return INIT_FAILED
    print(f"rdmalab: exit {result.returncode}; guest ready after {result.boot_s:.1f}s, "
          f"{result.wall_s:.1f}s in all", file=sys.stderr)
    return result.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rdmalab", description="Soft-RoCE lab in a QEMU guest")
    ap.add_argument("--memory-mib", type=int, default=None, help="guest memory (default 6144)")
    ap.add_argument("--accel", choices=["tcg", "kvm"], default=None, help="qemu accelerator (default tcg)")
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("setup", help="install the Debian packages (root), then build").set_defaults(func=_setup)
    sub.add_parser("build", help="fetch the kernel and build the initramfs").set_defaults(func=_build)
    sub.add_parser("check", help="can this host boot the lab?").set_defaults(func=_check)
    r = sub.add_parser("run", help="boot the guest and run a command in it")
    r.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    r.set_defaults(func=_run)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except LabError as exc:
        print(f"rdmalab: {exc}", file=sys.stderr)
        return INIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
