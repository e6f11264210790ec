"""classify_exit on recorded log tails: the engine's own words decide, in a fixed order."""

from __future__ import annotations

import pytest

from daemon.exit_classify import classify_exit, signal_name
from states.reasons import ReasonCode

# Tails recorded from the CPU build at -lv 4 (see docs/engine-process.md); the CUDA ones are
# the source's messages (ggml-cuda.cu, llama-model.cpp) in the same log format.
MISSING_MODEL = """\
llama_model_load_from_file_impl: using device CPU
gguf_init_from_file: failed to open GGUF file '/nope/missing.gguf' (No such file or directory)
llama_model_load: error loading model: llama_model_loader: failed to load model from /nope/missing.gguf
llama_model_load_from_file_impl: failed to load model
srv    load_model: failed to load model, '/nope/missing.gguf'
srv  llama_server: exiting due to model loading error
"""
CORRUPT_MODEL = """\
gguf_init_from_file_impl: invalid magic characters: 'xxxx', expected 'GGUF'
llama_model_load: error loading model: llama_model_loader: failed to load model from /m/bad.gguf
srv    load_model: failed to load model, '/m/bad.gguf'
srv  llama_server: exiting due to model loading error
"""
PORT_TAKEN = """\
srv  llama_server: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 41000
srv  llama_server: exiting due to HTTP server error
"""
CUDA_OOM = """\
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 81920.00 MiB on device 0: cudaMalloc failed: out of memory
alloc_tensor_range: failed to allocate CUDA0 buffer of size 85899345920
llama_model_load: error loading model: unable to allocate CUDA0 buffer
srv  llama_server: exiting due to model loading error
"""
CUDA_INIT = """\
ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version
llama_model_load: error loading model: make_cpu_buft_list: no CPU backend found
srv  llama_server: exiting due to model loading error
"""
SERVING = """\
srv  llama_server: model loaded
srv  llama_server: listening on http://127.0.0.1:41235
srv  update_slots: all slots are idle
"""


@pytest.mark.parametrize(
    ("returncode", "tail", "reason", "line"),
    [
        (1, MISSING_MODEL, ReasonCode.MODEL_MISSING, "failed to open GGUF file"),
        (1, CORRUPT_MODEL, ReasonCode.MODEL_LOAD_FAILED, "exiting due to model loading error"),
        (1, PORT_TAKEN, ReasonCode.PORT_IN_USE, "couldn't bind HTTP server socket"),
        (1, CUDA_OOM, ReasonCode.OUT_OF_MEMORY, "unable to allocate CUDA0 buffer"),
        (1, CUDA_INIT, ReasonCode.CUDA_UNAVAILABLE, "failed to initialize CUDA"),
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
    assert evidence["log_tail"][-1] == "srv  update_slots: all slots are idle"


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
