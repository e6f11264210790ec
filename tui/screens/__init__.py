"""Screens: modal confirmation, backend choice, help, and the daemon-not-running screen."""
