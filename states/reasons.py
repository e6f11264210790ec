"""Reason codes: the stable strings that explain every failure and fallback.

Each code has a user-facing message that says what happened and what to do. The value is
what SQLite stores and what `--json` prints; never rename one.

The members below are Stoker's own codes (the built-in backends' included). A backend plugin
brings its own codes with their sentences: the daemon registers them when it loads the
plugin (`register_reasons`, called from daemon/backends/registry.py), and from then on
`ReasonCode("fakegpu_startup_failed")` is a ReasonCode like any member, stored and printed as
the same string. Iterating `ReasonCode` lists the built-in codes only (docs/reason-codes.md).

A plugin can be uninstalled after its codes were stored. Reading a row back goes through
`stored_reason`, which admits such a code (well-formed, declared by no loaded plugin) as an
orphan whose sentence says its plugin is gone, so the daemon still starts and its history
still reads. Nothing else admits an unknown code: `ReasonCode(value)` from the socket or the
config still refuses one.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Mapping, TypeGuard

import attrs

from stoker.states.reason_messages import MESSAGE_TEXT


class ReasonCode(enum.StrEnum):
    """A stable reason string: a built-in member, or a code a loaded plugin registered."""

    @classmethod
    def _missing_(cls, value: object) -> ReasonCode | None:
        # A plugin's registered code (or one read back from the store after its plugin was
        # uninstalled): a pseudo-member, made once (like Flag's), never listed.
        if not isinstance(value, str) or (value not in _PLUGIN_REASONS and value not in _ORPHANED):
            return None
        member = _PSEUDO_MEMBERS.get(value)
        if member is None:
            member = str.__new__(cls, value)
            member._name_ = value.upper()
            member._value_ = value
            _PSEUDO_MEMBERS[value] = member
        return member

    # From the origin story, kept verbatim.
    BINARY_MISSING_NVIDIA_DETECTED = "binary_missing_nvidia_detected"
    GPU_MISSING = "gpu_missing"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    CUDA_GPU_LAYERS_ZERO = "cuda_gpu_layers_zero"
    CUDA_STARTUP_FAILED = "cuda_startup_failed"
    CUDA_BUNDLE_INSTALL_FAILED = "cuda_bundle_install_failed"
    CUDA_VRAM_FULL = "cuda_vram_full"
    # The other GPU backends' analogues.
    BINARY_MISSING_AMD_DETECTED = "binary_missing_amd_detected"
    ROCM_UNAVAILABLE = "rocm_unavailable"
    ROCM_GPU_LAYERS_ZERO = "rocm_gpu_layers_zero"
    ROCM_STARTUP_FAILED = "rocm_startup_failed"
    ROCM_BUNDLE_INSTALL_FAILED = "rocm_bundle_install_failed"
    ROCM_VRAM_FULL = "rocm_vram_full"
    BINARY_MISSING_VULKAN_DETECTED = "binary_missing_vulkan_detected"
    VULKAN_UNAVAILABLE = "vulkan_unavailable"
    VULKAN_GPU_LAYERS_ZERO = "vulkan_gpu_layers_zero"
    VULKAN_STARTUP_FAILED = "vulkan_startup_failed"
    VULKAN_BUNDLE_INSTALL_FAILED = "vulkan_bundle_install_failed"
    VULKAN_VRAM_FULL = "vulkan_vram_full"
    VULKAN_SOFTWARE_DEVICE = "vulkan_software_device"
    BINARY_MISSING_METAL_DETECTED = "binary_missing_metal_detected"
    METAL_UNAVAILABLE = "metal_unavailable"
    METAL_GPU_LAYERS_ZERO = "metal_gpu_layers_zero"
    METAL_STARTUP_FAILED = "metal_startup_failed"
    METAL_BUNDLE_INSTALL_FAILED = "metal_bundle_install_failed"
    METAL_VRAM_FULL = "metal_vram_full"
    CPU_BUNDLE_INSTALL_FAILED = "cpu_bundle_install_failed"
    # Hardware probes.
    PROBE_FAILED = "probe_failed"
    # Engine and bundles.
    CPU_ILLEGAL_INSTRUCTION = "cpu_illegal_instruction"
    BUNDLE_MISSING = "bundle_missing"
    # Serving on the next backend while the preferred GPU's engine is built beside, then the switch.
    GPU_ENGINE_BUILDING = "gpu_engine_building"
    GPU_ENGINE_BUILT = "gpu_engine_built"
    BUNDLE_BUILD_FAILED = "bundle_build_failed"
    BUILD_TOOLCHAIN_MISSING = "build_toolchain_missing"
    BUNDLE_DIGEST_MISMATCH = "bundle_digest_mismatch"
    BUNDLE_METADATA_MISMATCH = "bundle_metadata_mismatch"
    BUNDLE_UNSAFE_ARCHIVE = "bundle_unsafe_archive"
    BUNDLE_VERIFY_FAILED = "bundle_verify_failed"
    SOURCE_DIGEST_MISMATCH = "source_digest_mismatch"
    # A mirror's manifest that was refused (daemon/install/trust.py, docs/mirror.md).
    MANIFEST_UNTRUSTED = "manifest_untrusted"
    MANIFEST_SIGNATURE_INVALID = "manifest_signature_invalid"
    MANIFEST_EXPIRED = "manifest_expired"
    MANIFEST_ROLLBACK = "manifest_rollback"
    MANIFEST_WRONG_CHANNEL = "manifest_wrong_channel"
    # Engine updates (states/engine_update/table.py, docs/bundles.md "Updates").
    ENGINE_UPDATE_REJECTED = "engine_update_rejected"
    ENGINE_UPDATE_ROLLED_BACK = "engine_update_rolled_back"
    ENGINE_ROLLBACK_UNAVAILABLE = "engine_rollback_unavailable"
    ENGINE_ROLLBACK_FAILED = "engine_rollback_failed"
    ENGINE_SLOT_BUSY = "engine_slot_busy"
    # The server process.
    MODEL_MISSING = "model_missing"
    MODEL_LOAD_FAILED = "model_load_failed"
    OUT_OF_MEMORY = "out_of_memory"
    PORT_IN_USE = "port_in_use"
    SERVER_CRASHED = "server_crashed"
    SERVER_STALLED = "server_stalled"
    SERVER_HUNG = "server_hung"
    SERVER_START_TIMEOUT = "server_start_timeout"
    SERVER_SPAWN_FAILED = "server_spawn_failed"
    SERVER_BAD_ARGUMENTS = "server_bad_arguments"
    SERVER_FILES_UNWRITABLE = "server_files_unwritable"
    CRASH_LOOP = "crash_loop"
    GPU_CLAIMED_BUT_UNUSED = "gpu_claimed_but_unused"
    # The daemon, its config and its socket.
    CONFIG_INVALID = "config_invalid"
    DAEMON_ALREADY_RUNNING = "daemon_already_running"
    DAEMON_NOT_RUNNING = "daemon_not_running"
    SERVICE_MANAGER_UNAVAILABLE = "service_manager_unavailable"
    SERVICE_UNIT_INVALID = "service_unit_invalid"
    DATA_DIR_UNWRITABLE = "data_dir_unwritable"
    RUNTIME_DIR_UNUSABLE = "runtime_dir_unusable"
    DAEMON_VERSION_SKEW = "daemon_version_skew"
    BAD_REQUEST = "bad_request"
    REQUEST_TOO_LARGE = "request_too_large"
    UNKNOWN_METHOD = "unknown_method"
    ILLEGAL_TRANSITION = "illegal_transition"
    # The state database and the machines' bookkeeping.
    STORE_CORRUPT = "store_corrupt"
    STORE_SCHEMA_TOO_NEW = "store_schema_too_new"
    STORE_WRITE_FAILED = "store_write_failed"
    KEY_NOT_FOUND = "key_not_found"
    # What a client of the front door meets beyond the holding's 503s (the front door answers
    # these codes in its error bodies; `stoker chat` and `stoker run` show them).
    FRONTDOOR_UNAVAILABLE = "frontdoor_unavailable"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_STREAM_CUT = "engine_stream_cut"
    ENGINE_REFUSED_REQUEST = "engine_refused_request"
    PROBE_RESULT_STALE = "probe_result_stale"
    INTERNAL_ERROR = "internal_error"
    # KV slot snapshots.
    SNAPSHOTS_DISABLED = "snapshots_disabled"
    SNAPSHOT_NOT_FOUND = "snapshot_not_found"
    SNAPSHOT_SERVER_NOT_READY = "snapshot_server_not_ready"
    SNAPSHOT_INSTANCE_MISMATCH = "snapshot_instance_mismatch"
    SNAPSHOT_MODEL_MISMATCH = "snapshot_model_mismatch"
    SNAPSHOT_ENGINE_MISMATCH = "snapshot_engine_mismatch"
    SNAPSHOT_LAYOUT_MISMATCH = "snapshot_layout_mismatch"
    SNAPSHOT_CORRUPT = "snapshot_corrupt"
    SNAPSHOT_BAD_SLOT = "snapshot_bad_slot"
    SNAPSHOT_SAVE_FAILED = "snapshot_save_failed"
    SNAPSHOT_DISK_FULL = "snapshot_disk_full"
    SNAPSHOT_RESTORE_FAILED = "snapshot_restore_failed"
    SNAPSHOT_NO_BENEFIT = "snapshot_no_benefit"
    SNAPSHOT_DROPPED = "snapshot_dropped"
    SNAPSHOT_SAVE_SKIPPED = "snapshot_save_skipped"
    SNAPSHOT_SAVE_TIMEOUT = "snapshot_save_timeout"
    SNAPSHOT_REMOVED = "snapshot_removed"
    # The front door (daemon/frontdoor/): why a held request was answered 503.
    FRONTDOOR_HOLD_TIMEOUT = "frontdoor_hold_timeout"
    FRONTDOOR_QUEUE_FULL = "frontdoor_queue_full"
    FRONTDOOR_SERVER_DOWN = "frontdoor_server_down"
    # Several models ([placement] max_loaded): a load with no room, and an unload to make room.
    PLACEMENT_NO_ROOM = "placement_no_room"
    PLACEMENT_EVICTED = "placement_evicted"
    IDLE_UNLOADED = "idle_unloaded"
    # ... and why a request was refused before it was held: it broke a `[frontdoor]` limit.
    FRONTDOOR_BODY_TOO_LARGE = "frontdoor_body_too_large"
    FRONTDOOR_HEADERS_TOO_LARGE = "frontdoor_headers_too_large"
    FRONTDOOR_SLOW_CLIENT = "frontdoor_slow_client"
    FRONTDOOR_MALFORMED_BODY = "frontdoor_malformed_body"
    # Ollama's API on its own listener ([ollama]): its port was held by another program.
    OLLAMA_PORT_TAKEN = "ollama_port_taken"
    # ... or it asked for what the front door does not serve: an engine route that would break a
    # guarantee, a web page's origin not in `[frontdoor] cors_origins`, an engine-only route of a remote model.
    FRONTDOOR_ROUTE_REFUSED = "frontdoor_route_refused"
    FRONTDOOR_ORIGIN_REFUSED = "frontdoor_origin_refused"
    REMOTE_ROUTE_UNSUPPORTED = "remote_route_unsupported"
    # Pulling models (daemon/models/pull.py) and the catalog.
    PULL_BAD_SPEC = "pull_bad_spec"
    PULL_SOURCE_UNREACHABLE = "pull_source_unreachable"
    PULL_NOT_FOUND = "pull_not_found"
    PULL_UNAUTHORIZED = "pull_unauthorized"
    PULL_NO_FILE_FOR_QUANT = "pull_no_file_for_quant"
    PULL_CHECKSUM_MISMATCH = "pull_checksum_mismatch"
    PULL_DISK_FULL = "pull_disk_full"
    PULL_NOT_GGUF = "pull_not_gguf"
    PULL_UNSAFE_PATH = "pull_unsafe_path"
    PULL_FAILED = "pull_failed"
    MODEL_NOT_IN_CATALOG = "model_not_in_catalog"
    MODEL_IN_USE = "model_in_use"
    # RPC workers (docs/scale-out.md).
    RPC_WORKER_UNREACHABLE = "rpc_worker_unreachable"
    RPC_VERSION_MISMATCH = "rpc_version_mismatch"
    RPC_WORKER_LOST = "rpc_worker_lost"
    RPC_WORKER_FAILED = "rpc_worker_failed"
    # Remote models: [models.NAME] served by an external endpoint (daemon/fleet/remote.py).
    REMOTE_ENDPOINT_UNREACHABLE = "remote_endpoint_unreachable"
    REMOTE_KEY_REJECTED = "remote_key_rejected"
    REMOTE_KEY_MISSING = "remote_key_missing"


MESSAGES: dict[ReasonCode, str] = {ReasonCode(code): text for code, text in MESSAGE_TEXT.items()}


def message_for(code: ReasonCode | str) -> str:
    """The user-facing sentence for a reason code (a plugin's: the sentence it registered)."""
    reason = ReasonCode(code)
    builtin = MESSAGES.get(reason)
    if builtin is not None:
        return builtin
    declared = _PLUGIN_REASONS.get(reason.value)
    return declared.message if declared is not None else orphan_message(reason.value)


class ReasonedError(Exception):
    """A failure with a stable reason code, a message that says what to do, and evidence.

    Pure data, so that every layer (store/ included, which must not import daemon/) raises
    errors of one shape: `reason`, `message`, `evidence`, `to_dict()`.
    """

    def __init__(
        self, reason: ReasonCode | str, message: str | None = None, evidence: Mapping[str, Any] | None = None
    ) -> None:
        self.reason = ReasonCode(reason)
        self.message = message or message_for(self.reason)
        self.evidence: dict[str, Any] = dict(evidence or {})
        super().__init__(f"{self.reason}: {self.message}")

    def to_dict(self) -> dict[str, Any]:
        return {"reason": str(self.reason), "message": self.message, "evidence": self.evidence}


# --- codes that plugins bring ------------------------------------------------------------

# What a code looks like: lowercase words joined by single underscores.
CODE_SHAPE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*$")
MAX_CODE_LENGTH = 64


@attrs.frozen
class PluginReason:
    """A reason code a backend plugin declared, with the sentence a user reads for it."""

    code: str
    owner: str  # the plugin that declared it (its backend name)
    message: str


_PLUGIN_REASONS: dict[str, PluginReason] = {}
_PSEUDO_MEMBERS: dict[str, ReasonCode] = {}
# Codes read back from the store that no loaded plugin declares (see `stored_reason`).
_ORPHANED: set[str] = set()


def is_code_shaped(value: object) -> TypeGuard[str]:
    """Whether `value` looks like a reason code: lowercase words joined by '_', not too long."""
    return isinstance(value, str) and len(value) <= MAX_CODE_LENGTH and CODE_SHAPE.match(value) is not None


def stored_reason(value: object) -> ReasonCode:
    """A reason code read back from the store (machine rows, history events).

    A code no loaded plugin declares was stored by a plugin since uninstalled: it is admitted
    as an orphan (its sentence says so) when it is shaped like a code, so a daemon without the
    plugin still starts. Anything else raises ValueError, as `ReasonCode(value)` does. Only
    the store's reader calls this; socket and config input stay limited to registered codes.
    """
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a valid ReasonCode")
    try:
        return ReasonCode(value)
    except ValueError:
        if not is_code_shaped(value):
            raise
        _ORPHANED.add(value)
    return ReasonCode(value)


def orphan_message(code: str) -> str:
    """The sentence for a stored code whose backend plugin is no longer installed."""
    return (
        f"A reason recorded by a backend plugin that is no longer installed ({code}); its own "
        "explanation went with the plugin. Reinstall the plugin to read it; the evidence is in "
        "`stoker history`."
    )


def register_reasons(owner: str, messages: Mapping[str, str]) -> tuple[ReasonCode, ...]:
    """Admit a plugin's own codes and their sentences; returns them as ReasonCodes.

    A table, not a discovery (states/ stays pure): the daemon calls this for each plugin it
    loads. Nothing is registered when any entry is refused (ValueError naming it): a code of
    the wrong shape, an empty sentence, a built-in code (its meaning is fixed), or a code
    another plugin declared. The same owner declaring again replaces its sentences.
    """
    admitted = []
    for code, message in messages.items():
        if not is_code_shaped(code):
            raise ValueError(
                f"{owner}: {code!r} is not a reason code (lowercase words joined by '_', "
                f"at most {MAX_CODE_LENGTH} characters)"
            )
        if code in ReasonCode._value2member_map_:
            raise ValueError(f"{owner}: {code!r} is a built-in reason code; a plugin cannot redefine it")
        taken = _PLUGIN_REASONS.get(code)
        if taken is not None and taken.owner != owner:
            raise ValueError(f"{owner}: {code!r} is already declared by the {taken.owner!r} plugin")
        if not isinstance(message, str) or not message.strip():
            raise ValueError(f"{owner}: {code!r} needs a sentence that says what happened and what to do")
        admitted.append(PluginReason(code, owner, message.strip()))
    for reason in admitted:
        _PLUGIN_REASONS[reason.code] = reason
        _ORPHANED.discard(reason.code)  # its plugin is back: its own sentence again
    return tuple(ReasonCode(reason.code) for reason in admitted)


def plugin_reasons() -> tuple[PluginReason, ...]:
    """Every registered plugin code, by owner then code."""
    return tuple(sorted(_PLUGIN_REASONS.values(), key=lambda r: (r.owner, r.code)))
