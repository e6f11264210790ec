"""Engine releases made from the real CPU bundle, for the update tests: a good one (the same engine
under a new version), and broken ones built as a real but broken release would be: the real
llama-server behind a bin/llama-server wrapper script, bundle.json's files list and sha256s
regenerated so that verification accepts it, and its smoke reference recorded from the repacked
engine itself (a publisher's build host records what its build generates)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from stoker.daemon.bundles.archive import pack_bundle, unpack_bundle
from stoker.daemon.bundles.metadata import BUNDLE_JSON
from stoker.daemon.bundles.smoke import SmokeSpec, run_smoke

# Dies (SIGABRT, as an engine's assert would) when launched to serve (the daemon always passes
# --metrics), after passing --version, --list-devices and the smoke run, which never do.
CRASH_WHEN_SERVING = """#!/bin/sh
here=$(dirname "$0")
case " $* " in
  *" --metrics "*) echo "GGML_ASSERT failed: simulated broken release" >&2; kill -ABRT $$ ;;
esac
exec "$here/llama-server.real" "$@"
"""


def biased_generation(token: int) -> str:
    """Generates differently: the real engine with one token pushed out of reach by a logit bias."""
    return f"""#!/bin/sh
exec "$(dirname "$0")/llama-server.real" "$@" --logit-bias {token}-100
"""


def _file_entry(root: Path, path: Path) -> dict:
    data = path.read_bytes()
    return {
        "path": path.relative_to(root).as_posix(),
        "size": len(data),
        "mode": path.stat().st_mode & 0o777,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def repack(source: Path, dest: Path, *, version: str, wrapper: str | None = None) -> Path:
    """`source` (a bundle zip) repacked as release `version` at `dest`, its engine behind `wrapper`."""
    with tempfile.TemporaryDirectory(prefix="stoker-repack-") as scratch:
        root = unpack_bundle(Path(source), Path(scratch) / "bundle")
        meta = json.loads((root / BUNDLE_JSON).read_text())
        server = root / meta["server"]
        if wrapper is not None:
            shutil.move(server, server.with_name(server.name + ".real"))
            server.write_text(wrapper)
            server.chmod(0o755)
        meta["version"] = version
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != BUNDLE_JSON)
        meta["files"] = [_file_entry(root, p) for p in files]
        if wrapper is not None:  # the reference its publisher's build host would have recorded
            ref = meta["smoke"]
            model = {k: v for k, v in ref["model"].items() if k != "sha256"}
            spec = SmokeSpec(model=model, prompt=ref["prompt"], n_predict=ref["n_predict"])
            with tempfile.TemporaryDirectory(prefix="stoker-repack-smoke-") as smoke_dir:
                ref["tokens"] = list(run_smoke(server, spec, Path(smoke_dir)))
        (root / BUNDLE_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return pack_bundle(root, Path(dest))


def smoke_tokens(bundle_zip: Path) -> list[int]:
    """The smoke reference a bundle zip records."""
    import zipfile

    with zipfile.ZipFile(bundle_zip) as zf:
        return list(json.loads(zf.read(BUNDLE_JSON))["smoke"]["tokens"])
