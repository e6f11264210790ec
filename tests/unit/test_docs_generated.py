"""Generated documentation must match the code it is generated from."""

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reason_code_table_is_current():
    module = _load("reason_codes")
    assert module.PAGE.read_text() == module.document(), "run: python docs/reason_codes.py"


def test_every_reason_code_is_documented():
    from stoker.states.reasons import MESSAGES, ReasonCode

    text = (DOCS / "reason-codes.md").read_text()
    for code in ReasonCode:
        assert f"`{code.value}`" in text
        assert MESSAGES[code].strip()


def test_cli_reference_is_current():
    module = _load("cli_reference")
    assert module.PAGE.read_text() == module.document(), "run: python docs/cli_reference.py"
    assert module.HELP_MODULE.read_text() == module.help_module(), "run: python docs/cli_reference.py"


def test_protocol_method_reference_is_current():
    module = _load("protocol_methods")
    assert module.PAGE.read_text() == module.document(), "run: python docs/protocol_methods.py"


def test_every_socket_method_is_in_the_reference():
    from stoker.daemon.control.methods import METHODS

    text = (DOCS / "protocol-methods.md").read_text()
    for name, declared in METHODS.items():
        assert f"## `{name}`" in text
        for param in declared.params:
            assert f"| `{param.name}` |" in text


def test_state_pages_and_decision_tables_are_current():
    spec = importlib.util.spec_from_file_location("generate", DOCS / "states" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path, text in module.pages().items():
        assert path.read_text() == text, f"{path.name} is stale: run python docs/states/generate.py"
