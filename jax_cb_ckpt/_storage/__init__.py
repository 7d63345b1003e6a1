"""Where the steps live: see README.md beside this file."""
