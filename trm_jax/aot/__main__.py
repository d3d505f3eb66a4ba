"""`python -m trm_jax.aot --config ... --topology ...` (trm_jax/aot/cli.py)."""
import sys

from trm_jax.aot.cli import main

sys.exit(main(sys.argv[1:]))
