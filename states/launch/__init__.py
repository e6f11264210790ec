"""The launch machine: one llama-server's life, from planning to ready and back."""
