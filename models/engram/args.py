"""Hyper-parameters of Engram conditional memory (arXiv 2601.07372)."""

from dataclasses import dataclass


@dataclass
class EngramArgs:
    """Shape of the Engram memory. Layer ids are 0-based block indices of the main model
    (Engram-27B's "layers 2 and 15 of 30, counted from 1" are `layer_ids=(1, 14)`)."""

    layer_ids: tuple[int, ...] = (1,)
    """0-based indices of the transformer blocks that get an Engram module (before attention)."""
    max_ngram: int = 3
    """N: suffix n-grams of orders 2..N are hashed; also the dilation of the short conv."""
    heads_per_order: int = 4
    """K: hash heads (each with its own prime-sized table slice) per n-gram order."""
    base_size: int = 1009
    """Rows of one head before rounding up to the next unused prime (Engram-27B: 2,262,400)."""
    head_dim: int = 16
    """D_h: width of one head's row; the memory vector is (N-1) * K * D_h wide."""
    kernel_size: int = 4
    """Taps of the depthwise causal conv (dilation N), so it reads (kernel_size-1)*N past positions."""
    seed: int = 0
    """Seed of the per-layer hash multipliers (identical on every rank by construction)."""
    table_init_std: float = 1.0
    """Std of the table rows' N(0, std) init (like token embeddings)."""

    def __post_init__(self) -> None:
        self.layer_ids = tuple(int(i) for i in self.layer_ids)
        if not self.layer_ids:
            raise ValueError("EngramArgs.layer_ids must name at least one block")
        if list(self.layer_ids) != sorted(set(self.layer_ids)) or min(self.layer_ids) < 0:
            raise ValueError(f"EngramArgs.layer_ids must be distinct, ascending and >= 0, got {self.layer_ids}")
        for name, low in (("max_ngram", 2), ("heads_per_order", 1), ("base_size", 2), ("head_dim", 1),
                          ("kernel_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"EngramArgs.{name} must be >= {low}, got {getattr(self, name)}")
        if self.table_init_std <= 0:
            raise ValueError(f"EngramArgs.table_init_std must be > 0, got {self.table_init_std}")

    @property
    def num_heads(self) -> int:
        """(N - 1) * K hash heads per layer."""
        return (self.max_ngram - 1) * self.heads_per_order

    @property
    def memory_dim(self) -> int:
        """d_mem = (N - 1) * K * D_h: width of the concatenated head rows."""
        return self.num_heads * self.head_dim
