"""The config machine: the file's validity and what a reload changes."""
