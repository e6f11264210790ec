"""The TUI's widgets: each gets its data as attributes and sends messages up."""
