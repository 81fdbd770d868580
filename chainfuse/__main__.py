"""`python -m chainfuse`: the command line."""

import sys

from chainfuse.cli import main

sys.exit(main())
