"""Prompts the target writes itself (train_heads/magpie.py): what is kept, what is cached."""

from __future__ import annotations

import json

import pytest
import torch

import train_heads.generate as generate_mod
from train_heads.generate import Generated
from train_heads.magpie import (
    keep_reason,
    magpie_name,
    ngrams,
    prompt_text,
    self_written,
    user_prefix,
)
from train_heads.prompts import chat_ids

END, START = 1, 2


class ChatWords:
    """A word-level tokenizer with a chat template: each new word gets the next id."""

    all_special_ids = [END, START]

    def __init__(self) -> None:
        self.vocab = {"<|end|>": END, "<|start|>": START}
        self.words = {END: "<|end|>", START: "<|start|>"}

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.vocab) + 1
            self.words[self.vocab[word]] = word
        return self.vocab[word]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._id(w) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = ("<|start|> system you are a very helpful and honest assistant <|end|> "
                "<|start|> user "
                f"{messages[0]['content']} <|end|>"
                + (" <|start|> assistant" if add_generation_prompt else ""))
        return self.encode(text) if tokenize else text


HELD = "the quick brown fox jumps over the lazy dog today"
# (drawn words, closing token or None): what the scripted "target" writes, in order
SCRIPT = [
    ("write a poem about the sea please", END),          # kept
    ("tell me more", None),                              # unfinished: never closed the turn
    ("write a poem about the sea please", END),          # duplicate (same opener as the first)
    ("hi", END),                                         # short
    (f"please {HELD}", END),                             # shares 8+ tokens with a held-out one
    ("this sentence into german", START),                # kept: closed by another special
    ("what is a prime number <|im_start|> a prime is", None),  # kept: the marker as text
    ("then jumps over the lazy dog today", END),         # kept: 6 shared tokens + the
]                                                        # template's end are not overlap
# prompt j of a chunk starts with opener j % 2: "" or "Translate" (part of the prompt)


def scripted_drawing(tok: ChatWords, starts_seen: list[list[int]]):
    """``generate_with_hidden`` that writes ``SCRIPT`` when drawing (temperature > 0) and
    runs the real model when answering."""
    real = generate_mod.generate_with_hidden
    queue = list(SCRIPT)

    def fake(lm, prompts, layers, max_new_tokens, batch_size=16, eos_ids=(), progress=True,
             temperature=0.0, seed=0):
        if temperature <= 0:
            return real(lm, prompts, layers, max_new_tokens, batch_size, eos_ids, progress)
        out = []
        for start in prompts:
            starts_seen.append(list(start))
            words, close = queue.pop(0)
            body = tok.encode(words) + ([close] if close else [])
            out.append(Generated(tokens=[*start, *body], prompt_len=len(start), hidden={}))
        return out

    return fake


def test_a_turn_marker_written_as_text_ends_the_prompt():
    assert prompt_text(" Who is magneto? ", True) == ("Who is magneto?", True)
    assert prompt_text("Who is magneto?\n\nMagneto is", False) == (
        "Who is magneto?\n\nMagneto is", False)
    assert prompt_text("Explain X.\n<|im_start|><|im_start|>\nX is", False) == ("Explain X.", True)
    assert prompt_text("Hi there you<|endoftext|>Q: <|im_end|>", False) == ("Hi there you", True)


def test_keep_reasons():
    held = ngrams(list(range(10, 20)))
    assert keep_reason([3, 4, 5], "a b c", True, set(), held) == "kept"
    assert keep_reason([3, 4, 5], "a b c", False, set(), held) == "unfinished"
    assert keep_reason([3, 4], "a b", True, set(), held) == "short"
    assert keep_reason([3, 4, 5], "a b c", True, {"a b c"}, held) == "duplicate"
    assert keep_reason([9, *range(10, 18)], "x " * 9, True, set(), held) == "heldout_overlap"
    assert keep_reason([9, *range(10, 17)], "x " * 8, True, set(), held) == "kept"  # 7-run


