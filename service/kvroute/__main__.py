"""``python -m kvroute`` is the ``kvroute`` command."""

import sys

from kvroute.cli.main import main

sys.exit(main())
