"""The writer thread: see README.md beside this file."""