def test_prompts_kept_answered_and_cached(tiny_qwen, tmp_path, monkeypatch):
    _, lm = tiny_qwen
    tok = ChatWords()
    held = [chat_ids(tok, HELD)]
    prefix = user_prefix(tok)
    assert tok.decode(prefix) == ("<|start|> system you are a very helpful and honest "
                                  "assistant <|end|> <|start|> user")  # longer than NGRAM
    starts: list[list[int]] = []
    monkeypatch.setattr(generate_mod, "generate_with_hidden", scripted_drawing(tok, starts))
    kw = dict(temperature=1.0, max_prompt_tokens=16, max_new_tokens=5,
              openers=["", "Translate"], seed=3, batch_size=4, chunk=4, eos=(END,),
              held_out=held)
    seqs, stats = self_written(lm, tok, len(SCRIPT), tmp_path, **kw)

    assert starts[0] == prefix and starts[1] == prefix + tok.encode("Translate")
    assert starts[2] == prefix  # prompt j of a chunk takes opener j % 2
    assert {k: stats[k] for k in stats if k.startswith("magpie_") and k[7:] in (
        "drawn", "kept", "unfinished", "short", "duplicate", "heldout_overlap")} == {
        "magpie_drawn": 8, "magpie_kept": 4, "magpie_unfinished": 1, "magpie_short": 1,
        "magpie_duplicate": 1, "magpie_heldout_overlap": 1}
    assert seqs.num_seqs == 4
    first = chat_ids(tok, "write a poem about the sea please")
    second = chat_ids(tok, "Translate this sentence into german")
    assert seqs.seq(0)[0][: len(first)].tolist() == first and seqs.seq(0)[2] == len(first)
    assert seqs.seq(1)[0][: len(second)].tolist() == second
    third = chat_ids(tok, "what is a prime number")
    assert seqs.seq(2)[0][: len(third)].tolist() == third
    assert seqs.num_positions == stats["magpie_built_positions"] > 0
    name = magpie_name(1.0, 16, 5, ["", "Translate"], 3)
    assert stats["magpie_name"] == name
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{name}-prompts_0.json", f"{name}-prompts_1.json", f"{name}-prompts_8.jsonl",
        f"{name}_0.safetensors", f"{name}_1.safetensors"]
    listing = [json.loads(line) for line in (tmp_path / f"{name}-prompts_8.jsonl").open()]
    assert stats["magpie_prompts_file"] == str(tmp_path / f"{name}-prompts_8.jsonl")
    assert [r["why"] for r in listing] == ["kept", "unfinished", "duplicate", "short",
                                           "heldout_overlap", "kept", "kept", "kept"]
    assert [(r["chunk"], r["j"]) for r in listing] == [(c, j) for c in (0, 1) for j in range(4)]
    assert [r["prompt"] for r in listing if r["prompt"]] == [
        "write a poem about the sea please", "Translate this sentence into german",
        "what is a prime number", "Translate then jumps over the lazy dog today"]

    def refuse(*args, **kwargs):
        raise AssertionError("a rerun on the cache must not run the model")

    monkeypatch.setattr(generate_mod, "generate_with_hidden", refuse)
    again, stats2 = self_written(lm, tok, len(SCRIPT), tmp_path, **kw)
    assert torch.equal(again.tokens, seqs.tokens) and torch.equal(again.feats, seqs.feats)
    assert stats2["magpie_kept"] == 4 and stats2["magpie_built_s"] == 0.0
    # other drawing settings are other chunks, never the cached ones
    assert magpie_name(0.7, 16, 5, ["", "Translate"], 3) != name
    with pytest.raises(AssertionError, match="must not run the model"):
        self_written(lm, tok, len(SCRIPT), tmp_path, **{**kw, "temperature": 0.7})


def numbered_drawing(tok: ChatWords, calls: list[int]):
    """``generate_with_hidden`` drawing "prompt number <i> here" (a new i per draw, every
    one closed) and answering with the real model; ``calls`` counts the drawing calls."""
    real = generate_mod.generate_with_hidden
    count = iter(range(10_000))

    def fake(lm, prompts, layers, max_new_tokens, batch_size=16, eos_ids=(), progress=True,
             temperature=0.0, seed=0):
        if temperature <= 0:
            return real(lm, prompts, layers, max_new_tokens, batch_size, eos_ids, progress)
        calls.append(len(prompts))
        return [Generated([*p, *tok.encode(f"prompt number {next(count)} here"), END],
                          len(p), {}) for p in prompts]

    return fake


