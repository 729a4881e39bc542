"""CLI commands kept apart from compiler/cli.py, each registered on its group there."""
