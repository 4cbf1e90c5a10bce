"""`python -m trainer.config [options]`: print the resolved config as TOML."""

from trainer.config.fields import ConfigError
from trainer.config.loader import load_config

try:
    print(load_config().to_toml(), end="")
except ConfigError as e:
    raise SystemExit(f"config error: {e}") from None