def test_more_prompts_redraw_a_partial_chunk_and_stale_answers_are_rebuilt(
        tiny_qwen, tmp_path, monkeypatch):
    _, lm = tiny_qwen
    tok = ChatWords()
    calls: list[int] = []
    monkeypatch.setattr(generate_mod, "generate_with_hidden", numbered_drawing(tok, calls))
    kw = dict(temperature=1.0, max_prompt_tokens=8, max_new_tokens=3, openers=[""], seed=0,
              batch_size=4, chunk=4, eos=(END,), held_out=[])
    seqs, stats = self_written(lm, tok, 3, tmp_path, **kw)
    assert calls == [3] and seqs.num_seqs == 3 and stats["magpie_kept"] == 3
    seqs, stats = self_written(lm, tok, 6, tmp_path, **kw)  # chunk 0 had 3 draws, not 4
    assert calls == [3, 4, 2] and seqs.num_seqs == 6 and stats["magpie_drawn"] == 6
    name = magpie_name(1.0, 8, 3, [""], 0)
    first = json.loads((tmp_path / f"{name}-prompts_0.json").read_text())
    assert len(first) == 4
    # a prompts file edited (or a filter changed): the answers follow the kept list
    first[1]["closed"] = False
    (tmp_path / f"{name}-prompts_0.json").write_text(json.dumps(first))
    again, stats = self_written(lm, tok, 6, tmp_path, **kw)
    assert calls == [3, 4, 2] and stats["magpie_unfinished"] == 1
    assert again.num_seqs == 5 and stats["magpie_built_positions"] > 0
    kept = [chat_ids(tok, prompt_text(d["drawn"], True)[0]) for d in first if d["closed"]]
    assert [again.seq(i)[0][: again.seq(i)[2]].tolist() for i in range(3)] == kept


def test_bad_drawing_settings_name_the_value(tmp_path):
    from omegaconf import OmegaConf

    from specflow.errors import ConfigError
    from train_heads.feature_job import self_written_data

    base = {"seed": 0, "gen_batch_size": 4, "chunk": 4}
    for bad, match in (({"magpie_openers": "Translate"}, "magpie_openers='Translate'"),
                       ({"magpie_temperature": 0.0}, "magpie_temperature=0.0: use > 0"),
                       ({"magpie_max_prompt_tokens": 0}, "magpie_max_prompt_tokens=0")):
        with pytest.raises(ConfigError, match=match):
            self_written_data(None, ChatWords(), OmegaConf.create({**base, **bad}), 4, tmp_path,
                              None, [])


