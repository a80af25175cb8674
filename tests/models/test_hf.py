"""Hugging Face Llama interop against transformers' own LlamaForCausalLM (random init, fp32, CPU)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from megascale.config import AttentionConfig, ModelConfig
from megascale.errors import CheckpointError, ConfigError
from megascale.models.hf import (
    from_hf_state_dict,
    hf_config_of,
    load_hf,
    model_config_from_hf,
    save_hf,
    to_hf_state_dict,
)
from megascale.models.llama import Transformer

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, ATOL = 96, 24, 2, 1e-5

# name -> (heads, kv heads, tied embeddings)
HEAD_LAYOUTS = {"gqa": (4, 2, False), "mha": (4, 4, False), "tied": (4, 1, True)}


def make_hf_model(
    n_heads: int, n_kv_heads: int, tied: bool, rope_scaling: dict | None = None
) -> "transformers.LlamaForCausalLM":
    """A random Llama with perturbed norms; `rope_scaling`: its rope_parameters beside rope_theta."""
    torch.manual_seed(0)
    rope = {"rope_parameters": {**rope_scaling, "rope_theta": 500.0}} if rope_scaling else {}
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
        **rope,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Norm weights start at one; perturb them so a swapped norm mapping would show.
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def layout_config(layout: str, rope_theta: float = 10000.0) -> ModelConfig:
    """A small ModelConfig with the heads and tying of one of HEAD_LAYOUTS."""
    n_heads, n_kv_heads, tied = HEAD_LAYOUTS[layout]
    return ModelConfig(
        dim=64,
        n_layers=2,
        vocab_size=VOCAB,
        max_seq_len=64,
        tie_embeddings=tied,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, rope_theta=rope_theta),
    )


def make_our_model(cfg: ModelConfig, seed: int = 1) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def random_tokens(seed: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def greedy_decode(model: Transformer, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Argmax decoding by recomputing the whole prefix each step (no KV cache)."""
    for _ in range(new_tokens):
        next_token = model(tokens)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@torch.no_grad()
def test_import_matches_transformers_logits(layout):
    hf_model = make_hf_model(*HEAD_LAYOUTS[layout])
    cfg = model_config_from_hf(hf_model.config.to_dict())
    assert (cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.tie_embeddings) == HEAD_LAYOUTS[layout]
    assert cfg.attention.rope_theta == 500.0 and cfg.ffn_dim == 80 and cfg.norm_eps == 1e-5

    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    tokens = random_tokens()
    expected = hf_model(tokens).logits
    assert (ours(tokens) - expected).abs().max().item() < ATOL


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_export_then_import_is_lossless(layout, tmp_path):
    cfg = layout_config(layout, rope_theta=1234.0)
    tied = cfg.tie_embeddings
    state_dict = make_our_model(cfg).state_dict()
    save_hf(state_dict, cfg, tmp_path)

    loaded_cfg, loaded = load_hf(tmp_path)
    assert loaded_cfg == cfg
    assert loaded.keys() == state_dict.keys()
    for key, tensor in state_dict.items():
        assert torch.equal(loaded[key], tensor), key
    if tied:
        assert "lm_head.weight" not in to_hf_state_dict(state_dict, cfg)


def test_explicit_ffn_dim_round_trips(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=1, vocab_size=VOCAB, ffn_dim=100, norm_eps=1e-6, init_std=0.01)
    save_hf(make_our_model(cfg).state_dict(), cfg, tmp_path)
    assert load_hf(tmp_path)[0] == cfg


def test_sharded_checkpoint_loads(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=2, vocab_size=VOCAB)
    state_dict = make_our_model(cfg).state_dict()
    hf_sd = {name: tensor.contiguous() for name, tensor in to_hf_state_dict(state_dict, cfg).items()}
    names = sorted(hf_sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: hf_sd[name] for name in shard_names}, tmp_path / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_of(cfg)))

    _, loaded = load_hf(tmp_path)
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state_dict.items())


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@torch.no_grad()
def test_exported_folder_runs_in_transformers(layout, tmp_path):
    cfg = layout_config(layout)
    ours = make_our_model(cfg, seed=3)
    save_hf(ours.state_dict(), cfg, tmp_path)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf_model.config.rope_parameters["rope_theta"] == cfg.attention.rope_theta

    tokens = random_tokens(seed=4)
    assert (hf_model(tokens).logits - ours(tokens)).abs().max().item() < ATOL

    prompt = tokens[:, :8]
    generated = hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert generated.shape == (BATCH, 8 + 5)
    assert torch.equal(generated, greedy_decode(ours, prompt, 5))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"block": "parallel"},
            "model.block = 'parallel' has no Hugging Face Llama equivalent; export needs block = 'serial'",
        ),
        ({"norm": "layernorm"}, "model.norm = 'layernorm'"),
        ({"mlp": "gelu"}, "model.mlp = 'gelu'"),
        ({"position": "learned"}, "model.position = 'learned'"),
        ({"attention": AttentionConfig(window=16)}, "model.attention.window = 16"),
    ],
)
def test_unsupported_configs_refuse_to_export(change, message, tmp_path):
    cfg = dataclasses.replace(ModelConfig(dim=64, n_layers=1, vocab_size=VOCAB), **change)
    state_dict = make_our_model(cfg).state_dict()
    for export in (
        lambda: hf_config_of(cfg),
        lambda: to_hf_state_dict(state_dict, cfg),
        lambda: save_hf(state_dict, cfg, tmp_path),
    ):
        with pytest.raises(ConfigError) as err:
            export()
        assert message in str(err.value)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type = 'mistral'"),
        ({"attention_bias": True}, "attention_bias = True"),
        ({"mlp_bias": True}, "mlp_bias = True"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window = True"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE type 'longrope'"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 5e5}}, "RoPE type 'su'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ],
)
def test_unsupported_hf_configs_refuse_to_import(change, message):
    hf = {**hf_config_of(ModelConfig(dim=64, n_layers=1, vocab_size=VOCAB)), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        model_config_from_hf(hf)


def test_rope_theta_read_from_either_layout():
    hf = hf_config_of(ModelConfig(dim=64, n_layers=1, vocab_size=VOCAB))
    legacy = {key: value for key, value in hf.items() if key != "rope_parameters"} | {"rope_theta": 7.0}
    assert model_config_from_hf(legacy).attention.rope_theta == 7.0
    current = {key: value for key, value in hf.items() if key != "rope_theta"}
    current["rope_parameters"] = {"rope_type": "default", "rope_theta": 9.0}
    assert model_config_from_hf(current).attention.rope_theta == 9.0


def test_mismatched_weights_name_the_keys(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=2, vocab_size=VOCAB)
    hf_sd = to_hf_state_dict(make_our_model(cfg).state_dict(), cfg)
    del hf_sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        from_hf_state_dict(hf_sd, cfg)
    with pytest.raises(CheckpointError, match="neither"):
        (tmp_path / "config.json").write_text(json.dumps(hf_config_of(cfg)))
        load_hf(tmp_path)
