"""`stoker bundle build|inspect|verify|list|install|keygen|publish`: engine bundles from the command line.

Build, inspect, verify and list work without the daemon, in the data and cache directories;
keygen and publish make a signed static mirror (daemon/bundles/mirror.py, docs/mirror.md).
Install goes through the install service like every install: the running daemon's, else this
process's (daemon.cli.install.install_file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode


def _progress(line: str) -> None:
    # Progress goes to stderr so that --json's stdout stays one document.
    click.echo(f"  {line}", err=True)


def _human_build(data: dict[str, Any]) -> str:
    how = "cached, nothing compiled" if data["cached"] else f"built in {data['seconds']} s"
    return (
        f"{data['backend']}-{data['variant']} {data['version']} ({how})\n"
        f"  zip:    {data['zip']}\n  sha256: {data['sha256']}\n  size:   {data['size']}\n"
        f"  key:    {data['cache_key']}\n  log:    {data['log']}"
    )


def _human_meta(data: dict[str, Any]) -> str:
    lines = [
        f"{data['backend']}-{data['variant']} {data['version']} for {data['platform']}",
        f"  llama.cpp {data['llama'].get('version')} build {data['llama'].get('build_number')} "
        f"commit {data['llama'].get('commit')}",
        f"  source: {data['source'].get('spec')}",
        f"  compiler: {data['build'].get('compiler')}; toolkit: {data['build'].get('toolkit')}",
        f"  cpu requires: {', '.join(data['cpu_requires']) or '(baseline)'}",
        f"  system libs: {', '.join(data['required_system_libs'])}",
    ]
    if data["cuda_archs"]:
        lines.append(f"  cuda archs: {';'.join(data['cuda_archs'])}; min driver {data['min_driver']}")
    smoke = data.get("smoke") or {}
    lines.append(f"  smoke reference: {len(smoke.get('tokens') or []) or 'none'} tokens")
    lines.append(f"  files ({len(data['files'])}):")
    lines += [f"    {f['mode']:o} {f['size']:>10} {f['sha256'][:16]} {f['path']}" for f in data["files"]]
    return "\n".join(lines)


def _human_verify(data: dict[str, Any]) -> str:
    lines = [f"OK {data['backend']}-{data['variant']} {data['version']}: {', '.join(data['steps'])} passed"]
    if data.get("version_line"):
        lines.append(f"  {data['version_line']}")
    lines += [f"  device: {d.strip()}" for d in data.get("devices", [])]
    if data.get("smoke_tokens") is not None:
        lines.append(f"  smoke tokens: {data['smoke_tokens']}")
    return "\n".join(lines)


def _human_list(data: dict[str, Any]) -> str:
    lines = ["installed:"]
    lines += [f"  {b['backend']}-{b['variant']} {b['version']}  {b['root']}" for b in data["installed"]] or ["  (none)"]
    lines.append("build cache:")
    lines += [
        f"  {c['backend']}-{c['variant']} {c['version']}  {c['cache_key']}  {c['zip']}" for c in data["cache"]
    ] or ["  (empty)"]
    return "\n".join(lines)


@click.group("bundle")
def bundle_group() -> None:
    """Build, inspect, verify, list, install and publish engine bundles."""


@bundle_group.command("build")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "vulkan"]), default="cpu", show_default=True)
@click.option("--variant", help="CPU variant: avx2, compat or native (default: the safe one for this CPU).")
@click.option("--source", "source_text", help="pypi:NAME==VER[#sha256=..], URL#sha256=.., or a directory.")
@click.option(
    "--cuda-archs",
    help="CUDA architectures (90-real, 75-virtual;86-real) or a family: turing-ampere, ada-hopper, blackwell, all (default all).",
)
@click.option("--jobs", "-j", type=int, help="Parallel compile jobs (default: all cores).")
@json_option
def build_cmd(
    backend: str, variant: str | None, source_text: str | None, cuda_archs: str | None, jobs: int | None, as_json: bool
) -> None:
    """Build llama-server into a bundle zip, or return the cached one for the same inputs."""
    from stoker.daemon.bundles.build import build_bundle
    from stoker.daemon.bundles.source import SourceSpec
    from stoker.daemon.bundles.variants import parse_cuda_archs

    with reported(as_json):
        if cuda_archs and backend != "cuda":
            raise StokerError(ReasonCode.BUNDLE_BUILD_FAILED, "--cuda-archs applies only to --backend cuda.")
        result = build_bundle(
            StokerPaths.from_env(),
            backend=backend,
            variant=variant,
            source=SourceSpec.parse(source_text),
            cuda_archs=parse_cuda_archs(cuda_archs) if backend == "cuda" else None,
            jobs=jobs,
            progress=_progress,
        )
    emit(as_json, result.to_dict(), _human_build)


@bundle_group.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def inspect_cmd(path: Path, as_json: bool) -> None:
    """Show a bundle's metadata (zip or directory) without running or unpacking it."""
    from stoker.daemon.bundles.installed import bundle_meta_of

    with reported(as_json):
        meta = bundle_meta_of(path)
    emit(as_json, meta.to_dict(), _human_meta)


@bundle_group.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--expect-backend")
@click.option("--expect-version")
@click.option("--expect-variant")
@click.option("--smoke", is_flag=True, help="Also run a greedy generation and compare it with the reference.")
@json_option
def verify_cmd(
    path: Path,
    expect_backend: str | None,
    expect_version: str | None,
    expect_variant: str | None,
    smoke: bool,
    as_json: bool,
) -> None:
    """Check digests, metadata, --version, --list-devices and optionally the smoke tokens."""
    from stoker.daemon.bundles.verify import verify_bundle

    with reported(as_json):
        report = verify_bundle(
            path,
            expect_backend=expect_backend,
            expect_version=expect_version,
            expect_variant=expect_variant,
            smoke=smoke,
            progress=_progress,
        )
    emit(as_json, report.to_dict(), _human_verify)


