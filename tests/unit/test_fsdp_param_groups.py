"""`trainer.parallel.fsdp._param_groups` on both shapes of FSDP2's state: torch 2.13's list of
groups (one per mesh) and torch 2.11's single optional group, which CI's torch never builds."""

from types import SimpleNamespace

from trainer.parallel.fsdp import _param_groups


def test_param_groups_of_torch_2_13_state():
    groups = [object(), object()]
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=groups)) is groups


def test_param_groups_of_torch_2_11_state():
    # torch 2.11's FSDPState has `_fsdp_param_group` (a group or None) and no plural attribute.
    group = object()
    assert _param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
