"""``python -m openalign`` (the same as the ``openalign`` command; ``PYTHONPATH=src`` runs it from a checkout)."""

import sys

from openalign.cli import main

sys.exit(main())
