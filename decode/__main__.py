"""``python -m decode --router HOST:PORT --listen HOST:PORT ...``: run a decode worker."""

import sys

from decode.server import build_decode_process
from worker.cli import parse_config
from worker.runtime import serve

sys.exit(serve(parse_config("decode"), build_decode_process))
