"""`python -m commfold.cli ...`: the `commfold` command."""
import sys

from commfold.cli import main

sys.exit(main())
