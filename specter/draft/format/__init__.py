"""The draft's on-disk format: packed int4/int8 codes with scales and zero points
(compressed-tensors ``pack-quantized``) and the quantized weight they decode to."""
