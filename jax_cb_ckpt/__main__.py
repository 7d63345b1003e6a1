"""`python -m jax_cb_ckpt ls|show|verify DIRECTORY`: see jax_cb_ckpt/_cli/_main.py."""

import sys

from ._cli._main import main

sys.exit(main())
