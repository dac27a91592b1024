"""The policies' names and options as the command line lists them, without importing ``specter.plan``
(whose policies import torch): ``specter --help`` answers at once. ``tests/test_cli.py`` holds them to
``specter.plan``'s ``POLICIES`` and ``OPTIONS``."""

from __future__ import annotations

POLICY_NAMES = ("demand-lru", "demand-host", "gate-prefetch", "specmoeoff", "specter-paper", "specter", "oracle")
OPTION_NAMES = ("host", "nohost", "fetch", "nofetch", "idlefetch", "cachearm", "hindsight", "nohindsight",
                "nolast", "last", "fixed", "adapt", "value", "novalue", "pipe", "nopipe")
