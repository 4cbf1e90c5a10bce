"""docs/continued_pretraining.md end to end with a tiny checkpoint made here: a random
`transformers` DeepseekV3ForCausalLM of the debugmodel flavor's shape (`save_pretrained`),
`convert_hf.py import`, three training steps on a weighted mixture from it, `convert_hf.py
export`, and `transformers` loading the export.

The first step's loss is the cross-entropy that `transformers` computes with the original model
on the mixture's first global batch (fp32, rel 1e-4: attention kernels and sums in another order),
so the run started from the model the user brought; the export holds the trained weights.
The tokenizer is the bundled one (docs/continued_pretraining.md says why).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from in_process import COMMON, metrics_by_step, run_main

from models.deepseek_v3.state_dict_adapter import to_hf_config
from trainer.config import load_config
from trainer.config.data_mix import parse_mixture
from trainer.data import build_tokenizer
from trainer.data.mixture import build_mixture_dataloader
from trainer.model_args import build_model_args

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


def convert(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_hf.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_hf_checkpoint_continues_on_a_mixture_and_exports(tmp_path):
    code = [f"def f{i}(): return " + " ".join(WORDS[i % 9 :]) for i in range(60)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    mix = f"0.7 shakespeare,0.3 json {tmp_path / 'code.jsonl'}"
    # No MTP block (the tiny model has none) and the causal mask of transformers (docs/continued_pretraining.md).
    run = [*COMMON, "--training.steps", "3", "--no-validation.enable", "--training.local_batch_size", "8"]
    run += ["--model.mtp_depth", "0", "--model.attn_mask_type", "causal"]
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *run])
    tok = build_tokenizer(REPO / cfg.model.tokenizer_path)

    # 1. The user's checkpoint: a random model of the debugmodel flavor's shape, saved by transformers.
    config = transformers.DeepseekV3Config(**to_hf_config(build_model_args(cfg, tok.vocab_size, tok.eos_id)))
    torch.manual_seed(0)
    original = transformers.DeepseekV3ForCausalLM(config).eval()
    original.save_pretrained(tmp_path / "hf")
    convert("import", str(tmp_path / "hf"), str(tmp_path / "dcp"))

    # 2. Continued pre-training on the mixture, from the imported weights.
    flags = ["--checkpoint.initial_load_path", str(tmp_path / "dcp"), "--training.dataset_mix", mix]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    assert run_main(tmp_path, "--job.dump_folder", str(tmp_path / "run"), *run, *flags, *ckpt) == 0
    losses = metrics_by_step(tmp_path / "run")

    loader = build_mixture_dataloader(
        tokenizer=tok,
        sources=parse_mixture([m.strip() for m in mix.split(",")]),
        seq_len=cfg.training.seq_len,
        seed=cfg.training.seed,
        batch_size=8,
        global_batch_size=8,
    )
    inputs, labels = next(loader)
    with torch.no_grad():
        logits = original(input_ids=inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    assert abs(losses[1]["loss"] - want) <= 1e-4 * want, (losses[1]["loss"], want)

    # 3. Export, and 4. transformers loads the trained model.
    convert("export", str(tmp_path / "run" / "checkpoint"), str(tmp_path / "out"))
    trained, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"]
    with torch.no_grad():
        out = trained(input_ids=inputs).logits
    assert torch.isfinite(out).all()
    assert not torch.equal(trained.model.embed_tokens.weight, original.model.embed_tokens.weight)
