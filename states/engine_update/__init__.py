"""The engine-update machine: a staged, smoke-gated engine update and its rollback."""
