"""`specdraft` CLI with the test-only "probe" family registered (for subprocess and accelerate tests)."""

import sys

import probe_family  # noqa: F401  (registers the family)

from specdraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
