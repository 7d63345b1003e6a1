"""The object users hold: see README.md beside this file."""
