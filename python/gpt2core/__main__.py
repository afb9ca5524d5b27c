import sys

from .training.train import console

sys.exit(console())