@bundle_group.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List installed bundles and the build cache."""
    from stoker.daemon.bundles.build import cached_builds
    from stoker.daemon.bundles.installed import list_installed

    paths = StokerPaths.from_env()
    data = {
        "installed": [b.to_dict() for b in list_installed(paths)],
        "cache": [
            {
                "cache_key": c.cache_key,
                "zip": str(c.zip_path),
                "backend": c.meta.backend,
                "variant": c.meta.variant,
                "version": c.meta.version,
            }
            for c in cached_builds(paths)
        ],
    }
    emit(as_json, data, _human_list)


@bundle_group.command("install")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--smoke", is_flag=True, help="Run the smoke test before installing.")
@json_option
def install_cmd(path: Path, smoke: bool, as_json: bool) -> None:
    """Verify a bundle and install it into its slot (the previous one is kept).

    Through the running daemon's install service, else through the same service here."""
    from stoker.daemon.bundles.installed import bundle_meta_of
    from stoker.daemon.cli.install import install_file

    with reported(as_json):
        bundle_meta_of(path)  # a missing or unreadable bundle is refused before anything starts
        bundle = install_file(StokerPaths.from_env(), path, smoke=smoke, progress=_progress)
    emit(
        as_json,
        {"ok": True, **bundle},
        lambda d: f"installed {d['backend']}-{d['variant']} {d['version']} at {d['root']}",
    )


@bundle_group.command("keygen")
@click.argument("keyfile", type=click.Path(path_type=Path))
@json_option
def keygen_cmd(keyfile: Path, as_json: bool) -> None:
    """Make an ed25519 key pair for signing a mirror's manifest.

    The private key goes to KEYFILE (PKCS#8 PEM, 0600; never over an existing file), the public
    key to KEYFILE.pub and stdout, in the one-line form `[bundles] trusted_keys` takes."""
    from stoker.daemon.core.signing import generate_key

    try:
        key = generate_key(keyfile)
    except FileExistsError:
        fail(as_json, StokerError(ReasonCode.BAD_REQUEST, f"{keyfile} exists; keygen never overwrites a key.", {}))
    except OSError as err:
        fail(as_json, StokerError(ReasonCode.BAD_REQUEST, f"Cannot write {keyfile}: {err}.", {}))
    pub = keyfile.with_name(keyfile.name + ".pub")
    pub.write_text(key.public_text + "\n")
    data = {
        "private_key": str(keyfile),
        "public_key": key.public_text,
        "public_key_file": str(pub),
        "key_id": key.keyid,
    }
    emit(
        as_json,
        data,
        lambda d: (
            f"{d['public_key']}\n  key id {d['key_id']}; private key {d['private_key']} (keep it secret); "
            f'trust it with [bundles] trusted_keys = ["{d["public_key"]}"]'
        ),
    )


def _human_publish(data: dict[str, Any]) -> str:
    lines = [
        f"published {data['manifest']} version {data['version']} ({data['channel']}), expires {data['expires']}",
        f"  signed by {data['key_id']}: {data['public_key']}",
    ]
    lines += [
        f"  {e['backend']}-{e['variant']} {e['version']} {e['platform']}  {e['size']:>10}  {e['url']}"
        for e in data["entries"]
    ]
    return "\n".join(lines)


@bundle_group.command("publish")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path), help="A bundle zip (repeatable).")
@click.option("--from-cache", is_flag=True, help="Every bundle in the build cache (the newest of each kind).")
@click.option("--key", "keyfile", required=True, type=click.Path(path_type=Path), help="The private key (keygen).")
@click.option("--version", "version", type=int, help="The manifest's version (default: one past the mirror's).")
@click.option("--expires", "expires_days", type=float, default=30.0, show_default=True, help="Days until it expires.")
@click.option("--channel", help="The manifest's channel (default: the mirror's, else stable).")
@json_option
def publish_cmd(
    directory: Path,
    bundles: tuple[Path, ...],
    from_cache: bool,
    keyfile: Path,
    version: int | None,
    expires_days: float,
    channel: str | None,
    as_json: bool,
) -> None:
    """Write a static mirror in DIRECTORY: the bundle zips and a signed manifest (docs/mirror.md).

    Serve DIRECTORY with any web server; daemons point `[bundles] manifest` at its manifest.json
    and trust the key's public half. Entries already in the mirror stay; the version goes up."""
    from stoker.daemon.bundles.build import cached_builds
    from stoker.daemon.bundles.mirror import newest_cached_zips, publish_mirror
    from stoker.daemon.core.signing import SignatureError, load_private_key

    with reported(as_json):
        zips = list(bundles)
        if from_cache:
            zips += newest_cached_zips(cached_builds(StokerPaths.from_env()))
        if not zips:
            raise StokerError(ReasonCode.BUNDLE_MISSING, "Nothing to publish: give --bundle ZIP or --from-cache.", {})
        try:
            key = load_private_key(keyfile)
        except (OSError, SignatureError) as err:
            raise StokerError(ReasonCode.BAD_REQUEST, f"Cannot use the key {keyfile}: {err}.", {}) from None
        result = publish_mirror(
            directory, zips, key, version=version, expires_days=expires_days, channel=channel, progress=_progress
        )
    emit(as_json, result.to_dict(), _human_publish)


def register(cli: click.Group) -> None:
    """Add the `bundle` group to the root CLI."""
    cli.add_command(bundle_group)
