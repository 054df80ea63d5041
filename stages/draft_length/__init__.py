"""Draft-length policies (config group ``draft_length``): how many tokens a round asks for.

Each round the engine offers a policy ``limit = min(drafter.k, budget - 1)`` (the drafter's
maximum, never past ``max_new_tokens``) and the policy returns the asked length in
``0..limit`` (glossary: ``specflow.state``); after the round it reports what happened in a
``RoundReport``.  User guide: docs/methods.md, section "Draft length".

- ``FixedDraftLength``: always the limit (the default when no policy is set).
- ``HeuristicDraftLength``: Hugging Face's rule: +2 after a fully accepted draft, -1 otherwise.
- ``AdaptiveDraftLength``: a cost model measured online per request, maximizing expected
  tokens per second, k = 0 (skip drafting: a plain decoding round) included.

One module per policy: ``fixed``, ``heuristic``, ``adaptive``.
"""
