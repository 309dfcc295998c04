"""``python -m router [--http-port 8000] [--registry-address 127.0.0.1:50050] ...``: run the
router (one flag per `RouterConfig` field)."""

import argparse
import logging
import sys

from router.config import RouterConfig
from router.server import serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router", description="pdserve router")
    RouterConfig.add_arguments(ap)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig.from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
