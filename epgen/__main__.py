"""``python3 -m epgen``: the same command line as the ``epgen`` script."""

import sys

from epgen.cli import main

sys.exit(main())
