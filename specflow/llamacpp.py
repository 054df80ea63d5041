"""llama.cpp as a baseline: greedy decoding of a model's GGUF file through llama.cpp's C API.

The models specflow installs are GGUF files (``specflow.models.registry``; the file:
``specflow.models.prepare.gguf_path``); specflow decodes them dequantized to fp32 (or their
quantized blocks, ``model.weights=gguf``), llama.cpp decodes the file with its own kernels.  This
module runs llama.cpp on the same prompt token ids specflow builds (the chat template of
specflow's tokenizer; the GGUF's vocabulary is the same), greedily, and times each request's
first token (TTFT) and the rest, so that it can stand as one more method of a benchmark
table (``scripts/bench_vs_hf.py``).  Modes, all greedy and meant to give plain decoding's
tokens (llama.cpp's kernels for several rows need not give its one-row results bit for bit,
so a near tie may go another way; the benchmark's identical-output column counts it):

- ``plain``: one token per decoding call;
- ``lookup``: prompt lookup: ``LlamaPromptLookupDecoding``'s n-gram search (llama-cpp-python's
  own) proposes up to ``lookup_k`` tokens, the model scores them in one call, the longest
  prefix equal to its greedy choices is kept with the next choice, the rest of the KV cache is
  removed (``llama_memory_seq_rm``);
- ``draft``: a draft model's GGUF on a second context proposes ``draft_k`` tokens greedily,
  verified the same way.

llama-cpp-python is optional (``bash scripts/setup.sh`` installs it; it builds llama.cpp from
source): it is imported when a decoder is made, and its absence is one error naming the fix.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from specflow.errors import SpecflowError

LLAMA_CPP_REQUIREMENT = "llama-cpp-python==0.3.36"  # requirements-llamacpp.txt's pin
Mode = Literal["plain", "lookup", "draft"]
MODES: tuple[str, ...] = ("plain", "lookup", "draft")


class LlamaCppMissingError(SpecflowError, ImportError):
    """llama-cpp-python is not installed in this interpreter."""


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or one error that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppMissingError(
            f"the llama.cpp baselines need llama-cpp-python ({exc}); install it with "
            f"`bash scripts/setup.sh` or `.venv/bin/python -m pip install "
            f"{LLAMA_CPP_REQUIREMENT}` (builds llama.cpp, about 5 minutes on 2 cores)"
        ) from None
    return llama_cpp


@dataclass
class Decoded:
    """One greedy generation: its tokens (the stop token included when hit), seconds in all
    and to the first token, and the verification rounds (0 in plain mode) with the draft
    tokens they scored and kept."""

    tokens: list[int]
    total_s: float
    ttft_s: float
    stop_reason: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


_QUIET: Any = None  # the no-op log callback, kept alive while llama.cpp may call it


class _Context:
    """A model and one context on it (one sequence), fed token ids, answering argmaxes."""

    def __init__(self, llama: Any, path: Path, n_ctx: int, threads: int, n_batch: int,
                 repack: bool) -> None:
        self.ll = llama
        params = llama.llama_model_default_params()
        params.use_extra_bufts = repack
        self.model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise SpecflowError(f"llama.cpp could not load {path}")
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = llama.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SpecflowError(f"llama.cpp could not make a context of {n_ctx} for {path}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.batch = llama.llama_batch_init(n_batch, 0, 1)
        self.mem = llama.llama_get_memory(self.ctx)
        self.n_past = 0

    def reset(self) -> None:
        self.ll.llama_memory_clear(self.mem, True)
        self.n_past = 0

    def feed(self, tokens: list[int], outputs: int) -> list[int]:
        """Append ``tokens`` at the next positions (in chunks of ``n_batch``); the greedy
        choice after each of the last ``outputs`` of them."""
        if self.n_past + len(tokens) > self.n_ctx:
            raise SpecflowError(f"llama.cpp context of {self.n_ctx} tokens is too short")
        first_out = len(tokens) - outputs
        chosen: list[int] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                b.token[j] = tok
                b.pos[j] = self.n_past + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = 0
                b.logits[j] = start + j >= first_out
            if self.ll.llama_decode(self.ctx, b) != 0:
                raise SpecflowError("llama_decode failed")
            self.n_past += len(chunk)
            for j in range(len(chunk)):
                if start + j >= first_out:
                    row = self.ll.llama_get_logits_ith(self.ctx, j)
                    chosen.append(int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax()))
        return chosen

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions of the KV cache."""
        if n < self.n_past:
            self.ll.llama_memory_seq_rm(self.mem, 0, n, -1)
            self.n_past = n

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = self.model = None


