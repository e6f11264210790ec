"""CPU launch planning: the installed CPU bundle (variant) that runs the model.

The supervisor's planner is the fallback orchestrator (daemon/fallback/orchestrator.py): it tries the
preferred backend first and comes here for the CPU bundle, last; the plan's arguments are
completed in daemon/fallback/launch_plan.py. Which builds may run, best first, is the fallback
table's decision (states/fallback/table.py, `cpu_variant_order`: after a SIGILL it steps down to a
safer one); this module finds the first of them installed.
"""

from __future__ import annotations

from typing import Any

from stoker.daemon.bundles.installed import InstalledBundle, find_installed
from stoker.daemon.core.paths import StokerPaths


def cpu_bundle(paths: StokerPaths, variants: tuple[str, ...]) -> InstalledBundle | None:
    """The first of `variants` installed; None when none is."""
    for variant in variants:
        bundle = find_installed(paths, "cpu", variant)
        if bundle is not None:
            return bundle
    return None


def missing_cpu_bundle(paths: StokerPaths, variants: tuple[str, ...]) -> dict[str, Any]:
    """What a CPU check that found none of `variants` installed says, and where it looked."""
    return {
        "message": "No CPU engine bundle is installed; run `stoker bundle build --backend cpu` then "
        "`stoker bundle install FILE` (./dev run does both).",
        "tried_variants": list(variants),
        "bundles_dir": str(paths.bundles_dir),
    }
