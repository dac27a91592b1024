"""Thin Ray actor shells around ``specter`` classes (draft, transfer, verifier) and their launcher."""
