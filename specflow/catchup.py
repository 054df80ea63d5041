"""Bring requests' model sessions up to their committed tokens: the one place this is done.

A session of ``lm`` is *synced at exit L* when layers ``< L`` have processed every committed
token but the last; the last one is processed by the round's next forward (the verifier
scores it in front of the draft, a drafter's first step runs it).  So a request is

    behind = (len(state.tokens) - 1) - session.computed(L - 1)

positions behind (layers are computed bottom-up, so ``computed`` never grows with depth and
layer ``L - 1`` is the deepest one missing work).  A new request is behind by its whole
prompt (the prefill); a drafter that sat out rounds (a pool's idle arm, a fallback's second
drafter, a policy's plain rounds) by the tokens committed meanwhile; a drafter that drafted
last round by one position, its bonus token.

A draft model may see less than the whole sequence (``ModelUse.context_window`` W): its
session then holds the request's tokens from ``context_start`` on, the last W prompt tokens
and everything after them, at positions counted from there (its keys' positions are shifted
alike, which rotary attention does not see).  The start is fixed per request, so the session
keeps its prefix from round to round; it shortens the draft model's prefill of a long
prompt to W positions.  Only a drafter's own model may be windowed (``specflow.engine``):
the target's sessions always hold every token.

Every verifier's prefill and a pool's switch of arms call ``catch_up``: one batched forward
(``forward_hidden``) over the requests more than ``slack`` positions behind, timed with the
requests' ``DecodeState.clock`` (the pipeline's clock), never with a second counter.  A
model drafter's lazy catch-up (``specflow.drafting.draft_with_model``) only syncs the
tokens (``sync_tokens``) and lets its first drafting step's forward process the positions
behind: a pass over ``behind + 1`` rows costs less than a pass over ``behind`` and another
over one.
"""

from __future__ import annotations

from dataclasses import dataclass

from specflow.kv.base import LayeredLM
from specflow.kv.session import forward_hidden
from specflow.state import DecodeState


@dataclass
class CatchUp:
    """What ``catch_up`` did.

    Attributes:
        behind: per request, the positions it processed (0 for a request within ``slack``).
        seconds: the batched forward's duration by the requests' clock (0.0 when none ran);
            every request that caught up waited for all of it.
    """

    behind: list[int]
    seconds: float = 0.0


def context_start(state: DecodeState, window: int | None) -> int:
    """The first of the request's tokens a session with context ``window`` holds: the last
    ``window`` prompt tokens' first (0 for a shorter prompt or no window)."""
    return 0 if window is None else max(0, state.prompt_len - window)


def session_tokens(state: DecodeState, window: int | None) -> list[int]:
    """The committed tokens a session with context ``window`` holds (module doc)."""
    start = context_start(state, window)
    return state.tokens[start:] if start else state.tokens


def positions_behind(state: DecodeState, lm: LayeredLM, exit_layer: int,
                     window: int | None = None) -> int:
    """``behind`` of the module doc for one request, without syncing anything: the positions
    ``catch_up`` would process now (only work on the committed tokens counts, not on
    rejected drafts the session still holds; a session never opened is behind by all)."""
    tokens = session_tokens(state, window)
    session = state.sessions.get(id(lm))
    done = 0
    if session is not None:
        done = min(session.computed(exit_layer - 1), session.kept_prefix(tokens))
    return max(0, len(tokens) - 1 - done)


def sync_tokens(states: list[DecodeState], lm: LayeredLM, exit_layer: int,
                window: int | None = None) -> list[int]:
    """Give each request's session of ``lm`` the request's committed tokens (``set_tokens``:
    the rejected drafts of earlier rounds are dropped; from ``context_start`` on with a
    ``window``) and return, per request, ``behind`` of the module doc: the positions before
    its last committed token that layers ``< exit_layer`` have not processed.  No forward
    runs: a caller that runs one over the session (``forward_hidden``) processes them."""
    missing = []
    for st in states:
        session = st.session(lm)
        tokens = session_tokens(st, window)
        session.set_tokens(tokens)
        missing.append(max(0, len(tokens) - 1 - session.computed(exit_layer - 1)))
    return missing


def catch_up(
    states: list[DecodeState], lm: LayeredLM, exit_layer: int, slack: int = 0,
    window: int | None = None,
) -> CatchUp:
    """Sync each request's session of ``lm`` at ``exit_layer`` (see module doc).

    Every session first takes the request's committed tokens (``set_tokens``: the rejected
    drafts of earlier rounds are dropped), from ``context_start`` on with a ``window``.  The
    requests more than ``slack`` positions behind then run in ONE batched forward up to their
    last committed token.  ``slack=1`` leaves the usual one position of a drafter's previous
    round to ride along with its first drafting step.
    """
    missing = sync_tokens(states, lm, exit_layer, window)
    behind = [m if m > slack else 0 for m in missing]
    todo = []
    for st, late in zip(states, behind, strict=True):
        if late:
            session = st.session(lm)
            todo.append((session, exit_layer, len(session.tokens) - 1))
    if not todo:
        return CatchUp(behind)
    clock = states[0].clock
    start = clock()
    forward_hidden(todo)
    return CatchUp(behind, clock() - start)
