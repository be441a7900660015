"""`python -m shardc.cli` — the same command line as the `shardc` console script."""
import sys

from shardc.cli import main

sys.exit(main())
