"""``python -m train_heads.train head=feature``: train an EAGLE-style feature head.

Phases (each timed into ``report.md`` / ``metrics.json``):

1. data: the target answers the local-text training prompts and the held-out Spec-Bench
   questions greedily, keeping ``h_N`` (``train_heads.feature_data``; chunked cache: a rerun
   loads it, an interrupted run resumes); with ``head.data.specbench_train``, also the
   Spec-Bench dev questions that are not held out, added to the training sequences; with
   ``head.data.magpie_prompts`` prompts the target writes itself (``train_heads.magpie``),
   with ``head.data.prompt_files`` prompts read from JSONL files
   (``train_heads.prompt_files``), each answered greedily;
2. draft vocabulary: the most frequent tokens of the training sequences;
3. evaluate the untrained head (initialised from the target's last layer) on the held-out
   answers: agreement with the target's greedy tokens, KL, simulated τ at ``eval_k``;
4. fit with Lightning (``FeatureHeadDistiller``);
5. evaluate again, save ``feature_head.safetensors`` (+ ``.json``) to the run dir and, with
   ``output.install``, to ``<cache>/heads/<model>/feature_head.safetensors``, where
   ``drafter=feature`` finds it; with ``output.format=eagle`` (a ``head.style=eagle`` head:
   EAGLE-1/2's math over the whole vocabulary) also as an EAGLE-1/2 folder ``eagle/``
   (``specflow.models.eagle_export``), installed beside it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError
from specflow.kv.contiguous import KVCache
from specflow.models.eagle_export import place_feature_head, save_eagle_folder
from specflow.models.feature_head import (
    FeatureHead,
    default_feature_head_path,
    load_feature_head,
    save_feature_head,
)
from train_heads.cache import data_cache_dir
from train_heads.feature_data import (
    FeatureSequences,
    data_key,
    draft_vocabulary,
    generate_chunked,
)
from train_heads.job_setup import check_disjoint, make_logger, trainer_args
from train_heads.local_prompts import local_prompts
from train_heads.magpie import self_written
from train_heads.prompt_files import file_prompts, read_prompt_file
from train_heads.prompts import Prompt, chat_ids, shared_prefix, specbench_split

log = logging.getLogger("train_heads")
DATA_VERSION = 1
# ``head.data`` keys left out of the cache folder's key: the local prompts' chunks are a
# prefix-stable sequence (``num_prompts``), and the Spec-Bench training answers have their own
# chunk name (``specbench<N>_<i>``), so neither changes the folder an existing config uses.
KEY_EXCLUDED = ("num_prompts", "specbench_train", "specbench_max_new_tokens",
                "specbench_samples", "specbench_temperature", "magpie_prompts",
                "magpie_temperature", "magpie_max_prompt_tokens", "magpie_max_new_tokens",
                "magpie_openers", "prompt_files", "prompt_files_max_new_tokens")


def sampled_chunk_name(max_new_tokens: int, temperature: float, draw: int) -> str:
    """The chunk name of the ``draw``-th sampled answer set (``specbench<N>-t<T>-s<draw>``):
    ``N``, ``T`` and the draw are part of its identity, and it never matches the greedy
    answers' ``specbench<N>_<i>`` glob."""
    return f"specbench{max_new_tokens}-t{temperature:g}-s{draw}"


def drawn_answers(lm: Any, prompts: list[list[int]], directory: Path, max_new_tokens: int,
                  samples: int, temperature: float, batch_size: int, chunk: int,
                  eos: tuple[int, ...]) -> tuple[FeatureSequences, dict[str, float]]:
    """``samples`` more answers of each Spec-Bench training prompt, drawn from the target at
    ``temperature`` (draw ``j`` seeded ``j``; chunks ``sampled_chunk_name(...)_<i>``), and
    the seconds / positions built this run.  ``ConfigError`` for a negative count, or for
    draws without prompts (``specbench_train``) or at temperature 0."""
    if samples < 0:
        raise ConfigError(f"head.data.specbench_samples={samples}: use 0 (greedy answers only) "
                          "or the number of drawn answers per question")
    if samples and (not prompts or temperature <= 0):
        raise ConfigError(f"head.data.specbench_samples={samples} needs "
                          "head.data.specbench_train=true and head.data.specbench_temperature "
                          f"> 0 (got {temperature})")
    parts, built = [], {"specbench_sampled_built_s": 0.0, "specbench_sampled_built_positions": 0}
    for draw in range(1, samples + 1):
        name = sampled_chunk_name(max_new_tokens, temperature, draw)
        part, t_part = generate_chunked(lm, prompts, directory, name, max_new_tokens,
                                        batch_size, chunk, eos, temperature=temperature,
                                        seed=draw)
        parts.append(part)
        for what in ("built_s", "built_positions"):
            built[f"specbench_sampled_{what}"] += t_part[f"{name}_{what}"]
    seqs = FeatureSequences.concat(parts) if parts else FeatureSequences.empty(lm.info.hidden_size)
    return seqs, built


