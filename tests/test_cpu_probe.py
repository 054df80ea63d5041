"""Every x86 CPU: the CPU probe, packing and dtypes chosen from it, never a crash.

The fallback is tested on any machine two ways: by replacing ``specflow.cpu.detect.probe_cpu``
with an "AVX2-only" or an "AVX-512-BF16" CPU (the decisions), and by running a child
process under ``AVX2_ONLY_ENV`` (oneDNN, ATen and MKL capped at AVX2: an AVX-512 machine
then behaves, and probes, exactly as an AVX2-only one, so the real fallback path runs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specflow.app import check_models_fit_cpu, model_configs
from specflow.cpu import detect as cpu
from specflow.cpu.detect import AVX2_ONLY_ENV, CpuCapabilities, check_cpu_weights, resolve_dtype
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.models.native import NativeLM, packing_available
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from specflow.results.baselines import machine_description
from specflow.scheduler import generate
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.model import ModelDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import hf_greedy
from tests.test_configs import _compose

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

# An AMD EPYC (Zen 3): AVX2, no AVX-512, no native bf16 -- oneDNN runs no bf16 at all.
AVX2_ONLY = CpuCapabilities(
    model="AMD EPYC 7B13", isa="AVX2", avx2=True, avx512=False, avx512_bf16=False,
    amx_tile=False, vnni=False, onednn=True, onednn_bf16=False,
)
# A Sapphire Rapids Xeon: AVX-512-BF16 and AMX.
AVX512_BF16 = CpuCapabilities(
    model="Intel(R) Xeon(R) Platinum 8480+", isa="AVX512", avx2=True, avx512=True,
    avx512_bf16=True, amx_tile=True, vnni=True, onednn=True, onednn_bf16=True,
)
# A Cascade Lake Xeon: AVX-512 without bf16 instructions (oneDNN converts bf16 on the fly).
AVX512_NO_BF16 = dataclasses.replace(
    AVX512_BF16, model="Intel(R) Xeon(R) Gold 6248", avx512_bf16=False, amx_tile=False
)
REAL = cpu.probe_cpu()
needs_real_bf16_packing = pytest.mark.skipif(
    not REAL.can_pack(torch.bfloat16),
    reason=f"this CPU cannot pack bfloat16 for oneDNN: {REAL.why_not_pack(torch.bfloat16)}",
)


@pytest.fixture
def as_cpu(monkeypatch):
    """``as_cpu(caps)``: every decision in this process sees ``caps`` as the CPU."""

    def use(caps: CpuCapabilities) -> CpuCapabilities:
        monkeypatch.setattr(cpu, "probe_cpu", lambda: caps)
        return caps

    return use


# ---------------------------------------------------------------- the probe itself
def test_probe_reports_what_torch_sees():
    caps = cpu.probe_cpu()
    assert caps is cpu.probe_cpu()  # once per process
    assert caps.isa == torch.backends.cpu.get_cpu_capability()
    assert caps.onednn == torch.backends.mkldnn.is_available()
    assert caps.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    if caps.onednn:
        assert caps.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert caps.model and caps.model != "unknown"
    recorded = machine_description()["cpu"]
    assert recorded == {**dataclasses.asdict(caps), "native_bf16": caps.native_bf16}
    json.dumps(recorded)  # summary.json takes it as it is


@pytest.mark.parametrize(
    ("caps", "pack_fp32", "pack_bf16", "native", "auto"),
    [
        (AVX2_ONLY, True, False, False, torch.float32),
        (AVX512_NO_BF16, True, True, False, torch.float32),
        (AVX512_BF16, True, True, True, torch.bfloat16),
        # AVX-512-BF16 hardware, oneDNN capped below it: no native bf16 for oneDNN.
        (dataclasses.replace(AVX512_BF16, onednn_max_isa="AVX512_CORE"), True, True, False,
         torch.float32),
        (dataclasses.replace(AVX512_BF16, onednn=False, onednn_bf16=False), False, False,
         False, torch.float32),
    ],
    ids=["avx2", "avx512-no-bf16", "avx512-bf16-amx", "avx512-bf16-capped", "no-onednn"],
)
def test_decisions_per_cpu_kind(caps, pack_fp32, pack_bf16, native, auto):
    assert caps.can_pack(torch.float32) is pack_fp32
    assert caps.can_pack(torch.bfloat16) is pack_bf16
    assert caps.can_pack(torch.float16) is False
    assert caps.native_bf16 is native
    assert caps.auto_dtype() == auto
    assert (caps.why_not_pack(torch.bfloat16) == "") is pack_bf16


def test_why_names_the_missing_feature():
    why = AVX2_ONLY.why_not_pack(torch.bfloat16)
    assert why == (
        "oneDNN cannot run bfloat16 on this CPU (AMD EPYC 7B13, ISA AVX2): it needs AVX-512 "
        "(avx512bw, avx512vl, avx512dq) or avx_ne_convert"
    )
    assert AVX2_ONLY.describe() == (
        "AMD EPYC 7B13 (ISA AVX2; avx2; oneDNN yes, bf16 none)"
    )
    assert AVX512_BF16.describe() == (
        "Intel(R) Xeon(R) Platinum 8480+ (ISA AVX512; avx2, avx512, avx512_bf16, amx, vnni; "
        "oneDNN yes, bf16 native)"
    )


def test_auto_dtype_follows_the_probe(as_cpu):
    as_cpu(AVX2_ONLY)
    assert resolve_dtype("auto") == torch.float32
    as_cpu(AVX512_BF16)
    assert resolve_dtype("auto") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ConfigError, match="dtype='fp8' is not supported; use one of auto, "):
        resolve_dtype("fp8")


# ---------------------------------------------------------------- packing from the probe
def test_avx2_only_packs_fp32_and_runs_bf16_unpacked(as_cpu, caplog):
    as_cpu(AVX2_ONLY)
    assert packing_available(CPU, torch.float32) and not packing_available(CPU, torch.bfloat16)
    hf = tiny_hf_model("qwen2", num_layers=2).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="specflow"):
        lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-bf16"))  # packed=None
    assert not lm.packed and lm.layers[0].wqkv.dtype == torch.bfloat16
    assert [r.getMessage() for r in caplog.records if "unpacked" in r.getMessage()] == [
        "tiny-bf16: unpacked weights (" + AVX2_ONLY.why_not_pack(torch.bfloat16) + ")"
    ]
    with pytest.raises(ConfigError, match="packed_weights=true with bfloat16: oneDNN cannot "
                       r"run bfloat16 on this CPU \(AMD EPYC 7B13, ISA AVX2\)"):
        NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-bf16"), packed=True)
    fp32 = tiny_hf_model("qwen2", num_layers=2)
    packed = NativeLM.from_hf(fp32, tiny_model_info(fp32, "tiny-fp32"))
    assert packed.packed
    # Placed in bfloat16 on such a CPU the copy stays dense (packing it would crash there).
    moved = packed.to("cpu", torch.bfloat16)
    assert not moved.packed and moved.layers[0].wqkv.dtype == torch.bfloat16


@needs_real_bf16_packing
def test_avx512_bf16_packs_bf16(as_cpu):
    as_cpu(AVX512_BF16)
    hf = tiny_hf_model("qwen2", num_layers=2).to(torch.bfloat16)
    lm = NativeLM.from_hf(hf, tiny_model_info(hf, "tiny-bf16"))
    assert lm.packed and lm.layers[0].wqkv.is_mkldnn


def _sps_tokens(draft_dtype: torch.dtype, prompts: list[list[int]], max_new: int):
    """A tiny fp32 target verifying a tiny drafter loaded in ``draft_dtype`` (packing as the
    probe decides): (our tokens, HF greedy of the target, drafter packed?)."""
    target_hf = tiny_hf_model("llama", seed=3, num_layers=4)
    target = NativeLM.from_hf(target_hf, tiny_model_info(target_hf, "t"))
    draft_hf = tiny_hf_model("llama", seed=1, num_layers=2).to(draft_dtype)
    draft = NativeLM.from_hf(draft_hf, tiny_model_info(draft_hf, "d"))
    pipe = SpeculativePipeline(
        FullVerifier(target), StandardAcceptor(), drafter=ModelDrafter(draft, k=4)
    )
    ours = [generate(pipe, p, max_new).tokens for p in prompts]
    return ours, [hf_greedy(target_hf, p, max_new) for p in prompts], draft.packed


PROMPTS = [[1, 5, 9, 13, 17], [3, 4, 3, 4, 3, 4, 3]]


def test_avx2_only_sps_with_an_auto_drafter_equals_hf_greedy(as_cpu):
    as_cpu(AVX2_ONLY)
    ours, oracle, packed = _sps_tokens(resolve_dtype("auto"), PROMPTS, 20)
    assert packed  # float32, oneDNN-packed: the documented AVX2 path
    assert ours == oracle


@needs_real_bf16_packing
def test_avx512_bf16_sps_with_an_auto_drafter_equals_hf_greedy(as_cpu):
    as_cpu(AVX512_BF16)
    dtype = resolve_dtype("auto")
    assert dtype == torch.bfloat16
    ours, oracle, packed = _sps_tokens(dtype, PROMPTS, 20)
    assert packed  # bfloat16, oneDNN-packed: the documented native-bf16 path
    assert ours == oracle


# ---------------------------------------------------------------- config errors before loading
@pytest.mark.parametrize(
    ("dtype", "packed", "message"),
    [
        ("bfloat16", None, "m: drafter.model.dtype=bfloat16: oneDNN cannot run bfloat16 on "
         "this CPU (AMD EPYC 7B13, ISA AVX2): it needs AVX-512 (avx512bw, avx512vl, avx512dq) "
         "or avx_ne_convert; use drafter.model.dtype=auto (float32 here, packed"),
        ("bfloat16", True, "m: drafter.model.packed_weights=true with dtype=bfloat16: oneDNN "
         "cannot run bfloat16"),
        ("float16", True, "m: drafter.model.packed_weights=true with dtype=float16: only "
         "float32 and bfloat16 matrices are packed, not float16; set "
         "drafter.model.packed_weights=null"),
    ],
)
def test_impossible_weights_are_refused_by_name(as_cpu, dtype, packed, message):
    as_cpu(AVX2_ONLY)
    with pytest.raises(ConfigError) as err:
        check_cpu_weights("m", "drafter.model", dtype, packed)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("dtype", "packed"),
    [("bfloat16", False), ("auto", None), ("auto", True), ("float32", True), ("float16", None)],
)
def test_possible_weights_pass(as_cpu, dtype, packed):
    as_cpu(AVX2_ONLY)
    check_cpu_weights("m", "model", dtype, packed)


def test_experiments_fit_an_avx2_cpu_and_bf16_is_refused_before_loading(as_cpu, monkeypatch):
    as_cpu(AVX2_ONLY)

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the config check")

    monkeypatch.setattr("specflow.models.loading.load_model", no_loading)
    for experiment in ("sps", "pld_sps"):
        cfg = _compose([f"+experiment={experiment}"])
        paths = [path for path, _ in model_configs(cfg)]
        assert "model" in paths and any(p.startswith("drafter.") for p in paths)
        check_models_fit_cpu(cfg)  # dtype auto: fits
    cfg = _compose(["+experiment=pld_sps", "drafter.then.model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"qwen2.5-coder-0.5b: drafter.then.model.dtype="
                       r"bfloat16: oneDNN cannot run bfloat16"):
        check_models_fit_cpu(cfg)
    cfg = _compose(["+experiment=sps", "model.packed_weights=true", "model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"model.packed_weights=true with dtype=float16"):
        check_models_fit_cpu(cfg)


# ---------------------------------------------------------------- the real AVX2 path
_CHILD = """
import json, torch
from specflow.cpu import detect as cpu
from stages.acceptors.standard import StandardAcceptor
from specflow.engine import SpeculativePipeline
from specflow.models.native import NativeLM
from specflow.models.tiny import tiny_hf_model, tiny_model_info
from specflow.scheduler import generate
from stages.verifiers.full import FullVerifier
from stages.drafters.model import ModelDrafter
from tests.conftest import hf_greedy

