"""``python -m specter.cli …`` is ``specter …``."""

import sys

from specter.cli import main

sys.exit(main())
