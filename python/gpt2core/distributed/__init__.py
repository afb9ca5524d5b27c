"""Data parallel training: the ranks' environment and communicators, DataParallel with ZeRO-1/2 and optimizer
offload (parallel), and the launcher that starts the ranks (launch: python -m gpt2core.launch)."""
from .parallel import (DEFAULT_PORT, DEFAULT_TIMEOUT, DataParallel, DistEnv, from_env,  # noqa: F401
                       init_process_group, setup)
