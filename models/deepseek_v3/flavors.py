"""Named architecture presets ("flavors"), built from their plain-data table.

`get_flavor(name)` builds a fresh `DeepSeekV3ModelArgs` on every call, so callers may change the
result (e.g. `dataclasses.replace(get_flavor("16B"), vocab_size=tok.n_vocab)`) without affecting
anyone else. The fields live in `models/flavors/deepseek_v3.py` (torch-free, for the pre-launch
check).

Positional settings are part of the model, not of the run: the three released shapes carry
their release's YaRN `rope_scaling`, so they compute what the released weights compute at any
training `seq_len`; `max_seq_len` is only the rope table length, which the trainer sets to its
sequence length. A run that wants YaRN off says so (`model.disable_yarn`).
"""

from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.flavors.deepseek_v3 import flavor_fields, flavor_names

__all__ = ["flavor_names", "get_flavor"]


def get_flavor(name: str) -> DeepSeekV3ModelArgs:
    """A fresh `DeepSeekV3ModelArgs` for flavor `name`; unknown names raise ValueError."""
    return DeepSeekV3ModelArgs(**flavor_fields(name))
