"""Where a callback writes its files: the run folder, before ``on_run_end`` names it."""

from __future__ import annotations

from pathlib import Path

from specflow.results.records import RunMeta


def run_dir(meta: RunMeta, explicit: str | Path | None = None) -> Path | None:
    """Where a callback writes before ``on_run_end`` tells it the folder.

    ``explicit`` (a callback's ``dir`` argument), else ``meta.output_dir``, else Hydra's
    run folder when running under Hydra, else ``None`` (buffer until ``on_run_end``).
    """
    if explicit:
        return Path(explicit)
    if meta.output_dir:
        return Path(meta.output_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not under Hydra
        return None
