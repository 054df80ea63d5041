"""Acceptors (config group ``acceptor``): what keeps a prefix of each draft and adds the
bonus or correction token.  The lossless rule's math lives in the core
(``specflow.acceptance``), which plain decoding uses too."""
