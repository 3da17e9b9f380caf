"""``python -m remat ...``: the same as the ``remat`` command."""

import sys

from remat.cli.main import main

sys.exit(main())
