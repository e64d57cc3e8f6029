"""``python -m erase_fx ...``: the ``erase-fx`` command (`erase_fx.cli`)."""
import sys

from erase_fx.cli import main

sys.exit(main())
