"""The fallback orchestrator's machine and its decisions: which backend, why not the others."""
