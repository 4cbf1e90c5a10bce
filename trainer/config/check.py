"""The pre-launch check: `python -m trainer.config.check --world-size N [options as for trainer.train]`.

`run_train.sh` runs it before starting any process, so a config that cannot run (a typo, a layout
whose degrees do not fit NNODES x NGPU, a sequence the TP/CP splits do not divide, a dump folder
that cannot be created) fails in a second with one `config error: ...` line and exit code 2,
instead of in every rank's traceback. The workers run the same checks again (`Layout.from_job`,
`trainer.run_folder.open_run_folder`). Torch-free.
"""

from __future__ import annotations

import sys

from trainer.config.fields import ConfigError
from trainer.config.layout import Layout
from trainer.config.loader import load_config
from trainer.run_folder import check_dump_folder

USAGE = "usage: python -m trainer.config.check --world-size N [--section.key VALUE ...]"


def check_job(argv: list[str], world_size: int) -> None:
    cfg = load_config(argv)
    Layout.from_job(cfg, world_size)
    check_dump_folder(cfg.job.dump_folder)


def _split_world_size(argv: list[str]) -> tuple[int, list[str]]:
    rest, world = [], None
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--world-size" and i + 1 < len(argv):
            world, i = argv[i + 1], i + 2
        elif token.startswith("--world-size="):
            world, i = token.partition("=")[2], i + 1
        else:
            rest.append(token)
            i += 1
    if world is None or not world.isdigit() or int(world) < 1:
        raise SystemExit(f"{USAGE}\n--world-size must be a positive integer (NNODES x NGPU), got {world!r}")
    return int(world), rest


def main(argv: list[str] | None = None) -> int:
    world_size, rest = _split_world_size(sys.argv[1:] if argv is None else list(argv))
    try:
        check_job(rest, world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
