"""Engram: compression, hashing (against the paper's formula written out here), module, wiring."""

import dataclasses
import math

import pytest
import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import (
    Engram,
    EngramArgs,
    NgramHasher,
    TokenCompression,
    build_token_compression,
    engram_table_params,
    find_primes,
    hash_multipliers,
    normalize_token_text,
)

pytestmark = pytest.mark.numerics  # docs/numerics.md

INT64_MAX = 2**63 - 1


# ----------------------------------------------------------------------------- compression
def test_normalize_token_text():
    assert normalize_token_text(" Héllo") == "hello"
    assert normalize_token_text("ＡＢＣ") == "abc"  # NFKC folds full-width forms
    assert normalize_token_text("ﬁ") == "fi"  # NFKC ligature
    assert normalize_token_text("  A \t\n b  ") == "a b"
    assert normalize_token_text("Ñ") == "n"


def test_compression_first_appearance_order_and_pad():
    vocab = ["<pad>", "The", " the", "THE", "é", "e", " ", "\n", "\ufffd", "\ufffd", "cat", " Cat "]
    comp = build_token_compression(lambda i: vocab[i], len(vocab), pad_id=0)
    # <pad>:0  the:1 (The, the, THE)  e:2 (é, e)  " ":3  "\n":4  two fragments: 5, 6  cat:7
    assert comp.lookup.tolist() == [0, 1, 1, 1, 2, 2, 3, 4, 5, 6, 7, 7]
    assert comp.num_compressed == 8
    assert comp.pad_id == 0
    assert comp(torch.tensor([[3, 11], [5, 0]])).tolist() == [[1, 7], [2, 0]]


def test_compression_of_bundled_tokenizer_is_deterministic():
    from trainer.data import build_tokenizer

    tok = build_tokenizer("assets/tokenizer/shakespeare.tiktoken")
    a = build_token_compression(lambda i: tok.decode([i]), tok.vocab_size, tok.pad_id)
    b = build_token_compression(lambda i: tok.decode([i]), tok.vocab_size, tok.pad_id)
    assert torch.equal(a.lookup, b.lookup) and a.num_compressed == b.num_compressed
    assert a.num_compressed < tok.vocab_size
    assert int(a.lookup.max()) == a.num_compressed - 1
    # first-appearance order: the first occurrence of canonical id c is after that of c - 1
    first = [tok.vocab_size] * a.num_compressed
    for raw, c in enumerate(a.lookup.tolist()):
        first[c] = min(first[c], raw)
    assert first == sorted(first)


# ----------------------------------------------------------------------------- primes / multipliers
def test_primes_walk_layers_orders_heads():
    args = EngramArgs(layer_ids=(0, 2), max_ngram=3, heads_per_order=2, base_size=10, head_dim=4)
    assert find_primes(args) == {0: [11, 13, 17, 19], 2: [23, 29, 31, 37]}
    args = EngramArgs(layer_ids=(1,), max_ngram=2, heads_per_order=3, base_size=7, head_dim=4)
    assert find_primes(args) == {1: [7, 11, 13]}  # the base itself counts when prime


