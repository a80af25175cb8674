"""`python -m megascale.config > docs/config.md`: the configuration reference."""

import sys

from megascale.config import render_reference

sys.stdout.write(render_reference())
