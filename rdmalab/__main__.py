import sys

from rdmalab.cli import main

sys.exit(main())
