"""The pipeline's stage split and micro-batch defaults (trainer/config/pipeline_layout.py, torch-free)."""

import pytest

from trainer.config import ConfigError
from trainer.config.layout import Layout
from trainer.config.pipeline_layout import default_microbatches, parse_pp_layout, split_stages


def _blocks(specs):
    return [list(s.layers) for s in specs]


def test_even_split_counts_embedding_head_and_mtp_as_layers():
    # 6 blocks + E + L + 1 MTP = 9 equivalents over 2 stages: 5 | 4, i.e. E+4 blocks | 2 blocks+L+MTP.
    assert _blocks(split_stages(6, 1, 2)) == [[0, 1, 2, 3], [4, 5]]
    # Without MTP: 8 equivalents, 4 | 4.
    assert _blocks(split_stages(6, 0, 2)) == [[0, 1, 2], [3, 4, 5]]
    specs = split_stages(6, 1, 4)
    assert [len(b) for b in _blocks(specs)] == [1, 2, 2, 1] and sum(_blocks(specs), []) == list(range(6))
    assert [(s.first, s.last) for s in specs] == [(True, False), (False, False), (False, False), (False, True)]
    # 61 blocks (671B) on 16 stages: every stage gets 3 or 4 blocks, the ends fewer.
    counts = [len(b) for b in _blocks(split_stages(61, 1, 16))]
    assert sum(counts) == 61 and max(counts) - min(counts) <= 2 and counts[0] < max(counts) and counts[-1] < max(counts)


def test_explicit_layout_and_its_mistakes():
    assert parse_pp_layout("Et*2|t*4L") == [["E", "t", "t"], ["t", "t", "t", "t", "L"]]
    assert _blocks(split_stages(6, 1, 2, "Et*2|t*4L")) == [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(ConfigError, match=r"places 5 blocks, the model has 6"):
        split_stages(6, 1, 2, "Et*2|t*3L")
    with pytest.raises(ConfigError, match=r"8 stages .* only 6 blocks"):
        split_stages(6, 1, 8)


def test_layout_resolves_schedule_defaults():
    layout = Layout(1, -1, 1, 1, 1, False, 2, pp=2, pp_schedule="DualPipeV")
    assert (layout.dp_shard, layout.pp_stages_per_rank, layout.pp_microbatches, layout.pp_stages) == (1, 2, 4, 4)
    assert default_microbatches("1F1B", 4, 1) == 4 and default_microbatches("Interleaved1F1B", 4, 2) == 4
    with pytest.raises(ConfigError, match=r"8 stages .* only 6 blocks"):
        Layout(1, -1, 1, 1, 1, False, 4, pp=4, pp_schedule="Interleaved1F1B").check_stages(6, 1)