def feature_data_key(model: str, weights_fingerprint: str, dtype: str,
                     data: dict[str, Any]) -> str:
    """The key of the feature data cache folder ``feature-<key>``: the model, its weights,
    the dtype and ``head.data`` without ``KEY_EXCLUDED``."""
    return data_key({"version": DATA_VERSION, "model": model, "weights": weights_fingerprint,
                     "dtype": dtype,
                     "data": {k: v for k, v in data.items() if k not in KEY_EXCLUDED}})


def train_and_heldout(lm: Any, train_ids: list[list[int]], held: list[Prompt], directory: Path,
                      data: Any) -> tuple[FeatureSequences, dict[str, float],
                                          FeatureSequences, dict[str, float]]:
    """The target's greedy answers, with ``h_N``, to the training prompts (``train_*``
    chunks, ``data.max_new_tokens``) and to the held-out questions (``heldout_*``,
    ``data.eval_max_new_tokens``), cached in ``directory``: ``(train, its times, held-out,
    its times)``."""
    eos = lm.info.eos_token_ids
    train, t_train = generate_chunked(lm, train_ids, directory, "train",
                                      int(data.max_new_tokens), int(data.gen_batch_size),
                                      int(data.chunk), eos)
    val, t_val = generate_chunked(lm, [p.ids for p in held], directory, "heldout",
                                  int(data.eval_max_new_tokens), int(data.gen_batch_size),
                                  int(data.chunk), eos)
    return train, t_train, val, t_val


def held_out_uncut(tok: Any, data: Any) -> list[list[int]]:
    """The held-out Spec-Bench questions' first turns, uncut, in the chat template: what the
    self-written prompts must not overlap (benchmarks run the whole question)."""
    return [p.ids for p in specbench_split(tok, 0, int(data.eval_every),
                                           int(data.eval_offset))[1]]


def self_written_data(lm: Any, tok: Any, data: Any, n: int, directory: Path, info: Any,
                      held_out: list[list[int]]) -> tuple[FeatureSequences, dict[str, Any]]:
    """``head.data.magpie_*`` checked (``ConfigError`` naming the value) and passed to
    ``train_heads.magpie.self_written``."""
    openers = data.get("magpie_openers", [""])
    if isinstance(openers, str) or not all(isinstance(o, str) for o in openers):
        raise ConfigError(f"head.data.magpie_openers={openers!r}: use a list of strings, e.g. "
                          "'[\"\",\"Translate\"]' (\"\" is the bare template)")
    temperature = float(data.get("magpie_temperature", 1.0))
    max_prompt = int(data.get("magpie_max_prompt_tokens", 96))
    if n and temperature <= 0:
        raise ConfigError(f"head.data.magpie_temperature={temperature}: use > 0 (greedy "
                          "drawing writes the same prompt for every draw of an opener)")
    if n and max_prompt <= 0:
        raise ConfigError(f"head.data.magpie_max_prompt_tokens={max_prompt}: use > 0")
    return self_written(
        lm, tok, n, directory, temperature=temperature, max_prompt_tokens=max_prompt,
        max_new_tokens=int(data.get("magpie_max_new_tokens", 192)), openers=list(openers),
        seed=int(data.seed), batch_size=int(data.gen_batch_size), chunk=int(data.chunk),
        eos=info.eos_token_ids, held_out=held_out)


