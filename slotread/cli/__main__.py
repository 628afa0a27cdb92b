"""``python -m slotread.cli``, as the ``slotread`` script."""

import sys

from slotread.cli import main

sys.exit(main())
