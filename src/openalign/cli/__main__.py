"""``python -m openalign.cli`` (what torchrun starts on every rank)."""

import sys

from openalign.cli import main

sys.exit(main())
