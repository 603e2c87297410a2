"""Token data: the sources (:mod:`train.data.loader`), the resumable rank-sharded loader,
and ``python -m train.data.prepare`` (text -> token shards with a user's tokenizer)."""
from train.data.loader import ShardedLoader, file_dtype, token_file, val_file  # noqa: F401
from train.data.chat_loader import ChatLoader, build_loader  # noqa: F401
