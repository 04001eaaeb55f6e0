"""`python -m bench` is the same as the `bench` console script."""

import sys

from bench.cli import main

sys.exit(main())
