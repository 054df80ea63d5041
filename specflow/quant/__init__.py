"""Quantized weights as published: GGUF blocks kept as they lie in the file, multiplied by
the quantized rows kernel (``kernel``), wrapped as matrices a ``NativeLM`` layer takes
(``matrix``), read from a GGUF file (``gguf_weights``)."""
