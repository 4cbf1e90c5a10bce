"""The table of schedule facts (trainer/config/schedules.py): every schedule torch's runtime
offers has a complete record that agrees with torch, and an unknown schedule is refused, with the
lookup's one message, by the estimator, the step-time model and the pre-launch check."""

import dataclasses
import inspect
import math

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from trainer.config import ConfigError, load_config
from trainer.config.check import main
from trainer.config.pipeline_layout import PipelinePlan, schedule_problems, stage_ranks
from trainer.config.schedules import PP_SCHEDULES, SCHEDULES, ZERO_BUBBLE_SCHEDULES, schedule_facts
from trainer.planning.memory import estimate
from trainer.planning.step_time import bubble_fraction


def test_every_torch_schedule_has_a_record_that_agrees_with_torch():
    offered = {
        name
        for name, cls in vars(torch_schedules).items()
        if name.startswith("Schedule") and inspect.isclass(cls) and issubclass(cls, torch_schedules._PipelineSchedule)
    }
    assert {s.torch_class for s in SCHEDULES} == offered
    assert PP_SCHEDULES == tuple(s.name for s in SCHEDULES) and len(set(PP_SCHEDULES)) == len(SCHEDULES)
    for s in SCHEDULES:
        cls = getattr(torch_schedules, s.torch_class)
        assert torch_schedules.get_schedule_class(s.name) is cls
        # torch's single-stage schedules take one stage, the others a list of them.
        assert issubclass(cls, torch_schedules.PipelineScheduleSingle) == (s.family == "single"), s.name
        for pp in (2, 3):
            n_stages = pp * s.stages_per_rank
            style = "v" if s.v_shaped else "loop"
            torch_ranks = torch_schedules.generate_stage_to_rank_mapping(pp, n_stages, style=style)
            assert stage_ranks(s.name, pp, n_stages) == tuple(torch_ranks[i] for i in range(n_stages)), s.name


def test_every_record_is_complete_and_its_formulas_evaluate():
    for s in SCHEDULES:
        for f in dataclasses.fields(s):
            value = getattr(s, f.name)
            # Only a split-backward schedule leaves its warm-up unmodelled (the record's doc).
            assert (value is not None or (f.name == "warmup" and s.split_backward)) and value != "", (s.name, f.name)
        assert s is schedule_facts(s.name)
        assert s.family in ("single", "looped", "V")
        assert s.stages_per_rank == {"single": 1, "looped": 2, "V": 2}[s.family]
        assert s.compile == (not s.split_backward) == (s.name not in ZERO_BUBBLE_SCHEDULES)
        for pp, v in [(pp, v) for pp in (2, 3, 4) for v in (s.planned_stages_per_rank or (s.stages_per_rank,))]:
            least = s.min_microbatches(pp, v)
            assert least >= pp
            for m in (least, 2 * least):
                assert schedule_problems(s.name, pp, v, m) == [], (s.name, pp, v, m)
                for rank in range(pp):
                    assert 0 < s.in_flight(pp, m, v, rank) <= m, (s.name, pp, v, m, rank)
                    if s.warmup is not None:  # the warm-up's forwards hold at least what is in flight
                        assert s.in_flight(pp, m, v, rank) <= s.warmup(pp, m, v, rank) <= m, (s.name, pp, v, m, rank)
                bubble = s.bubble(pp, v, m, 1.0, 1.2, 0.8)
                assert math.isfinite(bubble) and 0.0 <= bubble <= (pp - 1) / m, (s.name, pp, v, m)
            assert schedule_problems(s.name, pp, v, least - 1), (s.name, pp, v)


def test_an_unknown_schedule_is_refused_with_the_lookups_message(capsys, tmp_path):
    with pytest.raises(ConfigError) as lookup:
        schedule_facts("Looped")
    message = str(lookup.value)
    assert message.startswith("parallelism.pp_schedule = 'Looped'") and all(n in message for n in PP_SCHEDULES)
    # The estimator and the step-time model take a PipelinePlan, which refuses it on construction.
    with pytest.raises(ConfigError) as refused:
        estimate("debugmodel", 1, 1, 1, 1, 32, 2, "none", pipeline=PipelinePlan(pp=2, pp_schedule="Looped"))
    assert str(refused.value) == message
    with pytest.raises(ConfigError) as refused:
        bubble_fraction(PipelinePlan(2, "Looped", 2, 4), 0.6)
    assert str(refused.value) == message
    # The config and the pre-launch check: the same line.
    with pytest.raises(ConfigError) as refused:
        load_config(["--parallelism.pp", "2", "--parallelism.pp_schedule", "Looped"])
    assert str(refused.value) == message
    argv = ["--world-size", "2", "--job.dump_folder", str(tmp_path / "run"), "--parallelism.pp", "2"]
    assert main([*argv, "--parallelism.pp_schedule", "Looped"]) == 2
    assert capsys.readouterr().err == f"config error: {message}\n"
