"""python -m chunkwise: the same command as `chunkwise`."""
import sys

from .cli import main

sys.exit(main())
