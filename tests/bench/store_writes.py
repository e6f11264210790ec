"""The CPU of one recorded transition (`Store.record_step`): the store's prepared statements
against sqlite-utils' `upsert` and `insert`, side by side in one run.

    .venv/bin/python tests/bench/store_writes.py [--blocks 10] [--block 300]

Two stores on files in one temporary directory, the same transitions (a fallback machine's
CheckFailed, with its evidence), in blocks that take turns: each block's figure is the process's
CPU per transition. The baseline writes the machine row and the history row as the store wrote
them before (sqlite-utils' `Table.upsert` and `Table.insert`, each reading the table's schema
again). Prints the medians and the median of the per-block ratios. docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.store.database import Store, _PendingStep, open_store  # noqa: E402


class SqliteUtilsWrites(Store):
    """The store as it wrote a transition before: through sqlite-utils."""

    def _write(self, step: _PendingStep) -> int:
        with self.db.atomic():
            self.db.table("machines").upsert(step.machine, pk="id")
            row_id = self.db.table("transitions").insert(step.transition).last_pk
        self._unsynced = True
        assert isinstance(row_id, int)
        return row_id


def block(store: Store, count: int) -> float:
    """CPU µs per transition over `count` of them."""
    evidence = {"backend": "cuda", "reason": "gpu_missing", "evidence": {"devices": 0, "detail": "x" * 100}}
    data = {"backend": "cpu", "candidates": ["cuda", "rocm", "vulkan", "cpu"], "tried": 3}
    started = time.process_time()
    for _ in range(count):
        store.record_step(
            machine_id="fallback",
            kind="fallback",
            from_state="checking",
            event="CheckFailed",
            event_data=evidence,
            to_state="checking",
            data=data,
        )
    return (time.process_time() - started) / count * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=300, help="transitions per block")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="store-writes-") as tmp:
        now = open_store(Path(tmp) / "now.db")
        opened = open_store(Path(tmp) / "before.db")
        before = SqliteUtilsWrites(**{a.alias: getattr(opened, a.name) for a in attrs.fields(Store) if a.init})
        block(now, 50), block(before, 50)  # both files created, their pages cached
        figures: dict[str, list[float]] = {"before": [], "now": []}
        for i in range(args.blocks):
            for name, store in (("now", now), ("before", before)) if i % 2 else (("before", before), ("now", now)):
                figures[name].append(block(store, args.block))
        now.close()
        before.close()
    ratios = [a / b for a, b in zip(figures["now"], figures["before"])]
    print(f"{args.blocks} blocks of {args.block} transitions on each store, taking turns")
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):.0f} µs of CPU per transition")
    print(f"now / before, per block: median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