@torch.no_grad()
def evaluate_head(head: FeatureHead, lm: Any, data: FeatureSequences, skip: int, k: int
                  ) -> dict[str, float]:
    """On held-out greedy answers: step-1 agreement with the target's greedy token and KL
    (full vocabulary, target features as input), and τ of a simulated greedy speculative
    decoding with drafts of ``k`` (the head drafts from its own features after step 1)."""
    import torch.nn.functional as F

    from train_heads.feature_module import collate

    h = lm.hidden_size
    agree = kl = rows = 0.0
    for i in range(data.num_seqs):
        b = collate(data, [i], skip)
        emb = F.embedding(b.next_tokens, lm.embed_weight).float()
        g = lm.final_norm.float()
        pred = head.float()(head.features(b.feats, g, lm.eps), emb, b.key_valid)[0][0]  # [T, H]
        m = b.generated[0] & b.loss_mask[0]
        if not m.any():
            continue
        xs = head.lm_input(pred[m], g, lm.eps)
        xt = F.rms_norm(b.target_feats[0][m], (h,), lm.final_norm.float(), lm.eps)
        ls = F.log_softmax(xs @ lm.lm_head.float().t(), -1)  # [R, V]
        lt = F.log_softmax(xt @ lm.lm_head.float().t(), -1)
        agree += float((ls.argmax(-1) == b.labels[0][m]).sum())
        kl += float((lt.exp() * (lt - ls)).sum())
        rows += float(m.sum())
    tau = simulate_tau(head, lm, data, k)
    return {"agreement": agree / max(rows, 1), "kl": kl / max(rows, 1), "tau": tau["tau"],
            "accept_by_step": tau["accept_by_step"], "rows": rows}


@torch.inference_mode()
def simulate_tau(head: FeatureHead, lm: Any, data: FeatureSequences, k: int) -> dict[str, Any]:
    """Greedy speculative decoding replayed along each held-out answer (the target's greedy
    tokens are the answer itself): rounds of ``k`` drafts from the placed head (the
    inference path: ``place_feature_head``), accepted up to the first mismatch, plus the
    bonus token."""
    dm = place_feature_head(head, lm)
    rounds = accepted = 0
    hits = [0] * k
    for i in range(data.num_seqs):
        tok, feats, plen = data.seq(i)
        tok = tok.tolist()
        kv = KVCache(dm.kv, len(tok) + k + 1)
        n = plen
        while n < len(tok):
            start, end = kv.length, n - 1
            final = feats[start:end].to(lm.dtype)  # h_N; the head reads no layer inputs
            out = dm.step(dm.features(final, final[:, :0]),
                          torch.tensor(tok[start + 1 : end + 1]),
                          [(kv, end - start)])
            pred = out[-1:]
            a = 0
            for j in range(min(k, len(tok) - n)):
                d = int(dm.ids[dm.logits(pred).argmax(-1)])
                if d != tok[n + j]:
                    break
                a += 1
                hits[j] += 1
                if j + 1 < k:
                    pred = dm.step(pred, torch.tensor([d]), [(kv, 1)])
            kv.truncate(n - 1)
            rounds += 1
            accepted += a
            n += a + 1
    return {"tau": 1 + accepted / max(rounds, 1),
            "accept_by_step": [h / max(rounds, 1) for h in hits]}


