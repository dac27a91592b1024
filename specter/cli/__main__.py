"""``python -m specter.cli …`` is ``specter …``."""

from specter.cli import entry

entry()
