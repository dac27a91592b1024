"""Specter: speculative expert offloading for mixture-of-experts models."""

__version__ = "0.1.0"