def plot_curve(curve: list[dict[str, float]], path: Path, model: str) -> None:
    """Held-out agreement per drafting step against training positions seen."""
    if not curve:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = [c["positions_seen"] / 1000 for c in curve]
    for key in sorted(k for k in curve[-1] if k.startswith("agree_")):
        ax.plot(xs, [c.get(key, float("nan")) for c in curve], marker="o",
                label=f"step {key.removeprefix('agree_')}")
    ax.set_xlabel("training positions seen (thousands)")
    ax.set_ylabel("held-out agreement")
    ax.set_title(f"feature head, {model}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_feature(cfg: DictConfig, loaded: Any, out_dir: Path) -> dict[str, Any]:
    """The ``head=feature`` job (module doc); returns the metrics also written to disk."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from train_heads.feature_module import FeatureDataModule, FeatureHeadDistiller

    lm, info, tok = loaded.lm, loaded.info, loaded.tokenizer
    hc = cfg.head
    style = str(hc.get("style") or "specflow")
    fmt = str(cfg.output.get("format") or "specflow")
    if fmt not in ("specflow", "eagle"):
        raise ConfigError(f"output.format must be specflow or eagle, got {fmt!r}")
    if fmt == "eagle" and style != "eagle":
        raise ConfigError("output.format=eagle writes EAGLE-1/2's layout, which only a head "
                          "of EAGLE's math can fill; fix: add head.style=eagle")
    times: dict[str, float] = {}
    # ---------------------------------------------------------------- 1. data
    t0 = time.perf_counter()
    num_prompts = int(hc.data.num_prompts)
    use_specbench = bool(hc.data.get("specbench_train", False))
    magpie_n = int(hc.data.get("magpie_prompts", 0))
    files = hc.data.get("prompt_files") or []
    if isinstance(files, str):
        raise ConfigError(f"head.data.prompt_files={files!r}: use a list of JSONL paths, e.g. "
                          f"'[{files}]'")
    files = [str(f) for f in files]
    if magpie_n < 0:
        raise ConfigError(f"head.data.magpie_prompts={magpie_n}: use 0 (none) or the number "
                          "of prompts the target writes itself")
    if num_prompts <= 0 and not use_specbench and magpie_n == 0 and not files:
        raise ConfigError("head.data.num_prompts=0 leaves nothing to train on; set "
                          "head.data.specbench_train=true, head.data.magpie_prompts > 0, "
                          "head.data.prompt_files or num_prompts > 0")
    train_prompts = local_prompts(num_prompts, seed=int(hc.data.seed)) if num_prompts > 0 else []
    train_ids = [ids for ids in (chat_ids(tok, p.content) for p in train_prompts)
                 if len(ids) <= int(hc.data.max_prompt_tokens)]
    # Spec-Bench dev question i is held out iff i % eval_every == eval_offset; the others
    # are trained on with specbench_train
    sb_train, held = specbench_split(tok, int(hc.data.eval_prompt_tokens),
                                     int(hc.data.eval_every), int(hc.data.eval_offset))
    if not held:
        raise ConfigError(f"no held-out Spec-Bench question (head.data.eval_every="
                          f"{hc.data.eval_every}, eval_offset={hc.data.eval_offset})")
    sb_train = sb_train if use_specbench else []
    check_disjoint(sb_train, held)
    key = feature_data_key(info.name, info.weights_fingerprint, str(lm.dtype),
                           OmegaConf.to_container(hc.data, resolve=True))
    directory = data_cache_dir(cfg.data.cache_dir) / Path(info.name).name / f"feature-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "key.json").write_text(json.dumps(OmegaConf.to_container(hc.data), indent=2))
    local, t_train, val, t_val = train_and_heldout(lm, train_ids, held, directory, hc.data)
    sb_new = int(hc.data.get("specbench_max_new_tokens", 192))
    sb_name = f"specbench{sb_new}"  # the answers' length is part of the chunks' identity
    sb, t_sb = generate_chunked(lm, [p.ids for p in sb_train], directory, sb_name, sb_new,
                                int(hc.data.gen_batch_size), int(hc.data.chunk),
                                info.eos_token_ids)
    t_sb = {k.replace(sb_name, "specbench", 1): v for k, v in t_sb.items()}
    samples, temp = int(hc.data.get("specbench_samples", 0)), \
        float(hc.data.get("specbench_temperature", 0.8))
    sampled, t_drawn = drawn_answers(lm, [p.ids for p in sb_train], directory, sb_new,
                                     samples, temp, int(hc.data.gen_batch_size),
                                     int(hc.data.chunk), info.eos_token_ids)
    held_uncut = held_out_uncut(tok, hc.data) if magpie_n or files else []
    magpie, t_magpie = self_written_data(lm, tok, hc.data, magpie_n, directory, info,
                                         held_uncut)
    listing = t_magpie.get("magpie_prompts_file")  # the kept prompts, a prompt_files file
    if listing:
        shutil.copyfile(listing, out_dir / "self_written_prompts.jsonl")
    from_files, t_files = file_prompts(
        lm, tok, files, directory,
        max_new_tokens=int(hc.data.get("prompt_files_max_new_tokens", 192)),
        max_prompt_tokens=int(hc.data.max_prompt_tokens),
        batch_size=int(hc.data.gen_batch_size), chunk=int(hc.data.chunk),
        eos=info.eos_token_ids, held_out=held_uncut,
        trained=frozenset(filter(None, read_prompt_file(Path(listing)))) if listing
        else frozenset())
    train = FeatureSequences.concat([local, sb, sampled, magpie, from_files])
    if train.num_seqs == 0:
        raise ConfigError("no training sequences (every local prompt is longer than "
                          "head.data.max_prompt_tokens, no Spec-Bench question to train on, "
                          "and no self-written or file prompt kept: see the magpie_* and "
                          "files_* counts)")
    times["data_s"] = time.perf_counter() - t0
    skip = shared_prefix(held)
    n_train_rows = train.num_positions
    log.info("data: %d training sequences, %d positions (local text %d / %d, Spec-Bench %d / "
             "%d, sampled %d / %d, self-written %d / %d, from files %d / %d); %d held-out "
             "(%d positions); %s",
             train.num_seqs, n_train_rows, local.num_seqs, local.num_positions, sb.num_seqs,
             sb.num_positions, sampled.num_seqs, sampled.num_positions, magpie.num_seqs,
             magpie.num_positions, from_files.num_seqs, from_files.num_positions, val.num_seqs,
             val.num_positions, {**t_train, **t_val, **t_sb, **t_drawn, **t_magpie, **t_files})
    # ---------------------------------------------------------------- 2. vocabulary
    # (of the combined training set; with init_from, the saved head's is kept)
    # (EAGLE-1/2's layout has no draft vocabulary: style eagle drafts over all tokens)
    vocab_size = info.vocab_size if style == "eagle" else int(hc.vocab_size)
    vocab_ids, vocab_info = draft_vocabulary(train, vocab_size, info.vocab_size,
                                             info.eos_token_ids)
    torch.manual_seed(int(cfg.seed))
    if hc.get("init_from"):  # continue training a saved head (more epochs on cached data)
        head = load_feature_head(hc.init_from, info).requires_grad_(True).train()
        vocab_ids = head.vocab_ids
        vocab_info = {**vocab_info, "draft_vocab_size": int(vocab_ids.numel()),
                      "init_from": str(hc.init_from)}
    else:
        head = FeatureHead.from_target(lm, vocab_ids, style=style)
    # ---------------------------------------------------------------- 3. before
    t0 = time.perf_counter()
    before = evaluate_head(head, lm, val, skip, int(cfg.eval_k))
    times["eval_before_s"] = time.perf_counter() - t0
    log.info("before training: %s", before)
    # ---------------------------------------------------------------- 4. fit
    dm = FeatureDataModule(train, val, int(hc.batch_rows), skip, int(cfg.seed))
    steps_per_epoch = len(dm.train_dataloader())
    dm.epoch = 0
    total = steps_per_epoch * int(cfg.trainer.max_epochs)
    sub = lm.lm_head.index_select(0, vocab_ids)
    module = FeatureHeadDistiller(head, lm.embed_weight, lm.final_norm, sub, float(lm.eps),
                                  total_steps=total, **hc.loss, **hc.optim)
    callbacks: list = [TQDMProgressBar(refresh_rate=1)] if cfg.progress else []
    ckpt = ModelCheckpoint(dirpath=str(out_dir / "checkpoints"), monitor="val/loss",
                           mode="min", save_last=False, save_top_k=1)
    callbacks.append(ckpt)
    trainer = L.Trainer(**trainer_args(cfg.trainer),
                        logger=make_logger(cfg.logger, out_dir), callbacks=callbacks,
                        enable_progress_bar=bool(cfg.progress), default_root_dir=str(out_dir),
                        reload_dataloaders_every_n_epochs=1,
                        val_check_interval=float(hc.val_check_interval))
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    times["train_s"] = time.perf_counter() - t0
    if ckpt.best_model_path:
        state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)
        module.load_state_dict(state["state_dict"])
    head = module.head.cpu().eval()
    # ---------------------------------------------------------------- 5. after + save
    t0 = time.perf_counter()
    after = evaluate_head(head, lm, val, skip, int(cfg.eval_k))
    times["eval_after_s"] = time.perf_counter() - t0
    source = " + ".join(
        ([f"{local.num_seqs} local-text prompts (train_heads.local_prompts)"] if num_prompts > 0
         else [])
        + ([f"{sb.num_seqs} Spec-Bench dev questions not held out (first turn cut to "
            f"{hc.data.eval_prompt_tokens} tokens, {sb_new}-token answers)"] if sb_train else [])
        + ([f"{magpie.num_seqs} prompts the target wrote itself (train_heads.magpie)"]
           if magpie_n else [])
        + ([f"{from_files.num_seqs} prompts from {', '.join(files)}"] if files else [])
    ) + ", answered greedily by the target" + (
        f"; {samples} more answers of each Spec-Bench question drawn at temperature {temp:g}"
        if samples else "")
    result = {
        "model": info.name, "weights_fingerprint": info.weights_fingerprint,
        "head": OmegaConf.to_container(hc, resolve=True), "before": before, "after": after,
        "times_s": times, "data": {**t_train, **t_val, **t_sb, **t_drawn, **t_magpie, **t_files,
                                   "cache": str(directory),
                                   "train_sequences": train.num_seqs,
                                   "train_positions": n_train_rows,
                                   "train_local_sequences": local.num_seqs,
                                   "train_local_positions": local.num_positions,
                                   "train_specbench_sequences": sb.num_seqs,
                                   "train_specbench_positions": sb.num_positions,
                                   "train_specbench_sampled_sequences": sampled.num_seqs,
                                   "train_specbench_sampled_positions": sampled.num_positions,
                                   "specbench_sampled_chunks": [
                                       f"{sampled_chunk_name(sb_new, temp, d)}_*"
                                       for d in range(1, samples + 1)],
                                   "specbench_chunks": f"{sb_name}_*" if sb_train else None,
                                   "train_magpie_sequences": magpie.num_seqs,
                                   "train_magpie_positions": magpie.num_positions,
                                   "train_files_sequences": from_files.num_seqs,
                                   "train_files_positions": from_files.num_positions,
                                   "heldout_sequences": val.num_seqs,
                                   "heldout_positions": val.num_positions,
                                   "source": source},
        "vocab": vocab_info, "skip_prefix": skip, "train_steps": int(trainer.global_step),
        "heldout_prompt_ids": [p.prompt_id for p in held],
        "train_specbench_ids": [p.prompt_id for p in sb_train],
        "threads": torch.get_num_threads(), "curve": module.curve,
    }
    plot_curve(module.curve, out_dir / "agreement_vs_positions.png", info.name)
    extra = {k: result[k] for k in ("before", "after", "times_s", "data", "vocab",
                                     "heldout_prompt_ids", "train_specbench_ids", "train_steps")}
    path = save_feature_head(out_dir / "feature_head.safetensors", head, info, extra=extra)
    result["head_path"] = str(path)
    if fmt == "eagle":  # the same head as an EAGLE-1/2 folder (config.json + safetensors)
        result["eagle_path"] = str(save_eagle_folder(out_dir / "eagle", head, info))
    if cfg.output.install:
        dest = Path(cfg.output.install_path or default_feature_head_path(info.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        shutil.copyfile(path.with_suffix(".json"), dest.with_suffix(".json"))
        result["installed_path"] = str(dest)
        if fmt == "eagle":
            shutil.copytree(out_dir / "eagle", dest.with_name("eagle"), dirs_exist_ok=True)
            result["installed_eagle_path"] = str(dest.with_name("eagle"))
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2, default=str))
    table = (
        f"| head | agreement | KL (nats) | τ at k={cfg.eval_k} | accept by step |\n"
        "|---|---|---|---|---|\n"
        + "".join(
            f"| {name} | {r['agreement']:.3f} | {r['kl']:.3f} | {r['tau']:.2f} | "
            f"{', '.join(f'{a:.2f}' for a in r['accept_by_step'])} |\n"
            for name, r in ((f"before: {hc.init_from}" if hc.get("init_from")
                             else "untrained (target's last layer)", before), ("trained", after))
        )
    )
    (out_dir / "report.md").write_text(
        f"# Feature head for {info.name}\n\n{table}\nData: {result['data']}\n\n"
        f"Times (s): {json.dumps({k: round(v, 1) for k, v in times.items()})}\n")
    print(table)
    print("times (s):", {k: round(v, 1) for k, v in times.items()})
    return result
