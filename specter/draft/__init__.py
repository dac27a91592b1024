"""The draft: what runs every step (``runner``, ``kernels``, ``resident``, ``loading``), its
on-disk format (``format/``) and the offline quantizer that writes it (``quantize/``)."""
