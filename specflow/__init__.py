"""specflow: a declarative framework for speculative decoding.

Importing the package sets ``MKL_CBWR=AUTO`` before torch loads: MKL's fp32
matmul with a few rows (the verification shape) is otherwise several times slower.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
