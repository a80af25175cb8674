"""Hugging Face Llama interop: config.json and safetensors weights in both directions.

A megascale model with the Llama options (RMSNorm, SwiGLU, RoPE, serial block, full causal attention) is
a `LlamaForCausalLM`: RoPE uses the same rotate-half layout, so every weight maps 1:1 by name, with no
permutation. Only `safetensors` and `json` are needed; `transformers` itself is optional.

Fields with no Hugging Face counterpart (the parallel block, GeLU, LayerNorm, learned positions, the
sliding window) cannot be exported, and configs using Llama features megascale lacks (biases, RoPE
scaling, a head size other than hidden_size / heads) cannot be imported: both raise a `ConfigError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megascale.config import AttentionConfig, ModelConfig
from megascale.errors import CheckpointError, ConfigError
from megascale.models.feed_forward import ffn_dim_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Per-layer names: ours (after "layers.{i}.") -> Hugging Face's (after "model.layers.{i}.").
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The value each field must have for the model to be a Llama: (field, required value).
_LLAMA_FIELDS = (
    ("norm", "rmsnorm"),
    ("mlp", "swiglu"),
    ("position", "rope"),
    ("block", "serial"),
)


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first field that a Hugging Face Llama cannot represent."""
    for name, required in _LLAMA_FIELDS:
        value = getattr(cfg, name)
        if value != required:
            raise ConfigError(
                f"convert: model.{name} = {value!r} has no Hugging Face Llama equivalent; "
                f"export needs {name} = {required!r}"
            )
    if cfg.attention.window is not None:
        raise ConfigError(
            f"convert: model.attention.window = {cfg.attention.window!r} has no Hugging Face "
            "Llama equivalent; export needs full causal attention (window unset)"
        )
    if cfg.moe.experts:
        raise ConfigError(
            f"convert: model.moe.experts = {cfg.moe.experts} has no Hugging Face Llama equivalent, and the "
            "export of MoE models (Mixtral, Qwen3-MoE) is not written yet; export needs model.moe.experts = 0"
        )


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of the LlamaForCausalLM equal to this model."""
    check_exportable(cfg)
    rope_theta = cfg.attention.rope_theta
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_dim_of(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "num_key_value_heads": cfg.attention.n_kv_heads,
        "head_dim": cfg.dim // cfg.attention.n_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads the top-level rope_theta, transformers >= 5 reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
    }


def _rope_theta_of(hf: dict[str, Any]) -> float:
    """rope_theta from either layout, refusing any RoPE scaling (megascale implements plain RoPE only)."""
    if hf.get("rope_scaling") is not None:
        raise ConfigError(
            f"convert: config.json rope_scaling = {hf['rope_scaling']!r} is not supported; "
            "megascale implements plain RoPE only (rope_scaling null)"
        )
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"convert: config.json rope_parameters.rope_type = {rope_type!r} is not "
            "supported; megascale implements plain RoPE only ('default')"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Llama config.json (as a dict); ConfigError if it is not a plain Llama.

    ffn_dim is left unset when intermediate_size is what megascale would derive anyway, so that
    exporting a default config and importing it back gives an equal ModelConfig.
    """
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"convert: config.json model_type = {model_type!r} is not supported; only 'llama' converts"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ConfigError(
                f"convert: config.json {flag} = {hf[flag]!r} is not supported; "
                "megascale's linear layers have no bias"
            )
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ConfigError(
            f"convert: config.json hidden_act = {hidden_act!r} is not supported; "
            "megascale's SwiGLU needs 'silu'"
        )
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ConfigError(
            f"convert: config.json head_dim = {head_dim} is not supported; megascale needs "
            f"hidden_size / num_attention_heads = {dim} / {n_heads}"
        )
    cfg = ModelConfig(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            window=None,
            rope_theta=_rope_theta_of(hf),
        ),
    )
    intermediate_size = hf["intermediate_size"]
    if intermediate_size != ffn_dim_of(cfg):
        cfg.ffn_dim = intermediate_size
    return cfg


def _key_map(cfg: ModelConfig) -> dict[str, str]:
    """Every megascale state-dict key -> its Hugging Face name."""
    names = dict(_GLOBAL_KEYS)
    for i in range(cfg.n_layers):
        for ours, theirs in _LAYER_KEYS.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def _check_keys(found: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"convert: {what} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megascale weights -> Hugging Face Llama weights: the same tensors renamed, lm_head dropped if tied."""
    check_exportable(cfg)
    names = _key_map(cfg)
    found = set(state_dict)
    if cfg.tie_embeddings:
        # A tied model's state_dict lists the shared tensor under both names; Llama stores it once.
        names.pop("output.weight")
        found.discard("output.weight")
    _check_keys(found, set(names), "megascale state dict")
    return {names[key]: state_dict[key] for key in names}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights -> a state dict that `Transformer(cfg).load_state_dict` accepts."""
    theirs_to_ours = {theirs: ours for ours, theirs in _key_map(cfg).items()}
    # Old checkpoints also store RoPE's inverse frequencies, which megascale recomputes.
    found = {key for key in hf_sd if not key.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        theirs_to_ours.pop("lm_head.weight")
        found.discard("lm_head.weight")
    _check_keys(found, set(theirs_to_ours), "Hugging Face state dict")
    state_dict = {ours: hf_sd[theirs] for theirs, ours in theirs_to_ours.items()}
    if cfg.tie_embeddings:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def save_hf(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write config.json and model.safetensors to out_dir (created); return out_dir.

    The folder loads with `LlamaForCausalLM.from_pretrained(out_dir)`.
    """
    hf_config = hf_config_of(cfg)
    tensors = {
        name: tensor.detach().cpu().contiguous() for name, tensor in to_hf_state_dict(state_dict, cfg).items()
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    return out_dir


def _load_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors, or of every shard listed in model.safetensors.index.json."""
    if (hf_dir / WEIGHTS_FILE).is_file():
        return load_file(hf_dir / WEIGHTS_FILE)
    index_path = hf_dir / WEIGHTS_INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(f"convert: {hf_dir} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (hf_dir / shard).is_file():
            raise CheckpointError(f"convert: shard {shard} listed in {index_path} is missing")
        tensors.update(load_file(hf_dir / shard))
    return tensors


def load_hf(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Llama folder: (its ModelConfig, a megascale state dict)."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"convert: {config_path} does not exist")
    cfg = model_config_from_hf(json.loads(config_path.read_text()))
    return cfg, from_hf_state_dict(_load_hf_tensors(hf_dir), cfg)
