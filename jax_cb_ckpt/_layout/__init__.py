"""The on-disk contract: see README.md beside this file."""
