"""`python -m formwork ...` is the `formwork` command (serve, extract)."""
import sys

from formwork.gateway.cli import main

if __name__ == "__main__":      # spawned engine processes import this module again
    sys.exit(main())
