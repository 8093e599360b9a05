"""``python -m specdec``: the same as the ``specdec`` command."""

import sys

try:
    from specdec.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads
    print("specdec: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
