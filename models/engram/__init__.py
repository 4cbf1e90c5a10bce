"""Engram conditional memory: token compression, n-gram hashing, multi-head tables, the module."""

from models.engram.args import EngramArgs
from models.engram.compression import TokenCompression, build_token_compression, normalize_token_text
from models.engram.engram import Engram, engram_metrics, engram_modules, engram_table_params
from models.engram.hashing import NgramHasher, find_primes, hash_multipliers, head_offsets
from models.engram.table import EngramLookup, EngramTable, LocalEngramLookup

__all__ = [
    "Engram",
    "EngramArgs",
    "EngramLookup",
    "EngramTable",
    "LocalEngramLookup",
    "NgramHasher",
    "TokenCompression",
    "build_token_compression",
    "engram_metrics",
    "engram_modules",
    "engram_table_params",
    "find_primes",
    "hash_multipliers",
    "head_offsets",
    "normalize_token_text",
]
