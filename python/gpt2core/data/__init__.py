"""Data: token shards, loaders and dataset preparation (shakespeare, fineweb, hellaswag)."""
from .shards import ShardError, find_shards, load_tokens, read_header, write_shard  # noqa: F401
