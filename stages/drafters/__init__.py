"""Drafters (config group ``drafter``): what proposes the draft tokens of a round.  The
members most of them share are written once in ``base``; the token-tree drafter's tables
live in its own package, ``token_tree/``."""
