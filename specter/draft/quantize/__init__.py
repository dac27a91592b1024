"""The offline AWQ tooling that writes a draft: calibration, the per-channel scale search, clipping,
the whole-model quantizer and the ``specter quantize`` command."""

METHODS = ("awq", "rtn", "int8")
# Where AWQ's gate/up input scale lives: ``folded`` (one scale per layer, folded into the draft's
# post-attention norm and the other readers of it; each expert's down scale folded into its up
# rows: plain W4A16 that stock readers compute right) or ``per-expert`` (a scale per expert and
# projection, stored as ``weight_awq_scale``: only Specter reads it, stock readers refuse it).
LAYOUTS = ("folded", "per-expert")
