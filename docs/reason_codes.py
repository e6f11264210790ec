"""Write docs/reason-codes.md from states/reasons.py: `python docs/reason_codes.py [--check]`."""

from __future__ import annotations

import sys
from pathlib import Path

from stoker.states.reasons import MESSAGES, ReasonCode

PAGE = Path(__file__).resolve().parent / "reason-codes.md"

GROUPS = (
    ("GPU backends", ("binary_missing_", "gpu_missing", "cuda_", "rocm_", "vulkan_", "metal_", "gpu_claimed")),
    ("Engine bundles", ("bundle_", "source_", "cpu_bundle", "cpu_illegal", "manifest_")),
    ("The server process", ("model_", "out_of_memory", "port_in_use", "server_", "crash_loop")),
)


def group_of(code: ReasonCode) -> str:
    for title, prefixes in GROUPS:
        if code.value.startswith(prefixes):
            return title
    return "The daemon, its config, store and socket"


def document() -> str:
    lines = [
        "# Reason codes",
        "",
        "Every failure and every fallback carries one of these stable strings, stored in SQLite",
        "with its evidence (`stoker history`), shown by `stoker status` and returned in `--json`",
        "output and socket error replies. Generated from `states/reasons.py` by",
        "`python docs/reason_codes.py`; never edit by hand.",
        "",
        "These are Stoker's own codes. A backend plugin brings its own (`fakegpu_startup_failed`...)",
        "with the sentence for each; they are stored and shown the same way and documented by the",
        'plugin ([backends.md](backends.md), "A plugin\'s own reason codes").',
        "",
    ]
    titles = [t for t, _ in GROUPS] + ["The daemon, its config, store and socket"]
    for title in titles:
        codes = [c for c in ReasonCode if group_of(c) == title]
        if not codes:
            continue
        lines += [f"## {title}", "", "| code | what it means, what to do |", "|---|---|"]
        lines += [f"| `{c.value}` | {MESSAGES[c]} |" for c in codes]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from page_check import write_or_check  # docs/ is sys.path[0] when run as a script

    return write_or_check(PAGE, document(), argv, "docs/reason_codes.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
