"""CPU launch planning: which installed CPU bundle (variant) runs the model.

The supervisor's planner is the fallback orchestrator (daemon/fallback/orchestrator.py): it tries the
preferred backend first and comes here for the CPU bundle, last; the plan's arguments are
completed in daemon/fallback/launch_plan.py. After a SIGILL the previous plan's CPU variant is
known to be unsafe for this CPU, so the next plan steps down to a safer one.
"""

from __future__ import annotations

import platform

from daemon.bundles.installed import InstalledBundle, find_installed
from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.core.paths import StokerPaths
from states.launch_records import MakePlan
from states.reasons import ReasonCode

# From the fastest to the safest; `native` only when the user asks for it.
CPU_VARIANTS_BY_SAFETY = ("avx2", "compat")


def cpu_variant_order(config: Config, effect: MakePlan) -> list[str]:
    """The CPU variants to try, best first, without those a SIGILL has ruled out."""
    wanted = config.backend.cpu_variant
    if wanted != "auto":
        order = [wanted] + [v for v in CPU_VARIANTS_BY_SAFETY if v != wanted]
    elif platform.machine().lower() in ("x86_64", "amd64"):
        order = list(CPU_VARIANTS_BY_SAFETY)
    else:
        order = ["compat", "avx2"]
    failure = effect.failure
    if failure is not None and failure.reason == ReasonCode.CPU_ILLEGAL_INSTRUCTION and effect.previous is not None:
        bad = effect.previous.variant
        # Everything at or above the variant that faulted is out.
        if bad in order:
            order = order[order.index(bad) + 1 :] or ["compat"]
    return order


def cpu_bundle(paths: StokerPaths, config: Config, effect: MakePlan) -> InstalledBundle:
    """The installed CPU bundle to run, the best variant first; bundle_missing when none fits."""
    tried = []
    for variant in cpu_variant_order(config, effect):
        bundle = find_installed(paths, "cpu", variant)
        tried.append(variant)
        if bundle is not None:
            return bundle
    raise StokerError(
        ReasonCode.BUNDLE_MISSING,
        "No CPU engine bundle is installed; run `stoker bundle build --backend cpu` then "
        "`stoker bundle install FILE` (./dev run does both).",
        {"tried_variants": tried, "bundles_dir": str(paths.bundles_dir)},
    )
