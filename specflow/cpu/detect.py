"""What this CPU can do for the native models, probed once per process, and what follows.

x86 CPUs differ in what oneDNN and ATen can run on them, and a figure measured on one says
little about another:

- **AVX2 only** (Zen 2/3, Haswell..Comet Lake, most laptops and many cloud VMs): oneDNN packs
  and multiplies float32; it *cannot* run bfloat16 at all (packing a bf16 matrix raises
  "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq").
- **AVX-512 without BF16** (Skylake-SP, Cascade Lake, Ice Lake): oneDNN runs bf16 by
  converting to float32 on the fly (``onednn_bf16`` is true, ``native_bf16`` false).
- **AVX-512-BF16 / AMX** (Cooper Lake, Sapphire Rapids and later, Zen 4/5): bf16 dot products
  in hardware (``native_bf16``).

``probe_cpu()`` answers from torch itself (the ISA level ATen dispatches to, cpuinfo's
feature bits, oneDNN's own bf16 check) plus the ISA caps a user may set in the environment
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``): with
``AVX2_ONLY_ENV`` (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2``, and ``SPECFLOW_QUANT_KERNEL=avx2`` for the quantized rows
kernel) an AVX-512 machine runs, and is probed, as an AVX2-only
one; oneDNN's bf16 check then fails exactly as on a real AVX2 CPU.  Everything that
decides packing or a dtype asks ``probe_cpu()`` (tests replace it through ``monkeypatch``),
never a CPU feature directly.

The choices (measured per ISA level by ``scripts/bench_cpu_dtypes.py``; which pipeline is
fastest per CPU: docs/performance.md):

- packed weights (``model.packed_weights=null``): wherever oneDNN runs the model's dtype
  (``can_pack``); otherwise unpacked, logged once with the reason.
- ``dtype=auto``: bfloat16 where the CPU multiplies bf16 natively, else float32 (packed).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specflow.errors import ConfigError

# The ISA caps that make this process behave as an AVX2-only CPU would (oneDNN, ATen, MKL,
# the quantized rows kernel's build).
AVX2_ONLY_ENV = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "SPECFLOW_QUANT_KERNEL": "avx2",
}
# oneDNN ISA names (``ONEDNN_MAX_CPU_ISA``) below the first with bf16 dot products in hardware.
_ONEDNN_CAPS_WITHOUT_NATIVE_BF16 = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
)


@dataclass(frozen=True)
class CpuCapabilities:
    """This process's CPU as torch sees it (``probe_cpu``).

    Attributes:
        model: the CPU's model name (``/proc/cpuinfo``), e.g. ``AMD EPYC 7B13``.
        isa: the ISA level ATen dispatches to (``torch.backends.cpu.get_cpu_capability()``):
            ``DEFAULT``, ``AVX2``, ``AVX512`` (or ``VSX``/``ZVECTOR``/``SVE...`` elsewhere).
        avx2, avx512, avx512_bf16, amx_tile, vnni: cpuinfo's feature bits (the hardware).
        onednn: torch was built with oneDNN and can use it.
        onednn_bf16: oneDNN runs bfloat16 here (packs and multiplies bf16 matrices).
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) when set, else None.
    """

    model: str
    isa: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx_tile: bool
    vnni: bool
    onednn: bool
    onednn_bf16: bool
    onednn_max_isa: str | None = None

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware that oneDNN may use (AVX-512-BF16 or AMX, not capped
        below them by ``ONEDNN_MAX_CPU_ISA``)."""
        capped = (self.onednn_max_isa or "").upper() in _ONEDNN_CAPS_WITHOUT_NATIVE_BF16
        return self.onednn_bf16 and (self.avx512_bf16 or self.amx_tile) and not capped

    def can_pack(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN can pack and multiply ``dtype`` matrices on this CPU."""
        if not self.onednn:
            return False
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            return self.onednn_bf16
        return False

    def why_not_pack(self, dtype: torch.dtype) -> str:
        """Why ``can_pack(dtype)`` is false, naming the missing feature ("" when it is true)."""
        if self.can_pack(dtype):
            return ""
        if not self.onednn:
            return "this torch has no usable oneDNN (torch.backends.mkldnn.is_available() is False)"
        if dtype == torch.bfloat16:
            return (
                f"oneDNN cannot run bfloat16 on this CPU ({self.model}, ISA {self.isa}): it needs "
                "AVX-512 (avx512bw, avx512vl, avx512dq) or avx_ne_convert"
                + (f"; ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else "")
            )
        name = str(dtype).removeprefix("torch.")
        return f"only float32 and bfloat16 matrices are packed, not {name}"

    def auto_dtype(self) -> torch.dtype:
        """``dtype=auto``: bfloat16 where the CPU multiplies it natively, else float32."""
        return torch.bfloat16 if self.native_bf16 else torch.float32

    def describe(self) -> str:
        """One line: ``Intel Xeon ... (ISA AVX512; avx512_bf16, amx; oneDNN bf16 native)``."""
        bits = {"avx2": self.avx2, "avx512": self.avx512, "avx512_bf16": self.avx512_bf16,
                "amx": self.amx_tile, "vnni": self.vnni}
        feats = [name for name, on in bits.items() if on]
        bf16 = "native" if self.native_bf16 else ("emulated" if self.onednn_bf16 else "none")
        cap = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.model} (ISA {self.isa}; {', '.join(feats) or 'no SIMD flags'}; oneDNN " \
            f"{'yes' if self.onednn else 'no'}, bf16 {bf16}{cap})"

    def as_dict(self) -> dict[str, Any]:
        """The fields plus the derived ``native_bf16`` (what ``summary.json`` records)."""
        return {**asdict(self), "native_bf16": self.native_bf16}


def cpuinfo_field(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (e.g. ``model name``,
    ``flags``); ``None`` where there is no such line or file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _flag(name: str) -> bool:
    """A ``torch.cpu._is_<name>_supported()`` bit; False where this torch lacks the query."""
    query = getattr(torch.cpu, f"_is_{name}_supported", None)
    return bool(query()) if query is not None else False


def _onednn_bf16() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def probe_cpu() -> CpuCapabilities:
    """This process's CPU capabilities (probed once; ``probe_cpu.cache_clear()`` re-probes)."""
    return CpuCapabilities(
        model=_cpu_model(),
        isa=torch.backends.cpu.get_cpu_capability(),
        avx2=_flag("avx2"),
        avx512=_flag("avx512"),
        avx512_bf16=_flag("avx512_bf16"),
        amx_tile=_flag("amx_tile"),
        vnni=_flag("vnni"),
        onednn=torch.backends.mkldnn.is_available(),
        onednn_bf16=_onednn_bf16(),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
    )


# ------------------------------------------------------------------ what a model config may ask
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    """A model's ``dtype`` setting -> a torch dtype; ``auto`` asks ``probe_cpu()``
    (``CpuCapabilities.auto_dtype``: bfloat16 where the CPU multiplies it natively, else
    float32).  Models load on the CPU: on CUDA, ``runner.dtype`` sets the dtype they run in."""
    if name == "auto":
        return probe_cpu().auto_dtype()
    if name not in DTYPE_NAMES:
        raise ConfigError(
            f"dtype={name!r} is not supported; use one of auto, {', '.join(DTYPE_NAMES)}"
        )
    return DTYPE_NAMES[name]


def check_cpu_weights(model: str, setting: str, dtype: str, packed: bool | None) -> None:
    """Refuse, before any weight loads, a model config that this CPU cannot run as asked.

    ``model`` (its name) and ``setting`` (the config node: ``model``, ``drafter.model``...;
    "" for keyword arguments) name the values in the message.

    - ``packed_weights=true`` for a dtype oneDNN cannot pack here;
    - ``dtype=bfloat16`` (explicit) where oneDNN cannot run bf16 at all (AVX2-only CPUs),
      unless ``packed_weights=false`` says to run it unpacked anyway.

    ``packed_weights=null`` with another dtype never fails: the model runs unpacked and
    ``NativeLM.from_hf`` logs why.
    """
    caps = probe_cpu()
    torch_dtype = resolve_dtype(dtype)
    if packed is False or caps.can_pack(torch_dtype):
        return
    why = caps.why_not_pack(torch_dtype)
    at = f"{setting}." if setting else ""
    if packed:
        fix = f"set {at}packed_weights=null (packs where this CPU can) or false"
        if torch_dtype == torch.bfloat16:
            fix += f", or {at}dtype=auto (float32 here, packed)"
        raise ConfigError(
            f"{model}: {at}packed_weights=true with dtype={dtype}: {why}; {fix}"
        )
    if dtype == "bfloat16":
        raise ConfigError(
            f"{model}: {at}dtype=bfloat16: {why}; use {at}dtype=auto (float32 here, "
            f"packed: the faster one on such CPUs), or add "
            f"{at}packed_weights=false to run bfloat16 unpacked anyway (slower)"
        )
