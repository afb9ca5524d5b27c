import sys

from .train import console

sys.exit(console())