def test_primes_and_multipliers_identical_across_constructions():
    args = EngramArgs(layer_ids=(1, 5, 9), max_ngram=4, heads_per_order=3, base_size=1000, head_dim=4, seed=7)
    p1, p2 = find_primes(args), find_primes(dataclasses.replace(args))
    assert p1 == p2
    flat = [p for ps in p1.values() for p in ps]
    assert len(set(flat)) == len(flat) and min(flat) >= 1000
    m1, m2 = hash_multipliers(args, 6113), hash_multipliers(args, 6113)
    half = (INT64_MAX // 6113) // 2
    for layer in args.layer_ids:
        assert torch.equal(m1[layer], m2[layer])
        assert all(m % 2 == 1 and 1 <= m <= 2 * (half - 1) + 1 for m in m1[layer].tolist())
    assert not torch.equal(m1[1], m1[5])
    assert not torch.equal(hash_multipliers(dataclasses.replace(args, seed=8), 6113)[1], m1[1])


# ----------------------------------------------------------------------------- hashing vs formula
def reference_hash(tokens, lookup, pad_raw, args, num_compressed):
    """The paper's formula in plain Python integers (no overflow possible, so any int64 wrap in
    the implementation would show up as a mismatch)."""
    x = [[lookup[t] for t in row] for row in tokens]
    pad = lookup[pad_raw]
    primes = find_primes(args)
    mults = {l: m.tolist() for l, m in hash_multipliers(args, num_compressed).items()}
    n_max, k_heads = args.max_ngram, args.heads_per_order
    out = []
    for row in x:
        out_row = []
        for t in range(len(row)):
            per_layer = []
            for l in args.layer_ids:
                offset, heads = 0, []
                for n in range(2, n_max + 1):
                    mix = 0
                    for j in range(n):
                        tok = row[t - j] if t - j >= 0 else pad
                        prod = tok * mults[l][j]
                        assert prod <= INT64_MAX
                        mix ^= prod
                    for k in range(k_heads):
                        p = primes[l][(n - 2) * k_heads + k]
                        heads.append(mix % p + offset)
                        offset += p
                per_layer.append(heads)
            out_row.append(per_layer)
        out.append(out_row)
    return out


def test_hashing_equals_formula():
    # raw vocab of 9 ids; ids 2/3 and 5/6 share canonical ids; raw 8 is the pad. |V'| = 7 lets
    # the multipliers reach INT64_MAX // 7 // 2, so the products come close to INT64_MAX.
    lookup = [0, 1, 2, 2, 3, 4, 4, 5, 6]
    comp = TokenCompression(lookup=torch.tensor(lookup), num_compressed=7, pad_id=6)
    args = EngramArgs(layer_ids=(0, 3), max_ngram=4, heads_per_order=3, base_size=5, head_dim=2, seed=3)
    tokens = [[1, 2, 3, 1, 2, 3, 5, 6, 7, 7], [8, 8, 0, 4, 4, 4, 1, 2, 6, 5]]
    got = NgramHasher(args, comp)(torch.tensor(tokens))
    assert got.shape == (2, 10, 2, 9) and got.dtype == torch.int64
    assert got.tolist() == reference_hash(tokens, lookup, 8, args, 7)
    # Same canonical n-grams, same rows (raw 2 and 3 are one canonical token).
    k = args.heads_per_order
    assert torch.equal(got[0, 1, :, :k], got[0, 4, :, :k])  # order-2 heads of "1 2"
    assert torch.equal(got[0, 2, :, : 2 * k], got[0, 5, :, : 2 * k])  # "2 3" and "1 2 3"
    # A pipeline stage's hasher: its layers' slots, hashed as the whole set hashes them.
    assert torch.equal(NgramHasher(args, comp, layer_ids=(3,))(torch.tensor(tokens)), got[:, :, 1:])
    for bad in ((3, 0), (1,), ()):
        with pytest.raises(ValueError, match="ascending subset"):
            NgramHasher(args, comp, layer_ids=bad)


def test_hashing_large_vocab_int64_safe():
    v = 50_000
    lookup = torch.arange(v)
    comp = TokenCompression(lookup=lookup, num_compressed=v, pad_id=0)
    args = EngramArgs(layer_ids=(2,), max_ngram=3, heads_per_order=2, base_size=100_003, head_dim=2, seed=11)
    tokens = torch.randint(0, v, (3, 17), generator=torch.Generator().manual_seed(0))
    tokens[0, :4] = v - 1
    got = NgramHasher(args, comp)(tokens)
    assert got.tolist() == reference_hash(tokens.tolist(), lookup.tolist(), 0, args, v)
    assert int(got.min()) >= 0 and int(got.max()) < sum(find_primes(args)[2])


# ----------------------------------------------------------------------------- module
def _engram_args(**kw):
    base = dict(layer_ids=(1,), max_ngram=3, heads_per_order=2, base_size=31, head_dim=4, seed=0)
    return EngramArgs(**{**base, **kw})


def test_engram_module_matches_formula():
    torch.manual_seed(0)
    args = _engram_args()
    dim = 8
    m = Engram(1, dim, args)
    m.init_weights(0.02)
    torch.nn.init.normal_(m.conv.weight, std=0.5)  # non-zero conv, to check it too
    h = torch.randn(2, 12, dim)
    ids = torch.randint(0, m.table.num_rows, (2, 12, args.num_heads))
    rows = m.table.weight[ids]
    y = m(h, rows)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    e = rows.flatten(-2)
    k, v = e @ m.wk.weight.T, e @ m.wv.weight.T
    s = (rms(h, m.query_norm.weight) * rms(k, m.key_norm.weight)).sum(-1) / math.sqrt(dim)
    s = torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6))
    value = torch.sigmoid(s).unsqueeze(-1) * v
    vn = rms(value, m.conv_norm.weight)
    conv = torch.zeros_like(vn)
    w = m.conv.weight[:, 0, :]  # [dim, kernel]; tap i reads position t - (kernel - 1 - i) * N
    for t in range(12):
        for i in range(args.kernel_size):
            src = t - (args.kernel_size - 1 - i) * args.max_ngram
            if src >= 0:
                conv[:, t] += vn[:, src] * w[:, i]
    torch.testing.assert_close(y, value + torch.nn.functional.silu(conv), rtol=1e-5, atol=1e-6)
    mean, std = m.pop_gate_stats()
    torch.testing.assert_close(mean, float(torch.sigmoid(s).mean().detach()), rtol=1e-5, atol=1e-6)
    assert math.isnan(m.pop_gate_stats()[0])  # reset


