"""ReasonCode -> JSON-RPC error code: the one table every error reply's `code` comes from.

Clients should act on the stable `reason` string; the number is there for JSON-RPC tooling, so
it is stable too: never renumber an entry. See docs/protocol.md ("Error codes").
"""

from __future__ import annotations

import zlib

from stoker.states.reasons import ReasonCode

# JSON-RPC 2.0 reserves -32768..-32000. Unparsable JSON is -32700 (reason bad_request); it is the
# one code not keyed by a reason, because JSON-RPC tells "not JSON" from "not a valid request"
# while Stoker's reason for both is bad_request.
PARSE_ERROR = -32700
# A string that is not a ReasonCode at all gets the generic JSON-RPC server error.
APPLICATION_ERROR = -32000
# A reason added after this table was last edited gets a code derived from its (stable) string
# in DERIVED_BASE..DERIVED_BASE+9999, so it is stable too. Give a new reason its table entry
# before a release: once clients have seen a derived code, keep it (add it here verbatim).
DERIVED_BASE = 90000

# ReasonCode -> JSON-RPC error code: the one table. Protocol reasons use JSON-RPC's own codes;
# application reasons have stable positive codes grouped by area. Never renumber an entry.
ERROR_CODES: dict[ReasonCode, int] = {
    # The protocol itself.
    ReasonCode.BAD_REQUEST: -32600,
    ReasonCode.UNKNOWN_METHOD: -32601,
    ReasonCode.INTERNAL_ERROR: -32603,
    ReasonCode.REQUEST_TOO_LARGE: -32001,
    # The daemon, its config and its state machines.
    ReasonCode.CONFIG_INVALID: 1001,
    ReasonCode.DAEMON_ALREADY_RUNNING: 1002,
    ReasonCode.DAEMON_NOT_RUNNING: 1003,
    ReasonCode.ILLEGAL_TRANSITION: 1004,
    ReasonCode.DAEMON_VERSION_SKEW: 1005,
    ReasonCode.STORE_CORRUPT: 1101,
    ReasonCode.STORE_SCHEMA_TOO_NEW: 1102,
    ReasonCode.STORE_WRITE_FAILED: 1103,
    ReasonCode.PROBE_RESULT_STALE: 1201,
    ReasonCode.PROBE_FAILED: 1202,
    # The server process.
    ReasonCode.MODEL_MISSING: 2001,
    ReasonCode.MODEL_LOAD_FAILED: 2002,
    ReasonCode.OUT_OF_MEMORY: 2003,
    ReasonCode.PORT_IN_USE: 2004,
    ReasonCode.SERVER_CRASHED: 2005,
    ReasonCode.SERVER_STALLED: 2006,
    ReasonCode.CRASH_LOOP: 2007,
    ReasonCode.GPU_CLAIMED_BUT_UNUSED: 2008,
    ReasonCode.CPU_ILLEGAL_INSTRUCTION: 2009,
    ReasonCode.SERVER_START_TIMEOUT: 2010,
    ReasonCode.SERVER_SPAWN_FAILED: 2011,
    ReasonCode.SERVER_HUNG: 2012,
    # Engine bundles.
    ReasonCode.BUNDLE_MISSING: 3001,
    ReasonCode.BUNDLE_BUILD_FAILED: 3002,
    ReasonCode.BUILD_TOOLCHAIN_MISSING: 3020,  # the install chain's local build (daemon/install/sources.py)
    ReasonCode.BUNDLE_DIGEST_MISMATCH: 3003,
    ReasonCode.BUNDLE_METADATA_MISMATCH: 3004,
    ReasonCode.BUNDLE_UNSAFE_ARCHIVE: 3005,
    ReasonCode.BUNDLE_VERIFY_FAILED: 3006,
    ReasonCode.SOURCE_DIGEST_MISMATCH: 3007,
    ReasonCode.CPU_BUNDLE_INSTALL_FAILED: 3008,
    ReasonCode.MANIFEST_UNTRUSTED: 3009,
    ReasonCode.MANIFEST_SIGNATURE_INVALID: 3010,
    ReasonCode.MANIFEST_EXPIRED: 3011,
    ReasonCode.MANIFEST_ROLLBACK: 3012,
    ReasonCode.MANIFEST_WRONG_CHANNEL: 3013,
    # KV-cache slot snapshots.
    ReasonCode.SNAPSHOTS_DISABLED: 5001,
    ReasonCode.SNAPSHOT_NOT_FOUND: 5002,
    ReasonCode.SNAPSHOT_SERVER_NOT_READY: 5003,
    ReasonCode.SNAPSHOT_MODEL_MISMATCH: 5004,
    ReasonCode.SNAPSHOT_ENGINE_MISMATCH: 5005,
    ReasonCode.SNAPSHOT_LAYOUT_MISMATCH: 5006,
    ReasonCode.SNAPSHOT_CORRUPT: 5007,
    ReasonCode.SNAPSHOT_BAD_SLOT: 5008,
    ReasonCode.SNAPSHOT_SAVE_FAILED: 5009,
    ReasonCode.SNAPSHOT_DISK_FULL: 5010,
    ReasonCode.SNAPSHOT_RESTORE_FAILED: 5011,
    ReasonCode.SNAPSHOT_NO_BENEFIT: 5012,
    ReasonCode.SNAPSHOT_DROPPED: 5013,
    ReasonCode.SNAPSHOT_SAVE_TIMEOUT: 5014,
    ReasonCode.SNAPSHOT_INSTANCE_MISMATCH: 5015,
    # Backends: 4xyy, x = backend (1 cuda, 2 rocm, 3 vulkan, 4 metal, 0 none), yy = what.
    ReasonCode.GPU_MISSING: 4001,
    ReasonCode.BINARY_MISSING_NVIDIA_DETECTED: 4101,
    ReasonCode.CUDA_UNAVAILABLE: 4102,
    ReasonCode.CUDA_GPU_LAYERS_ZERO: 4103,
    ReasonCode.CUDA_STARTUP_FAILED: 4104,
    ReasonCode.CUDA_BUNDLE_INSTALL_FAILED: 4105,
    ReasonCode.CUDA_VRAM_FULL: 4106,
    ReasonCode.BINARY_MISSING_AMD_DETECTED: 4201,
    ReasonCode.ROCM_UNAVAILABLE: 4202,
    ReasonCode.ROCM_GPU_LAYERS_ZERO: 4203,
    ReasonCode.ROCM_STARTUP_FAILED: 4204,
    ReasonCode.ROCM_BUNDLE_INSTALL_FAILED: 4205,
    ReasonCode.ROCM_VRAM_FULL: 4206,
    ReasonCode.BINARY_MISSING_VULKAN_DETECTED: 4301,
    ReasonCode.VULKAN_UNAVAILABLE: 4302,
    ReasonCode.VULKAN_GPU_LAYERS_ZERO: 4303,
    ReasonCode.VULKAN_STARTUP_FAILED: 4304,
    ReasonCode.VULKAN_BUNDLE_INSTALL_FAILED: 4305,
    ReasonCode.VULKAN_VRAM_FULL: 4306,
    ReasonCode.BINARY_MISSING_METAL_DETECTED: 4401,
    ReasonCode.METAL_UNAVAILABLE: 4402,
    ReasonCode.METAL_GPU_LAYERS_ZERO: 4403,
    ReasonCode.METAL_STARTUP_FAILED: 4404,
    ReasonCode.METAL_BUNDLE_INSTALL_FAILED: 4405,
    ReasonCode.METAL_VRAM_FULL: 4406,
}


def code_for(reason: ReasonCode | str) -> int:
    """The JSON-RPC error code for a reason."""
    try:
        reason = ReasonCode(reason)
    except ValueError:
        return APPLICATION_ERROR
    code = ERROR_CODES.get(reason)
    if code is None:
        code = DERIVED_BASE + zlib.crc32(str(reason).encode()) % 10000
    return code
