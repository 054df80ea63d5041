"""Acceptors ``exact`` and ``rejection``: the lossless rule (``specflow.acceptance``).

``acceptor=rejection`` keeps the longest prefix of the draft equal to the target's argmax for
a greedy request (a tree draft: the longest such path) and runs lossless speculative sampling
for a sampled one; ``acceptor=exact`` is the same rule refusing sampling when the pipeline is
built, so a run meant to be greedy fails loudly at temperature > 0.  The rule itself, which
plain decoding and HiSpec's intermediate level use as well, is ``LosslessAcceptor``.
"""

from __future__ import annotations

from specflow.acceptance import LosslessAcceptor
from specflow.errors import ConfigError


class StandardAcceptor(LosslessAcceptor):
    """The lossless rule (``LosslessAcceptor``), the one acceptor stage for it
    (``acceptor=exact`` and ``acceptor=rejection``).

    Args:
        greedy_only: refuse sampling when the pipeline is built (``acceptor=exact``: a run
            meant to be greedy fails loudly at temperature > 0 instead of sampling).
    """

    def __init__(self, greedy_only: bool = False) -> None:
        self.greedy_only = greedy_only

    def check(self, greedy: bool) -> None:
        if self.greedy_only and not greedy:
            raise ConfigError(
                "acceptor=exact is greedy-only but sampling.temperature > 0; use "
                "acceptor=rejection for lossless speculative sampling"
            )
