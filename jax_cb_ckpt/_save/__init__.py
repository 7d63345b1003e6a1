"""From traced code to the host: see README.md beside this file."""