class LlamaCppDecoder:
    """Greedy decoding of a GGUF with llama.cpp in one of ``MODES`` (module doc).

    Args:
        gguf: the target's GGUF file.
        mode: ``plain``, ``lookup`` or ``draft``.
        threads: llama.cpp's threads (prompt and decoding alike).
        n_ctx: the context size (prompt + new tokens + a draft must fit).
        lookup_k, lookup_ngram: ``lookup``: tokens proposed a round, longest n-gram searched.
        draft_gguf, draft_k: ``draft``: the draft model's GGUF and its tokens a round.
        repack: let llama.cpp repack the weights for this CPU (its extra buffer types);
            ``None``: yes, except on a CPU with AMX, where llama.cpp 0.3.36's AMX matmul
            crashed (a segmentation fault decoding SmolLM2's Q4_1 file on a Xeon with AMX).
    """

    def __init__(self, gguf: Path, mode: Mode = "plain", threads: int = 2, n_ctx: int = 4096,
                 lookup_k: int = 10, lookup_ngram: int = 2, draft_gguf: Path | None = None,
                 draft_k: int = 4, repack: bool | None = None) -> None:
        global _QUIET
        if mode not in MODES:
            raise SpecflowError(f"llama.cpp mode {mode!r}: one of {', '.join(MODES)}")
        if mode == "draft" and draft_gguf is None:
            raise SpecflowError("llama.cpp draft mode needs the draft model's GGUF")
        llama = import_llama_cpp()
        if _QUIET is None:
            _QUIET = llama.llama_log_callback(lambda level, text, data: None)
            llama.llama_log_set(_QUIET, ctypes.c_void_p(0))
            llama.llama_backend_init()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.mode = mode
        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=lookup_ngram,
                                                num_pred_tokens=lookup_k)
        self.draft_k = draft_k
        if repack is None:
            from specflow.results.baselines import machine_description

            repack = not machine_description()["cpu"].get("amx_tile", False)
        self.target = _Context(llama, gguf, n_ctx, threads, 512, repack)
        self.draft = (_Context(llama, draft_gguf, n_ctx, threads, 512, repack)
                      if mode == "draft" and draft_gguf is not None else None)

    def close(self) -> None:
        """Free llama.cpp's models and contexts."""
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def generate(self, prompt: list[int], max_new: int, stop_ids: set[int]) -> Decoded:
        """Greedy tokens after ``prompt`` until a token of ``stop_ids`` or ``max_new``."""
        t0 = time.perf_counter()
        self.target.reset()
        (nxt,) = self.target.feed(prompt, 1)
        if self.draft is not None:
            self.draft.reset()
            self.draft.feed(prompt, 0)
        out = [nxt]
        ttft = time.perf_counter() - t0
        rounds = drafted = accepted = 0
        while out[-1] not in stop_ids and len(out) < max_new:
            proposal = self._propose(prompt, out, max_new - len(out) - 1)
            n_past = self.target.n_past  # the context up to out[-1], exclusive
            chosen = self.target.feed([out[-1], *proposal], 1 + len(proposal))
            kept = 0
            while kept < len(proposal) and proposal[kept] == chosen[kept]:
                kept += 1
            new = [*proposal[:kept], chosen[kept]]
            if any(t in stop_ids for t in new):
                new = new[: next(i for i, t in enumerate(new) if t in stop_ids) + 1]
            out += new[: max_new - len(out)]
            self.target.truncate(n_past + 1 + kept)
            rounds += 1  # a target call, as specflow counts its rounds
            drafted += len(proposal)
            accepted += kept
        total = time.perf_counter() - t0
        stop = "eos" if out[-1] in stop_ids else "length"
        return Decoded(out, total, ttft, stop, rounds, drafted, accepted)

    def _propose(self, prompt: list[int], out: list[int], room: int) -> list[int]:
        """Up to ``room`` draft tokens after ``prompt + out`` (none in plain mode)."""
        if room <= 0 or self.mode == "plain":
            return []
        if self.mode == "lookup":
            ids = np.asarray([*prompt, *out], dtype=np.intc)
            return [int(t) for t in self.lookup(ids)[:room]]
        draft = self.draft
        assert draft is not None
        seen = [*prompt, *out]
        # the draft's cache holds the kept context, then tokens the target may have refused
        draft.truncate(len(seen) - 1)
        (last,) = draft.feed(seen[draft.n_past :], 1)
        proposal = [last]
        for _ in range(min(self.draft_k, room) - 1):
            (last,) = draft.feed([last], 1)
            proposal.append(last)
        return proposal
