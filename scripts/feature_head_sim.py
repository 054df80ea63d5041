"""What a feature head would give as a chain, a confidence-stopped chain or a small tree.

    python scripts/feature_head_sim.py \
        --head outputs/train_heads/feature_sb_s3_ft5/feature_head.safetensors \
        --beta 0.02 --draft-cost 0.075

Replays greedy speculative decoding along the held-out answers that ``train_heads`` cached
for the head (``heldout_*.safetensors`` in the head's feature-data folder: the target's own
greedy answers, so the target's token at every position is known), through the inference
path (``FeatureDraftModel``: the head's own KV cache, its own predicted features after the
first step).  For every start position ``n`` of an answer (the target has committed
``t_0 .. t_{n-1}``) it drafts once and records how many draft tokens the target would accept
under each drafting rule; then, per rule, it walks each answer round by round (a round
starting at ``n`` commits ``a_n + 1`` tokens) and counts rounds.

Rules (``K`` = ``--max-k``):
- ``chain k``: the head's top-1 token, ``k`` times (k = 1..K);
- ``conf θ``: the top-1 chain up to K tokens, stopped after the first token whose
  probability is below θ (that token still drafted: EAGLE-2's confidence);
- ``tree m x d``: the head's top-``m`` tokens at the first step, each followed by a top-1
  chain to depth ``d`` (``m * d`` draft tokens, verified in one pass with a tree mask; the
  drafting costs ``d`` head steps of ``m`` rows).  The target accepts along the branch whose
  first token is its own; only that branch is replayed.

A round's cost, in plain decoding steps: ``1 + beta * drafted + draft_cost * steps``
(verification of ``drafted + 1`` tokens, ``beta`` the marginal cost of a verified token,
measured with ``scripts/profile_step.py``; ``steps`` head steps at ``draft_cost`` of a
target step each).  The predicted speedup ``τ / cost`` leaves out prefill and overheads:
use it to rank rules, not as a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specflow.kv.contiguous import KVCache  # noqa: E402
from specflow.models.feature_head import FeatureDraftModel, load_feature_head  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402
from train_heads.feature_data import FeatureSequences  # noqa: E402


@dataclass
class StartOutcome:
    """What the target accepts of one draft started at position ``n``."""

    chain: int  # leading top-1 chain tokens accepted (of max_k)
    conf: list[float]  # the head's top-1 probability of each chain token  [max_k]
    tree: dict[tuple[int, int], int] = field(default_factory=dict)  # (m, d) -> accepted


@torch.inference_mode()
def replay(dm: FeatureDraftModel, data: FeatureSequences, max_k: int,
           trees: list[tuple[int, int]]) -> list[list[StartOutcome]]:
    """Per held-out answer, per start position ``n`` in ``[plen, L)``: a ``StartOutcome``."""
    out: list[list[StartOutcome]] = []
    widest = max((m for m, _ in trees), default=1)
    for i in range(data.num_seqs):
        tok_t, feats, plen = data.seq(i)
        tok = tok_t.tolist()
        kv = KVCache(dm.kv, len(tok) + max_k + 2)
        seq: list[StartOutcome] = []
        for n in range(plen, len(tok)):
            start, end = kv.length, n - 1
            rows = feats[start:end].to(dm.target.dtype)
            first = dm.step(rows, torch.tensor(tok[start + 1 : end + 1]),
                            [(kv, end - start)])[-1:]  # [1, H]: predicts t_n
            probs = dm.logits(first).float().softmax(-1)[0]  # [S]
            top_p, top_i = probs.topk(widest)
            top = [int(dm.ids[j]) for j in top_i]
            # the top-1 chain
            pred, p = first, probs
            accepted, conf, alive = 0, [], True
            for j in range(max_k):
                d = int(dm.ids[int(p.argmax())])
                conf.append(float(p.max()))
                alive = alive and n + j < len(tok) and d == tok[n + j]
                accepted += int(alive)
                if j + 1 < max_k:
                    pred = dm.step(pred, torch.tensor([d]), [(kv, 1)])
                    p = dm.logits(pred).float().softmax(-1)[0]
            kv.truncate(n - 1)
            outcome = StartOutcome(chain=accepted, conf=conf)
            for m, depth in trees:
                if accepted > 0:  # the target's token is the top-1: the chain's branch
                    outcome.tree[(m, depth)] = min(accepted, depth)
                elif tok[n] in top[1:m]:  # another branch: replay it
                    pred, a = first, 1
                    pred = dm.step(pred, torch.tensor([tok[n]]), [(kv, 1)])
                    for j in range(1, depth):
                        d = int(dm.ids[int(dm.logits(pred).argmax(-1))])
                        if n + j >= len(tok) or d != tok[n + j]:
                            break
                        a += 1
                        if j + 1 < depth:
                            pred = dm.step(pred, torch.tensor([d]), [(kv, 1)])
                    kv.truncate(n - 1)
                    outcome.tree[(m, depth)] = a
                else:
                    outcome.tree[(m, depth)] = 0
            seq.append(outcome)
        out.append(seq)
    return out


def walk(outcomes: list[list[StartOutcome]], plens: list[int],
         rule) -> tuple[float, float, float]:
    """``(τ, drafted per round, head steps per round)`` of a rule: ``rule(outcome) ->
    (accepted, drafted, steps)``, walked round by round along each answer."""
    rounds = committed = drafted = steps = 0
    for seq, plen in zip(outcomes, plens, strict=True):
        n = plen
        end = plen + len(seq)
        while n < end:
            a, k, s = rule(seq[n - plen])
            a = min(a, end - n - 1)
            rounds += 1
            committed += a + 1
            drafted += k
            steps += s
            n += a + 1
    return committed / rounds, drafted / rounds, steps / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="a feature_head.safetensors")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--data", default=None,
                    help="the held-out chunk (default: the head's data cache, heldout_0)")
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--trees", nargs="*", default=["2x2", "3x2", "4x2", "3x3", "4x3"],
                    help="m x d: top-m first tokens, each a top-1 chain to depth d")
    ap.add_argument("--beta", type=float, default=0.02,
                    help="marginal cost of a verified token, in target steps")
    ap.add_argument("--draft-cost", type=float, default=0.075,
                    help="one head step, in target steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32", backend="native", trust_remote_code=False,
                        packed_weights=None)
    head = load_feature_head(args.head, loaded.info)
    meta = json.loads(Path(args.head).with_suffix(".json").read_text())
    cached = Path(meta["extra"]["data"]["cache"]) / "heldout_0.safetensors"
    data_path = Path(args.data) if args.data else cached
    data = FeatureSequences.load(data_path)
    dm = FeatureDraftModel(head, loaded.lm)
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees]
    outcomes = replay(dm, data, args.max_k, trees)
    plens = [data.seq(i)[2] for i in range(data.num_seqs)]
    starts = sum(len(s) for s in outcomes)

    def cost(drafted: float, steps: float) -> float:
        return 1.0 + args.beta * drafted + args.draft_cost * steps

    rows = []

    def add(name: str, rule) -> None:
        tau, k, s = walk(outcomes, plens, rule)
        rows.append({"rule": name, "tau": tau, "drafted": k, "head_steps": s,
                     "cost": cost(k, s), "speedup": tau / cost(k, s)})

    for k in range(1, args.max_k + 1):
        add(f"chain {k}", lambda o, k=k: (min(o.chain, k), k, k))
    for th in args.thresholds:
        def conf_rule(o: StartOutcome, th: float = th) -> tuple[int, int, int]:
            k = next((j + 1 for j, c in enumerate(o.conf) if c < th), len(o.conf))
            return min(o.chain, k), k, k
        add(f"conf {th:g} (k <= {args.max_k})", conf_rule)
    for m, d in trees:
        add(f"tree {m}x{d}", lambda o, m=m, d=d: (o.tree[(m, d)], m * d, d))
    top1 = sum(o.chain > 0 for s in outcomes for o in s) / starts
    print(f"{args.head}: {data.num_seqs} held-out answers, {starts} start positions, "
          f"first-token acceptance {top1:.3f}; beta {args.beta}, draft cost {args.draft_cost}")
    print("| rule | τ | drafted / round | head steps / round | cost (steps) | τ / cost |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['tau']:.3f} | {r['drafted']:.2f} | {r['head_steps']:.2f} | "
              f"{r['cost']:.3f} | {r['speedup']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"head": args.head, "beta": args.beta,
                                              "draft_cost": args.draft_cost,
                                              "starts": starts, "first_token": top1,
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
