import dataclasses
import subprocess
import sys
import typing
from dataclasses import dataclass, field

import pytest

from trainer.config import ConfigError, JobConfig, Section, format_help, from_dict, load_config, option, sections_of
from trainer.config.fields import choices_of

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def write(tmp_path, text, name="cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def all_fields(config_cls=JobConfig):
    for section, section_cls in sections_of(config_cls).items():
        for f in dataclasses.fields(section_cls):
            yield section, f


# A section shaped like the future [engram]: exercises list fields and the "one dataclass + one
# line" extension path without adding list fields to the real config.
@dataclass
class ListSection(Section):
    layer_ids: list[int] = option([1, 15], "Layers that get a module")
    names: list[str] = option([], "Names")
    ratios: list[float] | None = option(None, "Optional ratios")


@dataclass
class ExtendedJobConfig(JobConfig):
    extra: ListSection = field(default_factory=ListSection)


# ---------------------------------------------------------------- schema


def test_every_field_has_default_and_help():
    for section, f in all_fields():
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert f.metadata.get("help"), f"{section}.{f.name} has no help text"
        assert "\n" not in f.metadata["help"]


def test_none_able_fields_default_to_none():
    # to_toml drops None values (TOML has no null); round-trip relies on this invariant.
    for section, section_cls in sections_of(JobConfig).items():
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            if type(None) in typing.get_args(hints[f.name]):
                assert f.default is None, f"{section}.{f.name}"


def test_default_choices_are_valid():
    JobConfig().validate()
    for section, section_cls in sections_of(JobConfig).items():
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            choices = choices_of(hints[f.name])
            assert choices is None or f.default in choices, f"{section}.{f.name}"


def test_model_choices_match_the_model_code():
    # models/ keeps its own lists (it never imports trainer/, and the config never imports torch).
    from models.common.attention import ATTN_BACKENDS, ATTN_MASK_TYPES
    from trainer.config import Model

    hints = typing.get_type_hints(Model)
    assert choices_of(hints["attn_backend"]) == ATTN_BACKENDS
    assert choices_of(hints["attn_mask_type"]) == ATTN_MASK_TYPES


def test_defaults_match_contract():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.job.config_file is None
    assert cfg.job.dump_folder == "./outputs"
    assert cfg.model.attn_backend == "sdpa"
    assert cfg.training.global_batch_size == -1
    assert cfg.optimizer.lr == 8e-4
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.parallelism.dp_shard == -1
    assert cfg.activation_checkpoint.mode == "none"
    # torchtitan's: start-up and the first step (compiling) may take minutes, a step's collective not.
    assert (cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds) == (300, 100)
    assert set(sections_of(JobConfig)) == {
        "job", "model", "engram", "training", "optimizer", "lr_scheduler", "metrics", "validation", "checkpoint",
        "ema", "parallelism", "comm", "fault_tolerance", "activation_checkpoint", "profiling", "quantize", "dry_run",
    }


# ---------------------------------------------------------------- precedence


def test_precedence_default_toml_cli(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 20\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "7"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.job.config_file == path


def test_config_alias_and_order_independence(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 20\n")
    # The config file is read first even when named after the overrides.
    for argv in (
        ["--training.steps=3", "--config", path],
        ["--config=" + path, "--training.steps", "3"],
    ):
        cfg = load_config(argv)
        assert cfg.training.steps == 3
        assert cfg.job.config_file == path


def test_last_cli_value_wins():
    assert load_config(["--training.steps", "3", "--training.steps=4"]).training.steps == 4


# ---------------------------------------------------------------- CLI forms


def test_cli_value_forms():
    cfg = load_config([
        "--training.seq_len", "128",
        "--training.global_batch_size", "-1",
        "--optimizer.lr=3e-4",
        "--model.flavor=16B",
        "--job.description", "has spaces = and more",
        "--lr_scheduler.decay_ratio", "0.2",
        "--parallelism.dp_shard=-1",
    ])
    assert cfg.training.seq_len == 128
    assert cfg.optimizer.lr == 3e-4
    assert cfg.model.flavor == "16B"
    assert cfg.job.description == "has spaces = and more"
    assert cfg.lr_scheduler.decay_ratio == 0.2


def test_cli_none_for_optional_fields(tmp_path):
    path = write(tmp_path, '[lr_scheduler]\ndecay_ratio = 0.1\n[training]\ndataset_path = "x"\n')
    cfg = load_config(["--config", path, "--lr_scheduler.decay_ratio", "none", "--training.dataset_path=NULL"])
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.training.dataset_path is None


def test_cli_none_is_a_plain_string_for_required_str():
    assert load_config(["--job.description", "none"]).job.description == "none"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.compile"], True),
        (["--training.compile=true"], True),
        (["--training.compile=1"], True),
        (["--training.compile=yes"], True),
        (["--training.compile", "True"], True),
        (["--training.compile=false"], False),
        (["--training.compile=0"], False),
        (["--training.compile=no"], False),
        (["--training.compile", "false"], False),
        (["--no-training.compile"], False),
    ],
)
def test_cli_bool_forms(argv, expected):
    assert load_config(argv).training.compile is expected


def test_bare_bool_flag_does_not_swallow_next_option():
    cfg = load_config(["--training.compile", "--training.steps", "5"])
    assert cfg.training.compile is True
    assert cfg.training.steps == 5


@pytest.mark.parametrize("off", [["--no-training.compile"], ["--training.compile=false"], ["--training.compile", "0"]])
def test_cli_turns_off_bool_set_by_toml(tmp_path, off):
    path = write(tmp_path, "[training]\ncompile = true\n")
    assert load_config(["--config", path]).training.compile is True
    assert load_config(["--config", path, *off]).training.compile is False


def test_cli_turns_on_bool_default_true_off_and_on():
    assert load_config(["--no-validation.enable"]).validation.enable is False
    assert load_config(["--no-validation.enable", "--validation.enable"]).validation.enable is True


def test_cli_lists():
    cfg = load_config(
        ["--extra.layer_ids", "2, 5,9", "--extra.names=a,b", "--extra.ratios", "0.5,1"],
        config_cls=ExtendedJobConfig,
    )
    assert cfg.extra.layer_ids == [2, 5, 9]
    assert cfg.extra.names == ["a", "b"]
    assert cfg.extra.ratios == [0.5, 1.0]
    assert load_config(["--extra.layer_ids="], config_cls=ExtendedJobConfig).extra.layer_ids == []
    assert load_config(["--extra.ratios=none"], config_cls=ExtendedJobConfig).extra.ratios is None


def test_list_defaults_are_not_shared():
    a, b = ExtendedJobConfig(), ExtendedJobConfig()
    a.extra.layer_ids.append(99)
    assert b.extra.layer_ids == [1, 15]


def test_toml_lists(tmp_path):
    path = write(tmp_path, '[extra]\nlayer_ids = [3, 4]\nnames = ["x"]\nratios = [1, 2.5]\n')
    cfg = load_config(["--config", path], config_cls=ExtendedJobConfig)
    assert cfg.extra.layer_ids == [3, 4]
    assert cfg.extra.names == ["x"]
    assert cfg.extra.ratios == [1.0, 2.5]


def test_bad_list_element():
    with pytest.raises(ConfigError, match=r"--extra\.layer_ids must be list\[int\].*'1,x'"):
        load_config(["--extra.layer_ids", "1,x"], config_cls=ExtendedJobConfig)


def test_bad_toml_list(tmp_path):
    path = write(tmp_path, '[extra]\nlayer_ids = [1, "a"]\n')
    with pytest.raises(ConfigError, match=r"extra\.layer_ids must be list\[int\]"):
        load_config(["--config", path], config_cls=ExtendedJobConfig)


# ---------------------------------------------------------------- errors


def error(argv, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, **kwargs)
    return str(info.value)


def test_unknown_cli_key():
    msg = error(["--training.stpes", "5"])
    assert "--training.stpes" in msg
    assert "did you mean --training.steps?" in msg
    assert "seq_len" in msg  # the section's valid keys


def test_unknown_cli_section():
    msg = error(["--trainig.steps=5"])
    assert "--trainig.steps" in msg
    assert "did you mean --training.steps?" in msg
    assert "Valid sections:" in msg and "lr_scheduler" in msg


def test_unknown_cli_option_without_section():
    msg = error(["--stpes", "5"])
    assert "did you mean --training.steps?" in msg


def test_positional_argument_rejected():
    assert "unexpected argument 'train.toml'" in error(["train.toml"])


def test_unknown_toml_section(tmp_path):
    path = write(tmp_path, "[trainig]\nsteps = 5\n")
    msg = error(["--config", path])
    assert path in msg
    assert "unknown section [trainig]" in msg
    assert "did you mean [training]?" in msg
    assert "activation_checkpoint" in msg


def test_unknown_toml_key(tmp_path):
    path = write(tmp_path, "[training]\nstpes = 5\n")
    msg = error(["--config", path])
    assert "unknown key training.stpes" in msg
    assert "did you mean training.steps?" in msg
    assert "local_batch_size" in msg


def test_toml_key_outside_section(tmp_path):
    path = write(tmp_path, "steps = 5\n")
    msg = error(["--config", path])
    assert "key 'steps' is outside any [section]" in msg
    assert "did you mean training.steps?" in msg


def test_toml_scalar_where_table_expected(tmp_path):
    path = write(tmp_path, "training = 5\n")
    assert "'training' must be a [training] table" in error(["--config", path])


@pytest.mark.parametrize(
    "toml, expected",
    [
        ('[training]\nsteps = "ten"\n', "training.steps must be int, got str 'ten'"),
        ("[training]\nsteps = 1.5\n", "training.steps must be int, got float 1.5"),
        ("[training]\nsteps = true\n", "training.steps must be int, got bool True"),
        ('[training]\ncompile = "yes"\n', "training.compile must be bool, got str 'yes'"),
        ("[optimizer]\nlr = true\n", "optimizer.lr must be float, got bool True"),
        ("[model]\nattn_backend = 1\n", "model.attn_backend must be str, one of sdpa, flex, got int 1"),
        ("[lr_scheduler]\ndecay_ratio = \"half\"\n", "lr_scheduler.decay_ratio must be float or none"),
    ],
)
def test_toml_wrong_type(tmp_path, toml, expected):
    assert expected in error(["--config", write(tmp_path, toml)])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "abc"], "--training.steps must be int, got 'abc'"),
        (["--training.steps=1.5"], "--training.steps must be int, got '1.5'"),
        (["--optimizer.lr", "fast"], "--optimizer.lr must be float, got 'fast'"),
        (["--training.compile=maybe"], "--training.compile must be bool, got 'maybe'"),
        (["--lr_scheduler.decay_ratio", "x"], "--lr_scheduler.decay_ratio must be float or none, got 'x'"),
    ],
)
def test_cli_wrong_type(argv, expected):
    assert expected in error(argv)


