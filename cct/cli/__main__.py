"""`python -m cct.cli ...` runs the `cct` command."""
import sys

from cct.cli import main

sys.exit(main())
