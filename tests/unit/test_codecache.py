"""The CLI's cache of the code attrs and cattrs generate: a second run compiles none of the status
records' code, the records it makes behave as compiled ones, and a changed record is never
served stale code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stoker.daemon.core.codecache import CodeCache

# Makes the records of `status` and structures a reply into them, as `stoker status` does,
# under a hash seed of its own (attrs salts `__hash__` with one drawn from it).
PROBE = """
import json, sys
from pathlib import Path
import attr._make, cattrs.gen  # noqa: F401
from stoker.daemon.core import codecache
cache = codecache.install(Path(sys.argv[1]))
from stoker.daemon.control.status_records import Layers, ProbeVerdict, Status
from stoker.states.convert import structure, unstructure
layers = structure({"planned": "auto", "offloaded": 3, "total": 9, "why": None, "estimate": None, "new": 1}, Layers)
verdicts = {ProbeVerdict(True, None, 1), ProbeVerdict(True, None, 1), ProbeVerdict(False, "x", 2)}
try:
    structure({"state": "ready"}, Status)
    missing = ""
except ValueError as err:
    missing = str(err)
print(json.dumps({"hits": cache.hits, "misses": cache.misses, "layers": unstructure(layers), "repr": repr(layers),
                  "equal": layers == Layers("auto", 3, 9, None, None), "verdicts": len(verdicts), "missing": missing}))
"""


def probe(cache_dir: Path, seed: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_second_run_compiles_none_of_the_records_code_and_its_records_behave_alike(tmp_path):
    first = probe(tmp_path / "code", "1")
    second = probe(tmp_path / "code", "2")  # another hash seed: attrs' salts differ
    assert first["misses"] > 20  # every record's methods and structure function
    assert second["misses"] == 0 and second["hits"] == first["misses"] + first["hits"]
    for run in (first, second):
        assert run["layers"] == {"planned": "auto", "offloaded": 3, "total": 9, "why": None, "estimate": None}
        assert run["repr"] == "Layers(planned='auto', offloaded=3, total=9, why=None, estimate=None)"
        assert run["equal"] and run["verdicts"] == 2
        assert "$.name" in run["missing"]  # the version skew's words are cattrs' own, cached or not


def test_changed_source_is_compiled_anew_not_served_from_the_cache(tmp_path):
    cache = CodeCache(tmp_path)
    namespace: dict = {}
    exec(cache.compile("def f():\n    return 1\n", "<generated f>", "exec"), namespace)
    exec(cache.compile("def f():\n    return 2\n", "<generated f>", "exec"), namespace)
    assert namespace["f"]() == 2 and cache.misses == 2
    exec(CodeCache(tmp_path).compile("def f():\n    return 1\n", "<generated f>", "exec"), namespace)
    assert namespace["f"]() == 1


def test_a_cache_that_cannot_be_written_or_read_still_compiles(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cache = CodeCache(blocked / "code")
    namespace: dict = {}
    for _ in range(2):
        exec(cache.compile("x = 40 + 2\n", "<generated x>", "exec"), namespace)
    assert namespace["x"] == 42 and cache.hits == 0
    (tmp_path / "code").mkdir()
    garbage = CodeCache(tmp_path / "code")
    exec(garbage.compile("y = 1\n", "<generated y>", "exec"), namespace)
    for path in (tmp_path / "code").iterdir():
        path.write_bytes(b"\x00garbage")
    exec(garbage.compile("y = 1\n", "<generated y>", "exec"), namespace)
    assert namespace["y"] == 1 and garbage.misses == 2


def test_a_directory_others_may_write_in_is_not_used(tmp_path):
    """Code read from the cache runs: a directory another user could write in is left alone."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    cache = CodeCache(shared)
    namespace: dict = {}
    exec(cache.compile("z = 3\n", "<generated z>", "exec"), namespace)
    assert namespace["z"] == 3 and list(shared.iterdir()) == []
