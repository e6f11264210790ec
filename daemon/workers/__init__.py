"""RPC workers: this host as one (`stoker worker` supervising ggml-rpc-server) and the head's
reading of its workers through the engine's own RPC protocol. See docs/scale-out.md."""
