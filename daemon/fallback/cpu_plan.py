"""CPU launch planning: which installed CPU bundle (variant), which model, which arguments.

The supervisor's planner is the fallback orchestrator (daemon/fallback/orchestrator.py): it tries the
preferred backend first and comes here for the CPU plan, last. After a SIGILL the previous
plan's CPU variant is known to be unsafe for this CPU, so the next plan steps down to a
safer one.
"""

from __future__ import annotations

import platform

from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.models.resolve import resolve_model
from daemon.core.paths import StokerPaths
from states.launch import LaunchPlan, MakePlan
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
    if effect.failure == ReasonCode.CPU_ILLEGAL_INSTRUCTION and effect.previous is not None:
        bad = effect.previous.variant
        # Everything at or above the variant that faulted is out.
        if bad in order:
            order = order[order.index(bad) + 1:] or ["compat"]
    return order


def plan_cpu(paths: StokerPaths, config: Config, effect: MakePlan) -> LaunchPlan:
    """A CPU plan from the installed bundles; bundle_missing when none fits."""
    from daemon.bundles.installed import find_installed

    model = resolve_model(config.server.model, paths)
    tried = []
    for variant in cpu_variant_order(config, effect):
        bundle = find_installed(paths, "cpu", variant)
        tried.append(variant)
        if bundle is not None:
            return LaunchPlan(
                backend="cpu",
                variant=bundle.meta.variant,
                bundle_root=str(bundle.root),
                server_path=str(bundle.server),
                model_path=str(model),
                host=config.server.host,
                port=config.server.port,
                ctx_size=config.server.ctx_size,
                parallel=config.server.parallel,
                n_gpu_layers=0,
                extra_args=config.server.extra_args,
            )
    raise StokerError(
        ReasonCode.BUNDLE_MISSING,
        "No CPU engine bundle is installed; run `stoker bundle build --backend cpu` then "
        "`stoker bundle install FILE` (./dev run does both).",
        {"tried_variants": tried, "bundles_dir": str(paths.bundles_dir)},
    )
