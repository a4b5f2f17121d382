"""``python -m specdraft`` and ``accelerate launch -m specdraft train RECIPE``."""

import sys

from .cli import main

sys.exit(main())