def test_conv_zero_init_gives_gated_value():
    args = _engram_args()
    m = Engram(1, 8, args)
    m.init_weights(0.02)
    assert torch.count_nonzero(m.conv.weight) == 0
    h = torch.randn(1, 5, 8)
    rows = m.table.weight[torch.randint(0, m.table.num_rows, (1, 5, args.num_heads))]
    e = rows.flatten(-2)
    y = m(h, rows)
    ratio = y / (e @ m.wv.weight.T)  # alpha per token, same across channels
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), atol=1e-5)


def _model(engram: EngramArgs | None, n_layers=3):
    args = dataclasses.replace(get_flavor("debugmodel"), n_layers=n_layers, max_seq_len=32, mtp_depth=0,
                               engram=engram, vocab_size=64, eos_id=0)
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model


def _hasher(engram, vocab=64, layer_ids=None):
    comp = TokenCompression(lookup=torch.arange(vocab) // 2, num_compressed=vocab // 2, pad_id=0)
    return NgramHasher(engram, comp, layer_ids)


def test_model_wiring_causal_and_grads():
    engram = _engram_args(layer_ids=(0, 2))
    model = _model(engram)
    assert [i for i, b in model.layers.items() if b.engram is not None] == ["0", "2"]
    hasher = _hasher(engram)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="engram_ids"):
        model(tokens)
    with pytest.raises(ValueError, match="layer slots"):
        model(tokens, engram_ids=_hasher(engram, layer_ids=(2,))(tokens))
    ids = hasher(tokens)
    out = model(tokens, engram_ids=ids)
    out.logits.float().pow(2).mean().backward()
    for p in engram_table_params(model):
        assert p.grad is not None and p.grad.abs().sum() > 0
    # Causality through hashing, table and conv: a change at t leaves positions < t alone.
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 3) % 64
    with torch.no_grad():
        a = model(tokens, engram_ids=ids).logits
        b = model(changed, engram_ids=hasher(changed)).logits
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_parallel_step_hashes_for_the_engram_layers_it_holds():
    from trainer.config import load_config
    from trainer.parallel import ParallelDims, ParallelStep

    engram = _engram_args(layer_ids=(0, 2))
    model = _model(engram)
    dims = ParallelDims.from_config(load_config([]).parallelism, 1)
    for hasher in (None, _hasher(engram, layer_ids=(0,))):
        with pytest.raises(ValueError, match=r"covers layers .* holds Engram layers \[0, 2\]"):
            ParallelStep(model, dims, engram_hasher=hasher)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    full_ids = _hasher(engram)(tokens)
    # A pipeline stage holding blocks 1 and 2 hashes for block 2 only.
    del model.layers["0"]
    assert model.engram_layer_ids == (2,)
    step = ParallelStep(model, dims, engram_hasher=_hasher(engram, layer_ids=(2,)))
    mb = step.prepare_batch(tokens, tokens)
    assert torch.equal(mb.model_kwargs["engram_ids"], full_ids[:, :, 1:])
    assert model(mb.inputs, **mb.model_kwargs).logits.shape == (2, 16, 64)


