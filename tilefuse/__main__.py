"""``python -m tilefuse``: see ``tilefuse.cli``."""
import sys

from tilefuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
