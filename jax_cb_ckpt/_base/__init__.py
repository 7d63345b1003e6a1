"""Below every stage: see README.md beside this file."""