def test_engram_off_is_the_plain_model():
    model = _model(None)
    assert all(b.engram is None for b in model.layers.values())
    assert model.engram_layer_ids == ()
    assert not any("engram" in name for name, _ in model.named_parameters())


def test_table_init_independent_of_sharding():
    from models.engram import EngramTable

    full = EngramTable(200_000, 3, init_seed=5)
    full.init_weights()
    part = EngramTable(200_000, 3, init_seed=5)
    part.shard_(70_000, 90_000)
    part.init_weights()
    torch.testing.assert_close(part.weight, full.weight[70_000:160_000], rtol=0, atol=0)


def test_optimizer_group_for_tables():
    from trainer.config import load_config
    from trainer.optim.build import build_optimizer

    cfg = load_config(["--engram.enable", "--engram.layer_ids", "0,2", "--optimizer.lr", "1e-3"])
    model = _model(_engram_args(layer_ids=(0, 2)))
    opt, _ = build_optimizer(model, cfg.optimizer, cfg.engram)
    (group,) = [g for g in opt.param_groups if g.get("engram")]
    assert group["lr"] == pytest.approx(5e-3) and group["weight_decay"] == 0.0
    assert {id(p) for p in group["params"]} == {id(p) for p in engram_table_params(model)}
    others = [p for g in opt.param_groups if not g.get("engram") for p in g["params"]]
    assert len(others) + 2 == len(list(model.parameters()))


def test_param_counts_and_flops_count_looked_up_rows_only():
    from models.deepseek_v3 import count_params, flops_per_token

    engram = _engram_args(layer_ids=(0, 2))
    base = dataclasses.replace(get_flavor("debugmodel"), n_layers=3, max_seq_len=32, mtp_depth=0, vocab_size=64)
    with_engram = dataclasses.replace(base, engram=engram)
    model = _model(engram)
    tables = sum(p.numel() for p in engram_table_params(model))
    rest = sum(p.numel() for n, p in model.named_parameters() if ".engram." in n) - tables
    (t0, a0), (t1, a1) = count_params(base), count_params(with_engram)
    assert t1 - t0 == tables + rest  # every Engram weight is in the total
    assert a1 - a0 == rest + 2 * engram.memory_dim  # a token reads memory_dim table values per layer
    # FLOPs: the projections / conv like any weight, the table lookup like the embedding (none).
    assert flops_per_token(with_engram, 32) - flops_per_token(base, 32) == 6 * rest


def test_hf_names_round_trip_with_engram():
    from models.deepseek_v3 import DeepSeekV3StateDictAdapter
    from models.deepseek_v3.hf_io import args_from_hf_config
    from models.deepseek_v3.state_dict_adapter import to_hf_config

    engram = _engram_args(layer_ids=(0, 2))
    model = _model(engram)
    adapter = DeepSeekV3StateDictAdapter(model.args)
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    table = "model.layers.2.engram.multi_head_embedding.embedding.weight"
    assert torch.equal(hf[table], sd["layers.2.engram.table.weight"])
    assert "model.layers.0.engram.short_conv.norms.0.weight" in hf and "model.layers.1.engram" not in str(hf.keys())
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    config = to_hf_config(model.args)
    assert args_from_hf_config(config, engram=config["engram"]).engram == engram
