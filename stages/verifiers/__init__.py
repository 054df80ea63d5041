"""Verifiers (config groups ``target_verifier`` and ``intermediate_verifier``): what scores
a round's drafts with a model."""
