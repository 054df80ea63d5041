"""Quantized weights as published: a GGUF file's values, multiplied by the quantized rows
kernel (``kernel``; every block type repacked once into its tiles of 16 rows), wrapped as
matrices a ``NativeLM`` layer takes (``matrix``), the file's pages given back once repacked
(``memory``).  A layer whose matrices are all blocks runs its
work around the attention in two calls of the same library (``layer``: norms, products, RoPE,
SiLU, residuals) and attends with its row-exact attention (``attention``), so a verified row
gets a decoding step's bits.  ``specflow.models.gguf_native`` reads the file."""
