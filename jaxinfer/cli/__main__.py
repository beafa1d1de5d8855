import sys

from . import main

if __name__ == "__main__":  # not when a multiprocessing child imports the parent's main
    sys.exit(main())