def test_prompt_files_kept_answered_cached_and_checked(tiny_qwen, tmp_path, monkeypatch):
    """``head.data.prompt_files``: nulls skipped; long, duplicate and held-out-overlapping
    prompts dropped and counted; the rest answered greedily (the same tokens as the model's
    own greedy answers), cached per file, loaded on a rerun; bad files name the line."""
    from specflow.errors import ConfigError
    from train_heads.generate import generate_with_hidden
    from train_heads.prompt_files import file_chunk_name, file_prompts, read_prompt_file

    _, lm = tiny_qwen
    tok = ChatWords()
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "write a poem about the sea please"}, {"prompt": None, "why": "short"},
        {"prompt": f"please {HELD}"}, {"prompt": "word " * 40}, {"prompt": "what is a prime"},
    )) + "\n\n")
    two.write_text(json.dumps({"prompt": "what is a prime"}) + "\n"
                   + json.dumps({"prompt": "tell me more"}) + "\n")
    assert read_prompt_file(one)[1] is None and len(read_prompt_file(one)) == 5
    cache = tmp_path / "cache"
    cache.mkdir()
    kw = dict(max_new_tokens=4, max_prompt_tokens=30, batch_size=2, chunk=2, eos=(END,),
              held_out=[chat_ids(tok, HELD)])
    seqs, stats = file_prompts(lm, tok, [str(one), str(two)], cache, **kw)
    assert {k: v for k, v in stats.items() if isinstance(v, int)} == {
        "files_read": 6, "files_kept": 3, "files_long": 1, "files_duplicate": 1,
        "files_heldout_overlap": 1, "files_built_positions": seqs.num_positions}
    kept = [chat_ids(tok, t) for t in ("write a poem about the sea please", "what is a prime",
                                       "tell me more")]
    greedy = generate_with_hidden(lm, kept, [], 4, 3, (END,), progress=False)
    assert [seqs.seq(i)[0].tolist() for i in range(3)] == [g.tokens for g in greedy]
    assert [seqs.seq(i)[2] for i in range(3)] == [len(k) for k in kept]
    names = [file_chunk_name(4, kept[:2]), file_chunk_name(4, kept[2:])]
    assert stats["files_chunks"] == [f"{n}_*" for n in names]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [f"{names[0]}_0.safetensors", f"{names[1]}_0.safetensors"])

    def refuse(*args, **kwargs):
        raise AssertionError("a rerun on the cache must not run the model")

    monkeypatch.setattr(generate_mod, "generate_with_hidden", refuse)
    again, stats2 = file_prompts(lm, tok, [str(one), str(two)], cache, **kw)
    assert torch.equal(again.tokens, seqs.tokens) and torch.equal(again.feats, seqs.feats)
    assert stats2["files_built_positions"] == 0 and stats2["files_kept"] == 3
    bad = tmp_path / "bad.jsonl"
    for text, match in (("{\"prompt\": 3}\n", "bad.jsonl line 1 has no \"prompt\" string"),
                        ("\n[1, 2]\n", "bad.jsonl line 2 has no \"prompt\""),
                        ("{\"text\": \"hi\"}\n", "line 1 has no \"prompt\""),
                        ("{oops\n", "bad.jsonl line 1 is not JSON")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            file_prompts(lm, tok, [str(bad)], cache, **kw)
    with pytest.raises(ConfigError, match="missing.jsonl is not a file"):
        file_prompts(lm, tok, [str(tmp_path / "missing.jsonl")], cache, **kw)


def test_a_self_written_listing_feeds_prompt_files(tiny_qwen, tmp_path, monkeypatch):
    """The listing a magpie run writes, read back by ``prompt_files``: the same kept
    prompts, answered with the same tokens, without drawing."""
    from train_heads.prompt_files import file_prompts

    _, lm = tiny_qwen
    tok = ChatWords()
    monkeypatch.setattr(generate_mod, "generate_with_hidden", scripted_drawing(tok, []))
    held = [chat_ids(tok, HELD)]
    seqs, stats = self_written(lm, tok, len(SCRIPT), tmp_path, temperature=1.0,
                               max_prompt_tokens=16, max_new_tokens=5, openers=["", "Translate"],
                               seed=3, batch_size=4, chunk=4, eos=(END,), held_out=held)
    other = tmp_path / "other"
    other.mkdir()
    again, fstats = file_prompts(lm, tok, [stats["magpie_prompts_file"]], other,
                                 max_new_tokens=5, max_prompt_tokens=64, batch_size=4, chunk=4,
                                 eos=(END,), held_out=held)
    assert fstats["files_read"] == fstats["files_kept"] == 4
    assert torch.equal(again.tokens, seqs.tokens) and torch.equal(again.prompt_len,
                                                                  seqs.prompt_len)
    # read beside the run that wrote it: every prompt is a duplicate of a self-written one
    _, dup = file_prompts(lm, tok, [stats["magpie_prompts_file"]], other, max_new_tokens=5,
                          max_prompt_tokens=64, batch_size=4, chunk=4, eos=(END,),
                          held_out=held, trained=frozenset(
                              ["write a poem about the sea please", "what is a prime number"]))
    assert (dup["files_kept"], dup["files_duplicate"]) == (2, 2)
