"""The hand-off between a save and the writer: see README.md beside this file."""
