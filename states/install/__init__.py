"""The install machine: one engine bundle from a source to the slot, and the slot's rules."""
