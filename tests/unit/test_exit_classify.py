"""classify_exit on recorded log tails: the engine's own words decide, in a fixed order.

One classifier names every engine exit: the supervised server's, `bundle verify`'s tool
runs and the smoke generation's (the tails without a timestamp prefix are what those print).
"""

from __future__ import annotations

import signal

import pytest

from stoker.daemon.engine.exits import classify_exit, exit_signal, missing_library, signal_name
from stoker.states.reasons import ReasonCode

# Tails recorded from the CPU build at -lv 4 --log-colors off (each line carries the
# engine's timestamp and level); the CUDA ones are the source's messages (ggml-cuda.cu,
# llama-model.cpp) in the same format. See docs/engine-process.md.
MISSING_MODEL = """\
0.00.032.161 I common_fit_params: fitting params to free memory took 0.00 seconds
0.00.032.167 E gguf_init_from_file: failed to open GGUF file '/nope/missing.gguf' (No such file or directory)
0.00.032.174 E llama_model_load: error loading model: llama_model_loader: failed to load model from /nope/missing.gguf
0.00.032.175 E llama_model_load_from_file_impl: failed to load model
0.00.032.177 E cmn  common_init_: failed to load model '/nope/missing.gguf'
0.00.032.180 E srv    load_model: failed to load model, '/nope/missing.gguf'
0.00.032.183 I srv    operator(): operator(): cleaning up before exit...
0.00.032.642 E srv  llama_server: exiting due to model loading error
"""
CORRUPT_MODEL = """\
0.00.023.680 E gguf_init_from_reader: invalid magic characters: 'xxxx', expected 'GGUF'
0.00.023.687 E llama_model_load: error loading model: llama_model_loader: failed to load model from /m/bad.gguf
0.00.023.688 E llama_model_load_from_file_impl: failed to load model
0.00.023.690 E cmn  common_init_: failed to load model '/m/bad.gguf'
0.00.023.693 E srv    load_model: failed to load model, '/m/bad.gguf'
0.00.023.695 I srv    operator(): operator(): cleaning up before exit...
0.00.031.314 E srv  llama_server: exiting due to model loading error
"""
PORT_TAKEN = """\
0.00.017.675 I srv          init: using 8 threads for HTTP server
0.00.017.840 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 44393
0.00.017.850 I srv    operator(): operator(): cleaning up before exit...
0.00.017.928 E srv  llama_server: exiting due to HTTP server error
"""
BAD_ARGUMENT = """\
error: invalid argument: --bogus-flag
"""
CUDA_OOM = """\
0.00.101.000 E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 81920.00 MiB on device 0: cudaMalloc failed: out of memory
0.00.101.001 E alloc_tensor_range: failed to allocate CUDA0 buffer of size 85899345920
0.00.101.002 E llama_model_load: error loading model: unable to allocate CUDA0 buffer
0.00.101.003 E srv  llama_server: exiting due to model loading error
"""
CUDA_INIT = """\
0.00.020.000 E ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version
0.00.031.000 E llama_model_load: error loading model: make_cpu_buft_list: no CPU backend found
0.00.031.001 E srv  llama_server: exiting due to model loading error
"""
SERVING = """\
0.00.064.826 I srv  llama_server: model loaded
0.00.064.831 I srv  llama_server: listening on http://127.0.0.1:32863
0.00.064.939 I srv  update_slots: all slots are idle
"""


@pytest.mark.parametrize(
    ("returncode", "tail", "reason", "line"),
    [
        (1, MISSING_MODEL, ReasonCode.MODEL_MISSING, "failed to open GGUF file"),
        (1, CORRUPT_MODEL, ReasonCode.MODEL_LOAD_FAILED, "exiting due to model loading error"),
        (1, PORT_TAKEN, ReasonCode.PORT_IN_USE, "couldn't bind HTTP server socket"),
        (1, CUDA_OOM, ReasonCode.OUT_OF_MEMORY, "unable to allocate CUDA0 buffer"),
        (1, CUDA_INIT, ReasonCode.CUDA_UNAVAILABLE, "failed to initialize CUDA"),
        (1, BAD_ARGUMENT, ReasonCode.SERVER_BAD_ARGUMENTS, "invalid argument: --bogus-flag"),
        (-4, SERVING, ReasonCode.CPU_ILLEGAL_INSTRUCTION, None),
        (132, SERVING, ReasonCode.CPU_ILLEGAL_INSTRUCTION, None),  # through a shell
        (-4, MISSING_MODEL, ReasonCode.CPU_ILLEGAL_INSTRUCTION, None),  # the signal decides first
    ],
)
def test_log_and_signal_rules(returncode, tail, reason, line):
    got, evidence = classify_exit(returncode, tail.splitlines())
    assert got == reason
    assert evidence["returncode"] == returncode
    if line is not None:
        assert line in evidence["line"]


def test_sigkill_is_a_crash_with_the_signal_as_evidence():
    reason, evidence = classify_exit(-9, SERVING.splitlines())
    assert reason == ReasonCode.SERVER_CRASHED
    assert evidence["signal"] == "SIGKILL" and evidence["exit_code"] is None
    assert evidence["log_tail"][-1].endswith("srv  update_slots: all slots are idle")


def test_sigkill_from_the_oom_killer_is_out_of_memory():
    reason, evidence = classify_exit(-9, SERVING.splitlines(), oom_killed=True)
    assert reason == ReasonCode.OUT_OF_MEMORY and "OOM killer" in evidence["line"]
    # The OOM killer only explains a SIGKILL.
    assert classify_exit(-6, SERVING.splitlines(), oom_killed=True)[0] == ReasonCode.SERVER_CRASHED


