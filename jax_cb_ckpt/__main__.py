"""`python -m jax_cb_ckpt ls|show|verify DIRECTORY`: see jax_cb_ckpt/_cli.py."""

import sys

from ._cli import main

sys.exit(main())
