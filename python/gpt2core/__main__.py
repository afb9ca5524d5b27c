import sys

from .train import cli

sys.exit(cli())
