"""Context-parallel MLA on 2 gloo ranks equals single-device attention, forward and backward.

Checks the three pieces together: head-tail chunking, RoPE at global positions, and the
compressed-latent all-gather (whose backward is a reduce-scatter), for causal and
document-causal masks.
"""

import pytest
import torch
from cp_attention_worker import CASES

pytestmark = pytest.mark.numerics  # docs/numerics.md


@pytest.fixture(scope="module")
def cp_errors(two_ranks) -> dict[int, dict]:
    """tests/distributed/cp_attention_worker.py, both cases, in the fast tier's shared 2-rank
    launch (tests/distributed/conftest.py)."""
    return dict(two_ranks["cp_attention"])


@pytest.mark.parametrize("mask_type,q_lora_rank", CASES)
def test_cp_latent_attention_matches_full(cp_errors, mask_type, q_lora_rank):
    for rank, by_case in cp_errors.items():
        for name, err in by_case[(mask_type, q_lora_rank)].items():
            assert err < 1e-5, f"rank {rank}: {name} differs by {err}"


def test_load_balanced_positions():
    from trainer.parallel.context_parallel import gathered_positions, load_balanced_positions

    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_positions(24, 3).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 4"):
        load_balanced_positions(10, 2, 0)


def test_model_positions_argument_defaults_to_arange():
    import dataclasses

    from models.deepseek_v3 import DeepSeekV3Model, get_flavor

    torch.manual_seed(0)
    model = DeepSeekV3Model(dataclasses.replace(get_flavor("debugmodel"), n_layers=2, max_seq_len=32))
    model.init_weights()
    model.eval()
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        default = model(tokens).logits
        explicit = model(tokens, positions=torch.arange(16)).logits
    torch.testing.assert_close(explicit, default, rtol=0, atol=0)
