"""python -m nimble_train.bench: see nimble_train/bench/cli.py."""

import sys

from .cli import main

sys.exit(main())
