"""Reading llama-fit-params (daemon/engine/fit.py): its two outputs, and which of a plan's arguments
it is given. The outputs below are the program's own, from the pinned source built with CUDA on
an H200 (the 22 MB test model of tests/integration/conftest.py's big_model, -c 256)."""

from __future__ import annotations

import pytest

from stoker.daemon.engine.fit import FitFailed, memory_args, parse_fitted, parse_printed

PRINTED_CUDA = """\
0.00.114.713 I llama_fit_params: printing estimated memory in MiB to stdout (device, model, context, compute) ...
CUDA0 20 1 5 
Host 0 0 2 
"""


def test_the_printed_projection_per_device_and_host():
    parts = parse_printed(PRINTED_CUDA)
    assert parts == {
        "CUDA0": {"model": 20.0, "context": 1.0, "compute": 5.0},
        "Host": {"model": 0.0, "context": 0.0, "compute": 2.0},
    }


def test_a_cpu_only_projection_has_the_host_alone():
    assert parse_printed("Host 21 1 5 \n") == {"Host": {"model": 21.0, "context": 1.0, "compute": 5.0}}


@pytest.mark.parametrize("out", ["", "error: invalid argument: --alias\n", "CUDA0 1 2 3\n"])
def test_no_host_line_is_no_answer(out):
    with pytest.raises(FitFailed):
        parse_printed(out)


def test_the_fitted_arguments():
    assert parse_fitted("llama_fit_params: printing fitted CLI arguments to stdout...\n-c 256 -ngl -1\n") == [
        "-c",
        "256",
        "-ngl",
        "-1",
    ]
    line = '-c 4096 -ngl 48 -ts 30,18 -ot "blk\\.14\\.ffn_(up|down|gate)_(ch|)exps=CPU,blk\\.15\\.ffn_up=CPU"\n'
    assert parse_fitted(line) == [
        "-c",
        "4096",
        "-ngl",
        "48",
        "-ts",
        "30,18",
        "-ot",
        "blk\\.14\\.ffn_(up|down|gate)_(ch|)exps=CPU,blk\\.15\\.ffn_up=CPU",
    ]
    with pytest.raises(FitFailed):
        parse_fitted("llama_fit_params: failed to fit CLI arguments to free memory, exiting...\n")


def test_only_the_memory_shaping_arguments_it_accepts_are_passed():
    plan_args = [
        "--alias",
        "chat",
        "--metrics",
        "--swa-full",
        "-ctk",
        "q8_0",
        "--jinja",
        "--chat-template",
        "chatml",
        "--fit-target=2048",
        "-ngl",
        "auto",
        "--slot-save-path",
        "/x",
    ]
    assert memory_args(plan_args) == ["--swa-full", "-ctk", "q8_0", "--fit-target=2048", "-ngl", "auto"]


def test_the_logits_of_a_whole_micro_batch_are_taken_off_the_largest_compute(monkeypatch, tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.fallback import memory
    from stoker.daemon.models.facts import vocab_size
    from stoker.states.launch.records import LaunchPlan

    model = write_tiny_model(tmp_path / "tiny.gguf")
    import gguf

    assert vocab_size(model) == len(gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].data)  # read by gguf
    plan = LaunchPlan("cpu", "avx2", "/b", "/b/llama-server", str(model), parallel=2)
    monkeypatch.setattr(memory, "vocab_size", lambda path: 262144)  # Gemma 3's vocabulary
    parts = {"Host": {"model": 222.0, "context": 27.0, "compute": 524.0}}
    # (512 outputs reserved by the fitter - 2 slots) x 262144 tokens x 4 bytes = 510 MiB.
    assert memory.server_outputs_correction(plan, parts) == ("Host", 510.0)
    ub = LaunchPlan("cpu", "avx2", "/b", "/b/llama-server", str(model), parallel=1, extra_args=("-ub", "128"))
    assert memory.server_outputs_correction(ub, parts) == ("Host", 127.0)
    gpu = {"CUDA0": {"model": 200.0, "context": 27.0, "compute": 520.0}, "Host": {"compute": 2.0}}
    assert memory.server_outputs_correction(plan, gpu) == ("CUDA0", 510.0)
