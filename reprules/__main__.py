"""``python -m reprules audit``."""

import sys

from reprules._audit._cli import main

if __name__ == "__main__":
    sys.exit(main())
