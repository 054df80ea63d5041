"""Quantized weights as published: a GGUF file's values, multiplied by the quantized rows
kernel (``kernel``; the 32-block types as the file lays them, the K-quants repacked once into
its tiles of 16 rows), wrapped as matrices a ``NativeLM`` layer takes (``matrix``), the file's
pages given back once repacked (``memory``).  ``specflow.models.gguf_native`` reads the file."""
