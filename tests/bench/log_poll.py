"""What one poll of a busy engine's log costs the daemon's thread, its lines read whole against
only its tail (what a serving engine's poll does), side by side in one run.

    .venv/bin/python tests/bench/log_poll.py [--requests 25] [--rounds 200]

An engine at `-lv 4` with 64 slots writes ~150 lines per request; `--requests` requests' worth
of them (a recorded request's lines) arrive between two polls (250 ms apart while serving).
Arm "whole": the lines read as a loading engine's are (decoded, split, every fact's words looked
for); arm "tail": as a serving engine's are (only the last LOG_TAIL_BYTES decoded). The arms
take turns on fresh files; the figure is the median per poll and the ratio whole / tail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.engine.ready import ServerLog  # noqa: E402

# One request's lines as llama-server b11434 writes them at -lv 4 (one slot shown; the
# "checking sim" line repeats for each of the 64 slots).
REQUEST = """8.03.154.199 I srv  server_strea: conv_id= (empty=1)
8.03.154.299 I srv    operator(): chat format: peg-native
8.03.154.427 I slot get_availabl: id  0 | task -1 |  - checking sim = 1.000 (53/53) > 0.100
8.03.154.432 I slot get_availabl: id  0 | task -1 | selected slot by LCP similarity, f_sim_best = 1.000 (> 0.100 thold), f_keep = 0.946
8.03.154.484 I slot launch_slot_: id  0 | task -1 | sampler chain: logits -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p
8.03.154.492 I slot launch_slot_: id  0 | task -1 | sampler params:
\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000
\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, dry_penalty_last_n = 64
\ttop_k = 40, top_p = 0.950, min_p = 0.050, xtc_probability = 0.000, xtc_threshold = 0.100, typical_p = 1.000, top_n_sigma = -1.000, temp = 0.800
\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000, adaptive_target = -1.000, adaptive_decay = 0.900
8.03.154.494 I slot launch_slot_: id  0 | task 186 | processing task, is_child = 0
8.03.154.499 I slot   operator(): id  0 | task 186 | new prompt, n_ctx_slot = 256, n_keep = 0, task.n_tokens = 53
8.03.154.504 I slot   operator(): id  0 | task 186 | cached n_tokens = 52, memory_seq_rm [52, end)
8.03.154.524 I slot init_sampler: id  0 | task 186 | init sampler, took 0.01 ms, tokens: text = 53, total = 53
8.03.167.023 I slot print_timing: id  0 | task 186 | prompt eval time =      11.37 ms /     1 tokens (   11.37 ms per token,    87.97 tokens per second)
8.03.167.070 I slot print_timing: id  0 | task 186 |        eval time =       1.15 ms /     4 tokens (    0.38 ms per token,  2620.09 tokens per second)
8.03.167.088 I slot print_timing: id  0 | task 186 |       total time =      12.51 ms /     5 tokens
8.03.167.274 I slot      release: id  0 | task 186 | stop processing: n_tokens = 56, truncated = 0
8.03.167.321 I srv  update_slots: all slots are idle
"""


def request_lines(slots: int) -> bytes:
    lines = []
    for line in REQUEST.splitlines():
        lines.append(line)
        if "checking sim" in line:
            lines += [line] * (slots - 1)
    return ("\n".join(lines) + "\n").encode()


async def one_poll(path: Path, chunk: bytes, serving: bool) -> float:
    path.write_bytes(b"")
    log = ServerLog(path, 0)
    if serving:
        log.listening = ("127.0.0.1", 8080)
    with open(path, "ab") as f:
        f.write(chunk)
    started = time.perf_counter()
    log.poll()
    return time.perf_counter() - started


async def run(requests: int, rounds: int) -> dict[str, list[float]]:
    chunk = request_lines(64) * requests
    times: dict[str, list[float]] = {"whole": [], "tail": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "server.log"
        for i in range(rounds):
            arms = ("whole", "tail") if i % 2 == 0 else ("tail", "whole")
            for arm in arms:
                times[arm].append(await one_poll(path, chunk, serving=arm == "tail"))
    lines = chunk.count(b"\n")
    print(f"{len(chunk) / 1024:.0f} KiB, {lines} lines per poll, {rounds} rounds")
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    times = trio.run(run, args.requests, args.rounds)
    whole, tail = (statistics.median(times[k]) * 1000 for k in ("whole", "tail"))
    print(
        f"whole: median {whole:.3f} ms per poll; tail: median {tail:.3f} ms per poll; whole / tail {whole / tail:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
