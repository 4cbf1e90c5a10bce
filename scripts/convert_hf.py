"""Convert between Hugging Face / DeepSeek safetensors checkpoints and this trainer's DCP checkpoints.

    # HF folder (config.json + *.safetensors, bf16/fp32 or DeepSeek FP8 with block scales) -> DCP
    python scripts/convert_hf.py import path/to/DeepSeek-V3 outputs/dsv3_dcp [--max-seq-len 4096]
    # then train from it:  --checkpoint.initial_load_path outputs/dsv3_dcp
    # (or skip the conversion: --checkpoint.initial_load_path path/to/hf --checkpoint.initial_load_format hf)

    # a checkpoint of ours (a step-N folder, or a folder of them: the newest) -> HF folder
    python scripts/convert_hf.py export outputs/run/checkpoint/step-1000 outputs/hf [--dtype bfloat16]
    # its parameter EMA (a run with --ema.enable) instead of the trained weights
    python scripts/convert_hf.py export outputs/run/checkpoint/step-1000 outputs/hf_ema --ema

`--max-seq-len` only shortens the rope table: YaRN and the softmax scale stay those of the
config's `rope_scaling` (the released weights compute the same function at any length).

The export writes `model-0000i-of-0000n.safetensors` shards, `model.safetensors.index.json` and a
`config.json` from `to_hf_config`, loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
Both directions hold the whole model in CPU memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models.deepseek_v3 import DeepSeekV3StateDictAdapter
from models.deepseek_v3.hf_io import (
    args_from_hf_config,
    read_hf_config,
    read_hf_state_dict,
    write_hf_checkpoint,
)
from models.deepseek_v3.state_dict_adapter import to_hf_config
from trainer.checkpoint import (
    CheckpointError,
    read_model_args,
    read_model_state_dict,
    resolve_checkpoint_path,
    save_model_checkpoint,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str = "float32", **arg_overrides) -> Path:
    """HF folder -> model-only DCP checkpoint at `out_dir`."""
    args = args_from_hf_config(read_hf_config(hf_dir), **arg_overrides)
    native = DeepSeekV3StateDictAdapter(args).from_hf(read_hf_state_dict(hf_dir, dtype=DTYPES[dtype]))
    return save_model_checkpoint(native, out_dir, args)


def export_hf(
    ckpt: str | Path, out_dir: str | Path, dtype: str | None = None, max_shard_gb: float = 5.0,
    load_unverified: bool = False, ema: bool = False,
) -> list[Path]:
    """Our DCP checkpoint -> HF safetensors shards + index + config.json at `out_dir`; ``ema``:
    the checkpoint's parameter EMA as the weights."""
    path = resolve_checkpoint_path(ckpt)
    args = read_model_args(path)
    native = read_model_state_dict(path, load_unverified, ema=ema)
    hf = DeepSeekV3StateDictAdapter(args).to_hf(native)
    return write_hf_checkpoint(
        hf, out_dir, config=to_hf_config(args), max_shard_bytes=int(max_shard_gb * 1024**3),
        dtype=DTYPES[dtype] if dtype else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF safetensors folder -> DCP checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype of the DCP checkpoint")
    imp.add_argument("--max-seq-len", type=int, default=None, help="rope table length (YaRN stays the config's); default: max_position_embeddings")
    exp = sub.add_parser("export", help="DCP checkpoint -> HF safetensors folder")
    exp.add_argument("checkpoint")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights; default: as saved")
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    exp.add_argument("--load-unverified", action="store_true",
                     help="also export a checkpoint whose marker records no checksums (its files are not verified)")
    exp.add_argument("--ema", action="store_true",
                     help="export the parameter EMA (saved by a run with --ema.enable) instead of the trained weights")
    opts = parser.parse_args(argv)
    try:
        if opts.command == "import":
            overrides = {"max_seq_len": opts.max_seq_len} if opts.max_seq_len else {}
            out = import_hf(opts.hf_dir, opts.out_dir, opts.dtype, **overrides)
            print(f"wrote DCP checkpoint {out}")
        else:
            files = export_hf(opts.checkpoint, opts.out_dir, opts.dtype, opts.max_shard_gb, opts.load_unverified,
                               opts.ema)
            print(f"wrote {len(files)} safetensors shard(s), index and config.json to {opts.out_dir}")
    except (FileNotFoundError, CheckpointError, KeyError, ValueError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
