"""``python -m harness``."""

import sys

from harness.cli import entry

sys.exit(entry())
