"""The RPC worker machine: one rpc-server supervised on a trusted host."""
