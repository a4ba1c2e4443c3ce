"""`python -m maximus.train --config FILE [key=value ...]` (what torchrun launches)."""
import sys

from maximus.cli import train_main

sys.exit(train_main())
