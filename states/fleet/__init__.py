"""The fleet's decisions: where models go, when idle ones unload."""