caps = cpu.probe_cpu()
target_hf = tiny_hf_model("llama", seed=3, num_layers=4)
target = NativeLM.from_hf(target_hf, tiny_model_info(target_hf, "t"))
out = {"caps": caps.as_dict(), "target_packed": target.packed}
for dtype in ("auto", "bfloat16"):
    draft_hf = tiny_hf_model("llama", seed=1, num_layers=2).to(cpu.resolve_dtype(dtype))
    draft = NativeLM.from_hf(draft_hf, tiny_model_info(draft_hf, "d"))
    pipe = SpeculativePipeline(FullVerifier(target), StandardAcceptor(),
                               drafter=ModelDrafter(draft, k=4))
    prompts = [[1, 5, 9, 13, 17], [3, 4, 3, 4, 3, 4, 3]]
    out[dtype] = {
        "dtype": str(draft.dtype), "packed": draft.packed,
        "equal": [generate(pipe, p, 20).tokens == hf_greedy(target_hf, p, 20) for p in prompts],
    }
print(json.dumps(out))
"""


def test_a_real_avx2_process_falls_back_and_equals_hf_greedy():
    """oneDNN/ATen/MKL capped at AVX2 (a no-op on an AVX2-only CPU): the probe sees no bf16,
    auto picks float32 packed, an explicit bf16 drafter runs unpacked, tokens equal HF's."""
    env = {**os.environ, **AVX2_ONLY_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["caps"]["isa"] in ("AVX2", "DEFAULT")
    assert out["caps"]["onednn_bf16"] is False and out["caps"]["native_bf16"] is False
    assert out["target_packed"] is True
    assert out["auto"] == {"dtype": "torch.float32", "packed": True, "equal": [True, True]}
    assert out["bfloat16"] == {"dtype": "torch.bfloat16", "packed": False,
                               "equal": [True, True]}


def test_the_avx2_wrapper_sets_exactly_the_probe_caps():
    script = (ROOT / "scripts" / "as_avx2.sh").read_text()
    line = next(ln for ln in script.splitlines() if ln.startswith("exec env "))
    assigned = dict(w.split("=", 1) for w in line.split()[2:] if "=" in w)
    assert assigned == AVX2_ONLY_ENV
