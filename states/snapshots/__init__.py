"""The snapshot decisions: save before a stop, restore or re-prefill."""
