"""An engine replica's three processes as plain classes (``base.py`` says how they run)."""
