"""``python -m prefill --router HOST:PORT --listen HOST:PORT ...``: run a prefill worker."""

import sys

from prefill.server import build_prefill_process
from worker.cli import parse_config
from worker.runtime import serve

sys.exit(serve(parse_config("prefill"), build_prefill_process))
