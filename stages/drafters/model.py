"""Drafter ``model`` / ``early_exit``: draft autoregressively with a model at an exit.

- An independent draft model (same tokenizer as the target) at its last layer: standard
  speculative decoding; it keeps its own KV cache and catches up lazily.
- The target model itself at an early exit L_d (``exit_layer``): self-speculation.  The
  drafter shares the target's session, so the target verifier continues from the layer-L_d
  hidden states the drafter kept (layers < L_d never run twice for a position).
"""

from __future__ import annotations

from typing import Any

from specflow.drafting import SubVocabHead, draft_with_model
from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.models.resolve import as_layered_lm
from specflow.protocols import ModelUse
from specflow.state import DecodeState, Draft, RequestLocal
from stages.drafters.base import DrafterDefaults, check_k


class ModelDrafter(DrafterDefaults):
    """Draft with ``model`` at ``exit_layer`` (default: its last layer).

    Args:
        model: the draft model (config mapping, name/path, or a loaded model).
        k: the most tokens drafted per round (``Drafter.k``, config ``drafter.k``).
        exit_layer: draft from this exit (1..N); an early exit of the target is
            self-speculative drafting.  A float in (0, 1) is a fraction of the depth,
            ``round(exit_layer * N)`` (at least 1): one config fits targets of any depth.
        min_confidence: stop drafting once the drafter's top probability drops below this.
        vocab_subset: draft over only the N lowest token ids plus the request's prompt tokens
            and EOS (``SubVocabHead``: the head's cost shrinks by about N / V; lossless, the
            target verifies).  ``None``: the full vocabulary.
        context_window: the draft model sees only the last ``context_window`` prompt tokens
            and everything after them (``specflow.catchup``): its prefill of a long prompt
            costs that many positions, its drafts read less context (lossless either way).
            ``None``: the whole prompt.  Not for the target's own exits (refused).
    """

    name = "model"

    def __init__(
        self,
        model: Any,
        k: int = 4,
        exit_layer: int | float | None = None,
        min_confidence: float = 0.0,
        vocab_subset: int | None = None,
        context_window: int | None = None,
    ) -> None:
        self.k = check_k(k)
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"drafter.min_confidence must be in [0, 1), got {min_confidence}")
        self.min_confidence = min_confidence
        self.lm = as_layered_lm(model)
        depth = self.lm.info.num_layers
        if isinstance(exit_layer, float) and 0.0 < exit_layer < 1.0:
            exit_layer = max(1, round(exit_layer * depth))
        self.exit_layer = depth if exit_layer is None else exit_layer
        if not 1 <= self.exit_layer <= depth:
            raise ConfigError(
                f"drafter.exit_layer={exit_layer} is outside 1..{depth} "
                f"({self.lm.info.name} has {depth} layers)"
            )
        if vocab_subset is not None:
            if vocab_subset < 1:
                raise ConfigError(f"drafter.vocab_subset must be >= 1 or null, got {vocab_subset}")
            SubVocabHead.check_supported(self.lm)  # fail at build time, not mid-run
        self.vocab_subset = vocab_subset
        if context_window is not None and context_window < 1:
            raise ConfigError(
                f"drafter.context_window must be >= 1 or null, got {context_window}")
        self.context_window = context_window
        # Per request: its vocabulary subset (built from its prompt), when vocab_subset is set.
        self._subvocab: RequestLocal[SubVocabHead | None] = RequestLocal(self._build_subvocab)

    def models(self) -> list[ModelInfo]:
        return [self.lm.info]

    def uses(self) -> list[ModelUse]:
        return [ModelUse(self.lm, self.exit_layer, context_window=self.context_window)]

    def _build_subvocab(self, state: DecodeState) -> SubVocabHead | None:
        if self.vocab_subset is None:
            return None
        always = list(state.tokens) + list(self.lm.info.eos_token_ids)
        model = state.session(self.lm).model  # the model as placed for this run
        return SubVocabHead.build(model, self.vocab_subset, always)

    def begin(self, states: list[DecodeState]) -> None:
        """The requests' vocabulary subsets, if any.  No prefill: the drafter's session
        prefills lazily on its first draft, so a request whose draft-length policy never
        drafts (k = 0 throughout) never pays for it."""
        for st in states:
            self._subvocab.set(st, self._build_subvocab(st))

    def propose(self, states: list[DecodeState], asked: list[int]) -> list[Draft]:
        subvocabs = [self._subvocab.get(st) for st in states]
        return draft_with_model(
            states, self.lm, self.exit_layer, asked, self.min_confidence, subvocabs=subvocabs,
            window=self.context_window,
        )
