"""Reading back: see README.md beside this file."""
