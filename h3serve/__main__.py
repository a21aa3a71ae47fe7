"""`python -m h3serve ...`: the `h3serve` command (torchrun and the tests start it this way)."""

import sys

from h3serve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
