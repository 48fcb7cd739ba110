"""`python -m formwork.gateway.extract ...`: `formwork extract` without the console script."""
import sys

from formwork.gateway.extract.cli import main

sys.exit(main())
