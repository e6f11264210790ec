"""GPU stages for engine bundles: the Vulkan bundle on NVIDIA's Vulkan driver.

Called from tests/gpu/verify_gpu.py (`verify --only vulkan`). The Vulkan build needs Debian's
headers, glslc and SPIR-V headers, and the engine needs the Vulkan loader: the machine has
neither, so .gpu/debs carries them (libvulkan1, libvulkan-dev, glslc, libshaderc1,
spirv-headers, vulkan-tools and its X11/Wayland client libraries, libglvnd0 and the GL/EGL
dispatch packages), and Debian 13's newer Vulkan headers travel as
.gpu/vulkan-headers-1.4.309.tar.xz. `vulkan_env()` unpacks them under WORK/vk and returns the
environment the builder needs; `install_vulkan_runtime()` then puts the loader, libglvnd and
vulkaninfo on the machine, as a user's `apt install libvulkan1 vulkan-tools` would, so that
the daemon and in-process verification find the GPU with no special environment.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
ICD_CANDIDATES = (
    "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/vulkan/icd.d/nvidia_icd.json",
    "/etc/vulkan/icd.d/nvidia_icd.json",
)


def install_vulkan_runtime(usr: Path) -> None:
    """What a user with a Vulkan GPU has installed (`apt install libvulkan1 vulkan-tools`), put
    on the machine itself (as root, once): the Khronos loader and vulkaninfo (the vulkan plugin's
    detection runs it) from the carried packages, and libglvnd, which NVIDIA's ICD
    (libGLX_nvidia.so.0) needs to hand out vkCreateInstance ("Found no drivers!" without it)."""
    if os.geteuid() != 0 or Path("/usr/local/bin/vulkaninfo").exists():
        return
    lib = usr / "lib" / "x86_64-linux-gnu"
    target = Path("/usr/lib/x86_64-linux-gnu")
    for so in sorted(lib.glob("lib*.so*")):  # never over the machine's own libraries
        if so.name.startswith(("libvulkan", "libGL", "libEGL", "libOpenGL", "libGLX", "libGLdispatch", "libGLES")):
            if not (target / so.name).exists():
                subprocess.run(["cp", "-a", str(so), str(target)], check=True)
    if (usr / "bin" / "vulkaninfo").exists():
        subprocess.run(["cp", str(usr / "bin" / "vulkaninfo"), "/usr/local/bin/vulkaninfo"], check=True)
    subprocess.run(["ldconfig"], check=True)


def vulkan_env(work: Path, carry: Path) -> dict[str, str]:
    """Unpack the carried Debian packages under WORK/vk; the env for building and running."""
    prefix = work / "vk"
    usr = prefix / "usr"
    if not (usr / "bin" / "glslc").exists():
        for deb in sorted((carry / "debs").glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(prefix)], check=True)
        lib = usr / "lib" / "x86_64-linux-gnu"
        # FindVulkan looks in $VULKAN_SDK/lib; Debian keeps the loader under lib/<triplet>.
        for name in ("libvulkan.so", "libvulkan.so.1"):
            if (lib / name).exists() and not (usr / "lib" / name).exists():
                (usr / "lib" / name).symlink_to(lib / name)
    # Debian 12's headers (1.3.239) are older than the pinned engine needs (VK_EXT_layer_settings):
    # Debian 13's (1.4.309, what ./dev fetches) travel as a tarball; the builder takes them
    # through STOKER_VULKAN_HEADERS, the carried loader stays.
    headers = work / "vk-headers" / "1.4.309"
    tarball = carry / "vulkan-headers-1.4.309.tar.xz"
    if tarball.is_file() and not (headers / "vulkan" / "vulkan_core.h").exists():
        headers.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(headers.parent), "-xJf", str(tarball)], check=True)
    # Those headers replace the include directory: the SPIR-V headers (spirv-headers) go beside them.
    if (headers / "vulkan").is_dir() and not (headers / "spirv").exists() and (usr / "include" / "spirv").is_dir():
        (headers / "spirv").symlink_to(usr / "include" / "spirv")
    install_vulkan_runtime(usr)
    env = {
        "VULKAN_SDK": str(usr),
        "CMAKE_PREFIX_PATH": str(usr),
        "PATH": f"{usr / 'bin'}:{os.environ.get('PATH', os.defpath)}",
        # glslc needs libshaderc; the engine needs the loader (libvulkan.so.1).
        "LD_LIBRARY_PATH": str(usr / "lib" / "x86_64-linux-gnu"),
    }
    if (headers / "vulkan" / "vulkan_core.h").exists():
        env["STOKER_VULKAN_HEADERS"] = str(headers)
    icd = next((p for p in ICD_CANDIDATES if Path(p).is_file()), None)
    if icd is None:
        found = glob.glob("/usr/**/nvidia_icd*.json", recursive=True)
        icd = found[0] if found else None
    if icd:
        env["VK_DRIVER_FILES"] = icd
        env["VK_ICD_FILENAMES"] = icd
    return env


def st_vulkan(
    homes: Any,
    model: Path,
    *,
    work: Path,
    carry: Path,
    stoker: Callable[..., tuple[int, Any, str]],
    base_env: Callable[..., dict[str, str]],
    scenario: Any,
    config_text: Callable[..., str],
    nvml: Callable[[int | None], dict[str, Any]],
    grep: Callable[..., list[str]],
) -> dict[str, Any]:
    """Build the Vulkan bundle here, verify it on the H200 through NVIDIA's Vulkan driver, then
    serve the tiny model with `prefer = "vulkan"`: tokens vs the CPU's, layers offloaded, NVML."""
    from stoker.daemon.bundles.installed import install_bundle
    from stoker.daemon.core.paths import StokerPaths

    ev: dict[str, Any] = {}
    vk = vulkan_env(work, carry)
    ev["vulkan_env"] = {k: v for k, v in vk.items() if k != "PATH"}
    env = base_env(STOKER_CACHE_DIR=str(work / "cache-vulkan"), STOKER_HOME=str(work / "home-build-vulkan"), **vk)
    started = time.monotonic()
    rc, doc, err = stoker("bundle", "build", "--backend", "vulkan", "--json", env=env, timeout=560)
    ev["build"] = {"rc": rc, "wall_s": round(time.monotonic() - started, 1), "doc": doc, "stderr_tail": err[-1500:]}
    if rc != 0 or not isinstance(doc, dict) or not doc.get("zip"):
        return {"status": "FAIL", "checks": {"vulkan bundle built": False}, **ev}
    zip_path = Path(doc["zip"])
    rc, verify, err = stoker(
        "bundle", "verify", str(zip_path), "--expect-backend", "vulkan", "--smoke", "--json", env=env, timeout=300
    )
    ev["verify"] = {"rc": rc, "doc": verify, "stderr_tail": err[-1500:]}
    tokens = (verify or {}).get("smoke_tokens") if isinstance(verify, dict) else None
    cpu_ref = list(homes.cpu.meta.smoke.tokens or []) if homes.cpu.meta.smoke else []
    devices = (verify or {}).get("devices") or [] if isinstance(verify, dict) else []

    # Serve through the daemon: a home with the CPU and the Vulkan bundles, vulkan preferred.
    home = homes.fresh("vulkan", cpu=True, cuda=False)
    install_bundle(zip_path, StokerPaths.from_env({"STOKER_HOME": str(home)}), expect_backend="vulkan")
    sc = scenario("vulkan", home, env={k: v for k, v in vk.items() if k != "PATH"})
    sc.write_config(config_text(model, prefer="vulkan"))
    status: dict[str, Any] = {}
    try:
        status = sc.run(timeout=300)
        ev["offload_lines"] = grep(sc.server_log(), "offloaded", "Vulkan0", "using device")
        ev["nvml"] = nvml(status.get("pid"))
        ev["status_human"] = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "status"],
            env=sc.daemon.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        sc.finish()
    ev.update(sc.evidence)
    layers = status.get("layers") or {}
    checks = {
        "vulkan bundle built": True,
        "verify --smoke ok": ev["verify"]["rc"] == 0,
        "Vulkan0 is the NVIDIA GPU": any("Vulkan0" in d and "NVIDIA" in d for d in devices),
        "vulkan tokens == cpu reference": bool(tokens) and tokens == cpu_ref,
        "ready on vulkan": status.get("state") == "ready" and status.get("backend") == "vulkan",
        "all layers offloaded": bool(layers.get("offloaded")) and layers.get("offloaded") == layers.get("total"),
        "server holds VRAM (NVML)": (ev["nvml"].get("process_vram_mib") or 0) > 0,
    }
    ev["tokens"] = {"vulkan": tokens, "cpu_reference": cpu_ref}
    bad = [k for k, v in checks.items() if not v]
    return {"status": "PASS" if not bad else "FAIL", "checks": checks, **ev}
