"""The offline AWQ tooling that writes a draft: calibration, the per-channel scale search, clipping,
the whole-model quantizer and the ``specter quantize`` command."""