def test_an_abort_names_the_last_error_line():
    tail = SERVING + "/src/ggml.c:1234: GGML_ASSERT(n_dims <= 4) failed\n"
    reason, evidence = classify_exit(-6, tail.splitlines())
    assert reason == ReasonCode.SERVER_CRASHED and evidence["signal"] == "SIGABRT"
    assert "GGML_ASSERT" in evidence["line"]


def test_an_unexpected_clean_exit_is_a_crash_with_its_code():
    reason, evidence = classify_exit(0, SERVING.splitlines())
    assert reason == ReasonCode.SERVER_CRASHED
    assert evidence["exit_code"] == 0 and evidence["signal"] is None


def test_an_unknown_status_is_decided_by_the_log():
    assert classify_exit(None, PORT_TAKEN.splitlines())[0] == ReasonCode.PORT_IN_USE
    assert classify_exit(None, SERVING.splitlines())[0] == ReasonCode.SERVER_CRASHED


def test_evidence_keeps_only_the_last_lines():
    tail = [f"line {i}" for i in range(100)]
    assert classify_exit(1, tail)[1]["log_tail"] == tail[-20:]


def test_signal_names():
    assert signal_name(-9) == "SIGKILL" and signal_name(137) == "SIGKILL"
    assert signal_name(1) is None and signal_name(None) is None


@pytest.mark.parametrize(
    ("returncode", "tail", "reason"),
    [
        (-signal.SIGILL, "", ReasonCode.CPU_ILLEGAL_INSTRUCTION),
        (128 + signal.SIGILL, "", ReasonCode.CPU_ILLEGAL_INSTRUCTION),
        (-signal.SIGILL, "error loading model", ReasonCode.CPU_ILLEGAL_INSTRUCTION),  # the signal decides first
        (-signal.SIGSEGV, "", ReasonCode.SERVER_CRASHED),
        (1, "couldn't bind HTTP server socket", ReasonCode.PORT_IN_USE),
        (1, "llama_model_load: error loading model: bad magic", ReasonCode.MODEL_LOAD_FAILED),
        (-signal.SIGABRT, "CUDA error: out of memory", ReasonCode.OUT_OF_MEMORY),
    ],
)
def test_tool_runs_are_named_by_the_same_rules(returncode, tail, reason):
    """What `bundle verify` and the smoke run hand in: a status and untimestamped lines."""
    assert classify_exit(returncode, tail.splitlines())[0] == reason


LIBCUDA_MISSING = "llama-server: error while loading shared libraries: libcuda.so.1: cannot open shared object file: No such file or directory"


def test_a_missing_gpu_library_is_the_backends_startup_failure():
    reason, evidence = classify_exit(127, [LIBCUDA_MISSING], startup_failed=ReasonCode.CUDA_STARTUP_FAILED)
    assert reason == ReasonCode.CUDA_STARTUP_FAILED
    assert evidence["missing_library"] == "libcuda.so.1" and evidence["line"] == LIBCUDA_MISSING
    assert missing_library([LIBCUDA_MISSING]) == "libcuda.so.1"


def test_a_missing_library_is_not_a_missing_model():
    """The loader's "No such file or directory" for a library says nothing about the model: the
    model_missing rule asks for the GGUF opener's words (the two old classifiers disagreed here:
    the supervisor's evidence rule took any "No such file or directory" line)."""
    assert classify_exit(127, [LIBCUDA_MISSING])[0] == ReasonCode.SERVER_CRASHED
    tail = MISSING_MODEL + "0.00.033.000 W srv  slot_save: cannot open /s/slot0.bin: No such file or directory\n"
    reason, evidence = classify_exit(1, tail.splitlines())
    assert reason == ReasonCode.MODEL_MISSING
    assert "failed to open GGUF file '/nope/missing.gguf'" in evidence["line"]  # the line that decided


# What the engine says for a path that is there but is not a model: fopen succeeds on a
# directory or /dev/zero, the header read fails (ggml/src/gguf.cpp). Not "does not exist".
DIRECTORY_MODEL = """\
0.00.030.100 E gguf_init_from_reader: failed to read magic
0.00.030.104 E llama_model_load: error loading model: llama_model_loader: failed to load model from /models
0.00.030.900 E srv  llama_server: exiting due to model loading error
"""
UNREADABLE_MODEL = """\
0.00.030.100 E gguf_init_from_file: failed to open GGUF file '/m/secret.gguf' (Permission denied)
0.00.030.104 E llama_model_load: error loading model: llama_model_loader: failed to load model from /m/secret.gguf
0.00.030.900 E srv  llama_server: exiting due to model loading error
"""


@pytest.mark.parametrize("tail", [DIRECTORY_MODEL, UNREADABLE_MODEL])
def test_a_model_that_is_there_but_unloadable_is_model_load_failed(tail):
    reason, evidence = classify_exit(1, tail.splitlines())
    assert reason == ReasonCode.MODEL_LOAD_FAILED
    assert "exiting due to model loading error" in evidence["line"]


def test_evidence_names_the_signal_and_keeps_the_last_lines():
    reason, evidence = classify_exit(-4, ["a", "b", "c"])
    assert reason == ReasonCode.CPU_ILLEGAL_INSTRUCTION
    assert evidence["signal"] == "SIGILL" and evidence["returncode"] == -4 and evidence["exit_code"] is None
    assert exit_signal(132) == signal.SIGILL and exit_signal(1) is None and exit_signal(None) is None
