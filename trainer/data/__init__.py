"""Data pipeline: tiktoken-based tokenizer and packed, sharded, resumable token loaders."""

from trainer.data.datasets import TokenDataLoader, build_dataloader
from trainer.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["TokenDataLoader", "Tokenizer", "build_dataloader", "build_tokenizer"]
