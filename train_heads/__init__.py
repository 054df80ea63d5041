"""train_heads: a Lightning sub-project that trains early-exit heads by self-distillation.

Run ``python -m train_heads.train`` (Hydra; configs in ``train_heads/conf``).  The head
definition and its file format live in the core (``specflow.models.exit_heads``) so that
inference never imports Lightning.
"""
