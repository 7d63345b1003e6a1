"""The command line: see README.md beside this file."""
