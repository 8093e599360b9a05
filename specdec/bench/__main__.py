"""`python -m specdec.bench`: the benchmark without the `specdec` front end."""

import sys

from specdec.bench.cli import main

sys.exit(main())
