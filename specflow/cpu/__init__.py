"""What the CPU runs and how fast: the native models' CPU side, in one package.

- ``detect``: what this CPU can do (ISA level, bf16, oneDNN packing), probed once per process,
  and the dtype and packing that follow (``probe_cpu``; ``resolve_dtype`` and
  ``check_cpu_weights``, which the model loader imports from here).
- ``rows_kernel`` (C++ source in ``kernels/rows_linear.cpp``): the rows kernels, a few rows
  times a matrix at memory speed; ``float_rows`` and ``int8_weights``: the matrices they
  multiply (a float32 model's own, or int8 copies).
- ``row_padding``: the row probe, which times a loaded model's matmuls per row count and
  chooses its row padding and which kernel runs each count; ``whole_pass``: the check of
  the float rows kernel on a whole decoding pass.

Imports: the detection and the kernels import nothing of ``specflow.models``; the row probe
and the whole-pass check measure a loaded native model, so they, and only they, import
``specflow.models.native`` (which imports the detection and the kernels, never them).  This
``__init__`` imports the detection only, so ``specflow.models.native`` can import the
package without a circle.
"""

from specflow.cpu.detect import check_cpu_weights, resolve_dtype

__all__ = ["check_cpu_weights", "resolve_dtype"]