def test_choice_error_from_cli():
    msg = error(["--model.attn_backend", "flexx"])
    assert "model.attn_backend = 'flexx'" in msg
    assert "sdpa, flex" in msg
    assert "did you mean 'flex'?" in msg


def test_choice_error_from_toml(tmp_path):
    path = write(tmp_path, '[optimizer]\nname = "adamw"\n')
    msg = error(["--config", path])
    assert "optimizer.name = 'adamw'" in msg and "AdamW, Adam" in msg


def test_missing_value():
    for argv in (["--training.steps"], ["--training.steps", "--training.seq_len", "4"], ["--config"]):
        msg = error(argv)
        assert "needs a value" in msg
        assert "--training.steps" in msg or "--job.config_file" in msg


def test_negating_non_bool():
    msg = error(["--no-training.steps"])
    assert "only boolean options can be negated" in msg and "--training.steps" in msg


def test_negation_with_value():
    assert "takes no value" in error(["--no-training.compile=true"])


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    msg = error(["--config", path])
    assert "config file not found" in msg and path in msg


def test_unreadable_config_file(tmp_path):
    msg = error(["--config", str(tmp_path)])  # a directory
    assert "cannot read config file" in msg and str(tmp_path) in msg


def test_toml_syntax_error(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 5\nseq_len = = 3\n')
    msg = error(["--config", path])
    assert "TOML syntax error" in msg and path in msg and "line 3" in msg


# ---------------------------------------------------------------- validate()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "0"], "training.steps must be a positive integer"),
        (["--training.seq_len", "-5"], "training.seq_len must be a positive integer"),
        (["--training.local_batch_size", "0"], "training.local_batch_size must be a positive integer"),
        (["--training.global_batch_size", "12"], "must be -1 or a positive multiple of training.local_batch_size (8)"),
        (["--training.global_batch_size", "0"], "training.global_batch_size must be -1 or a positive multiple"),
        (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be in [0, 1]"),
        (["--lr_scheduler.min_lr_factor", "-0.1"], "lr_scheduler.min_lr_factor must be in [0, 1]"),
        (["--metrics.log_freq", "0"], "metrics.log_freq must be >= 1"),
        (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k must be >= 0"),
        (["--parallelism.tp", "0"], "parallelism.tp must be >= 1"),
        (["--parallelism.dp_shard", "0"], "parallelism.dp_shard must be >= 1, or -1"),
        (["--parallelism.ep_as_cp"], "parallelism.ep_as_cp needs parallelism.ep > 1"),
        (["--model.mtp_loss_weight", "-1"], "model.mtp_loss_weight must be >= 0"),
        (["--optimizer.lr", "0"], "optimizer.lr must be > 0"),
        (["--optimizer.beta2", "1"], "optimizer.beta2 must be in [0, 1)"),
        (["--activation_checkpoint.selective_every", "0"], "activation_checkpoint.selective_every must be >= 1"),
        (
            ["--activation_checkpoint.mode", "modules", "--activation_checkpoint.recompute_modules", "layernorm,mla"],
            "activation_checkpoint.recompute_modules: unknown 'mla'; valid: layernorm, mla_up_proj, core_attn, moe_act, "
            "mlp, shared_experts, moe, deepseek, megatron_dsv3.",
        ),
        (
            ["--activation_checkpoint.mode", "modules", "--activation_checkpoint.recompute_modules", ""],
            "activation_checkpoint.recompute_modules is empty in modules mode",
        ),
        (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds must be a number of seconds > 0, got 0.0"),
        (["--comm.train_timeout_seconds", "-5"], "comm.train_timeout_seconds must be a number of seconds > 0"),
        (["--comm.train_timeout_seconds", "inf"], "comm.train_timeout_seconds must be a number of seconds > 0"),
    ],
)
def test_validate(argv, expected):
    assert expected in error(argv)


def test_validate_accepts_valid_combos():
    cfg = load_config([
        "--training.global_batch_size", "32", "--parallelism.ep", "4", "--parallelism.ep_as_cp",
        "--lr_scheduler.decay_ratio", "1", "--checkpoint.keep_latest_k", "0",
    ])
    assert cfg.parallelism.ep_as_cp


def test_validate_reports_all_problems_at_once():
    msg = error(["--training.steps", "0", "--metrics.log_freq", "0", "--model.attn_backend", "x"])
    assert "training.steps" in msg and "metrics.log_freq" in msg and "model.attn_backend" in msg


def test_new_section_brings_its_own_checks():
    @dataclass
    class Checked(Section):
        n: int = option(1, "A count")

        def problems(self):
            return [] if self.n > 0 else [f"checked.n must be > 0, got {self.n}."]

    @dataclass
    class CheckedJobConfig(JobConfig):
        checked: Checked = field(default_factory=Checked)

    assert load_config(["--checked.n", "3"], config_cls=CheckedJobConfig).checked.n == 3
    assert "checked.n must be > 0, got 0" in error(["--checked.n", "0"], config_cls=CheckedJobConfig)


def test_choices_come_from_the_literal_type(tmp_path):
    @dataclass
    class Picked(Section):
        kind: typing.Literal["red", "green"] = option("red", "A colour")
        maybe: typing.Literal["a", "b"] | None = option(None, "An optional choice")

    @dataclass
    class PickedJobConfig(JobConfig):
        picked: Picked = field(default_factory=Picked)

    assert "--picked.kind  {red,green}  (default: red)" in format_help(PickedJobConfig)
    assert load_config(["--picked.kind", "green", "--picked.maybe", "b"], config_cls=PickedJobConfig).picked.maybe == "b"
    assert error(["--picked.kind", "gren"], config_cls=PickedJobConfig) == (
        "picked.kind = 'gren' is not allowed; choose one of red, green; did you mean 'green'?"
    )
    path = write(tmp_path, "[picked]\nkind = 3\n")
    assert "picked.kind must be str, one of red, green, got int 3" in error(["--config", path], config_cls=PickedJobConfig)


def test_removed_options_are_unknown_keys(tmp_path):
    path = write(tmp_path, '[engram]\nmesh_name = "engram"\n')
    msg = error(["--config", path])
    assert f"{path}: unknown key engram.mesh_name was removed (the Engram table's mesh" in msg and "drop it" in msg
    msg = error(["--parallelism.expert_parallel_comm_backend", "deepep"])
    assert msg.startswith("unknown option --parallelism.expert_parallel_comm_backend was removed (the all-to-all")
    assert "did you mean" not in msg and "Valid keys in [parallelism]" in msg


def test_validate_on_direct_construction():
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "fp16"
    with pytest.raises(ConfigError, match="bfloat16, float32"):
        cfg.validate()


# ---------------------------------------------------------------- help


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--training.steps", "5", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for section, f in all_fields():
        assert f"[{section}]" in out
        assert f"--{section}.{f.name}" in out
        assert f.metadata["help"] in out
    assert "--no-training.compile" in out
    assert "{sdpa,flex}" in out
    assert "(default: 1000)" in out and "(default: none)" in out


def test_short_help_and_help_wins_over_bad_options(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--training.stpes", "-h"])
    assert info.value.code == 0
    assert "--training.steps" in capsys.readouterr().out


def test_help_includes_new_sections():
    out = format_help(ExtendedJobConfig)
    assert "[extra]" in out and "--extra.layer_ids  list[int]  (default: 1,15)" in out


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom trainer.config import load_config\n"
        "try:\n    load_config(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ---------------------------------------------------------------- serialisation


def customised() -> JobConfig:
    return load_config([
        "--training.steps", "12", "--training.compile", "--no-validation.enable",
        "--optimizer.lr", "1e-3", "--lr_scheduler.decay_ratio", "0.25",
        "--training.dataset", "json", "--training.dataset_path", "/data/x", "--job.description", "round trip",
        "--parallelism.ep", "2", "--parallelism.ep_as_cp",
    ])


def test_to_dict():
    d = customised().to_dict()
    assert d["training"]["steps"] == 12
    assert d["lr_scheduler"]["decay_ratio"] == 0.25
    assert d["job"]["config_file"] is None
    assert from_dict(d) == customised()


def test_to_toml_omits_none_and_parses():
    text = JobConfig().to_toml()
    data = tomllib.loads(text)
    assert "config_file" not in data["job"]
    assert "decay_ratio" not in data["lr_scheduler"]
    assert data["training"]["steps"] == 1000


def test_toml_round_trip(tmp_path):
    cfg = customised()
    assert from_dict(tomllib.loads(cfg.to_toml())) == cfg

    path = tmp_path / "run" / "config.toml"
    cfg.save_toml(path)
    loaded = load_config(["--config", str(path)])
    assert loaded == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=str(path)))


def test_toml_round_trip_with_lists(tmp_path):
    cfg = load_config(["--extra.layer_ids", "4,8", "--extra.ratios", "0.5"], config_cls=ExtendedJobConfig)
    path = tmp_path / "config.toml"
    cfg.save_toml(path)
    loaded = load_config(["--config", str(path)], config_cls=ExtendedJobConfig)
    assert loaded.extra == cfg.extra


def test_main_prints_resolved_toml(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 20\n")
    out = subprocess.run(
        [sys.executable, "-m", "trainer.config", "--config", path, "--training.seq_len", "64"],
        check=True, capture_output=True, text=True,
    ).stdout
    data = tomllib.loads(out)
    assert data["training"]["steps"] == 20 and data["training"]["seq_len"] == 64
