"""RoPE scaling (models/rope.py) against transformers: Llama models with each scaling Hugging Face
defines, imported with their logits, and exported back bit for bit; the inverse frequencies against
transformers' own functions."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megascale.config import RopeScalingConfig, load_config
from megascale.models.flops import num_params
from megascale.models.hf import hf_config_of, load_hf, model_config_from_hf, save_hf
from megascale.models.llama import Transformer
from megascale.models.rope import inverse_frequencies, table_scale
from tests.models.test_hf import make_hf_model

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

VOCAB, MAX_LEN, ORIGINAL = 96, 64, 16
# Each scaling type as a config.json's rope_parameters states it (rope_theta aside).
SCALINGS = {
    "llama3.1": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-deepseek": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_llama(scaling: dict) -> "transformers.LlamaForCausalLM":
    return make_hf_model(4, 2, False, rope_scaling=scaling)


@pytest.mark.parametrize("name", SCALINGS)
@torch.no_grad()
def test_a_scaled_llama_imports_with_transformers_logits_and_exports_back_bit_for_bit(name, tmp_path):
    hf_model = hf_llama(SCALINGS[name])
    source = tmp_path / "hf"
    hf_model.save_pretrained(source, safe_serialization=True)
    cfg, state_dict = load_hf(source)
    assert cfg.attention.rope_scaling.type == SCALINGS[name]["rope_type"]

    ours = Transformer(cfg).eval()
    ours.load_state_dict(state_dict)
    tokens = torch.randint(0, VOCAB, (2, MAX_LEN), generator=torch.Generator().manual_seed(2))
    expected = hf_model(tokens).logits
    assert (ours(tokens) - expected).abs().max().item() < 1e-5
    if name != "dynamic":  # the scaling is there: plain RoPE gives other logits past the original length
        attention = dataclasses.replace(cfg.attention, rope_scaling=RopeScalingConfig())
        plain = Transformer(dataclasses.replace(cfg, attention=attention)).eval()
        plain.load_state_dict(state_dict)
        assert (plain(tokens) - expected).abs().max().item() > 1e-3

    exported = tmp_path / "exported"
    save_hf(state_dict, cfg, exported)
    written, original = load_file(exported / "model.safetensors"), load_file(source / "model.safetensors")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[key], original[key]) for key in original)
    config = json.loads((exported / "config.json").read_text())
    stated = {**SCALINGS[name], "rope_theta": 500.0}
    assert {key: config["rope_parameters"][key] for key in stated} == stated
    reloaded = transformers.LlamaForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert torch.equal(reloaded(tokens).logits, expected)


def test_llama_31s_legacy_rope_scaling_reads_as_its_rope_parameters():
    """Llama 3.1's config.json as published (transformers < 5): rope_theta and rope_scaling apart."""
    current = hf_llama(SCALINGS["llama3.1"]).config.to_dict()
    legacy = {key: value for key, value in current.items() if key != "rope_parameters"}
    legacy["rope_theta"] = 500.0
    legacy["rope_scaling"] = {**SCALINGS["llama3.1"]}
    assert model_config_from_hf(legacy) == model_config_from_hf(current)


@pytest.mark.parametrize("name", ["llama3.1", "linear", "yarn", "yarn-deepseek"])
def test_inverse_frequencies_are_transformers_own(name):
    scaling = SCALINGS[name]
    hf_config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4 * 8192,
        rope_parameters={**scaling, "rope_theta": 500000.0, "original_max_position_embeddings": 8192},
    )
    expected, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    cfg = model_config_from_hf({**hf_config.to_dict(), "model_type": "llama"})
    ours = inverse_frequencies(64, 500000.0, cfg.attention.rope_scaling)
    assert torch.allclose(ours.float(), expected, rtol=1e-6, atol=0)
    assert table_scale(cfg.attention.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)


def test_scalings_that_need_the_original_length_refuse_without_it():
    with pytest.raises(Exception, match="rope_scaling.original_max_seq_len = None must be set"):
        load_config(None, ["--model.attention.rope_scaling.type=llama3"])


# Meta's published config.json of each model (the fields that shape it), and its parameter count.
_LLAMA_31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
PUBLISHED = {
    "llama3.2-1b": (
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192),
        dict(tie_word_embeddings=True, factor=32.0),
        1_235_814_400,
    ),
    "llama3.2-3b": (
        dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, intermediate_size=8192),
        dict(tie_word_embeddings=True, factor=32.0),
        3_212_749_824,
    ),
    "llama3.1-8b": (
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336),
        dict(tie_word_embeddings=False, factor=8.0),
        8_030_261_248,
    ),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_llama_3_configs_export_as_metas_config_json(name):
    shape, differences, params = PUBLISHED[name]
    cfg = load_config(Path(__file__).parents[2] / "configs" / f"{name}.toml").model
    hf = hf_config_of(cfg)
    expected = {
        **shape,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": differences["tie_word_embeddings"],
        "rope_theta": 500000.0,
    }
    assert {key: hf[key] for key in expected} == expected
    rope = {**_LLAMA_31_ROPE, "factor": differences["factor"]}
    assert hf["rope_scaling"] == {"rope_type": "llama3", **rope, "original_max_position_embeddings": 8192}
    assert num_params(cfg) == params
