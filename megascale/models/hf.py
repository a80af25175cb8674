"""Hugging Face Llama, Mixtral, Qwen3 and Qwen3-MoE interop: config.json and safetensors weights in both
directions.

A megascale model with the Llama options (RMSNorm, SwiGLU, RoPE, serial block, full causal attention) is
a `LlamaForCausalLM`: RoPE uses the same rotate-half layout, so every weight maps 1:1 by name, with no
permutation. With MoE layers in every block, routed as Mixtral routes (softmax scores, the chosen ones
normalised, no shared expert, no routing bias, dropless), it is a `MixtralForCausalLM`: the router is the
gate, and each expert's slice of the stacked weights, transposed, is that expert's w1/w3/w2 (the per-expert
layout Mixtral checkpoints are stored in). With QK-norm (`model.attention.qk_norm`) the same model is a
`Qwen3ForCausalLM`, and with MoE layers a `Qwen3MoeForCausalLM`, which may keep its first layers dense
(`mlp_only_layers`) and leave the chosen scores unnormalised (`norm_topk_prob`); its experts are stored as
gate_proj/up_proj/down_proj. Only `safetensors` and `json` are needed; `transformers` itself is optional.

RoPE scaling (`model.attention.rope_scaling`: linear, dynamic, YaRN, Llama 3.1's) is written as
`rope_parameters` (transformers >= 5) and `rope_scaling` (earlier), and read from either.

Fields with no Hugging Face counterpart (the parallel block, GeLU, LayerNorm, learned positions, the
sliding window) cannot be exported, and configs using features megascale lacks (biases, partial rotary
embeddings, other RoPE scalings) cannot be imported: both raise a `ConfigError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megascale.config import AttentionConfig, ModelConfig, MoEConfig, RopeScalingConfig, head_dim_of
from megascale.errors import CheckpointError, ConfigError
from megascale.models.feed_forward import ffn_dim_of
from megascale.models.moe import expert_dim_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Per-layer names: ours (after "layers.{i}.") -> Hugging Face's (after "model.layers.{i}.").
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
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


# The MoE settings of a Qwen3-MoE layer, and of a Mixtral one (which also needs the rest): (field, value).
_QWEN3_MOE_FIELDS: tuple[tuple[str, object], ...] = (
    ("score", "softmax"),
    ("route_scale", 1.0),
    ("shared_experts", 0),
    ("bias_update_rate", 0.0),
    ("capacity_factor", None),
)
_MIXTRAL_FIELDS = (*_QWEN3_MOE_FIELDS, ("normalize_weights", True), ("dense_layers", 0))


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first field that a Hugging Face Llama (or, with MoE layers, Mixtral;
    with QK-norm, Qwen3 or Qwen3-MoE) cannot represent."""
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
    family, fields = (
        ("Qwen3-MoE", _QWEN3_MOE_FIELDS) if cfg.attention.qk_norm else ("Mixtral", _MIXTRAL_FIELDS)
    )
    for moe_field, wanted in fields if cfg.moe.experts else ():
        setting = getattr(cfg.moe, moe_field)
        if setting != wanted:
            raise ConfigError(
                f"convert: model.moe.{moe_field} = {setting!r} has no Hugging Face {family} equivalent; "
                f"export needs model.moe.{moe_field} = {wanted!r}"
            )


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of the LlamaForCausalLM (MixtralForCausalLM with MoE layers; with QK-norm,
    Qwen3ForCausalLM or Qwen3MoeForCausalLM) equal to this model."""
    check_exportable(cfg)
    if cfg.attention.qk_norm:
        qwen3 = {**_llama_config(cfg), **_qwen3_fields(cfg)}
        return {**qwen3, **_qwen3_moe_fields(cfg)} if cfg.moe.experts else qwen3
    if cfg.moe.experts:
        return {**_llama_config(cfg), **_mixtral_fields(cfg)}
    return _llama_config(cfg)


def _qwen3_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
    }


def _qwen3_moe_fields(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.experts,
        "num_local_experts": moe.experts,  # the name transformers >= 5 reads
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": expert_dim_of(cfg),
        "norm_topk_prob": moe.normalize_weights,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.dense_layers)),
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": False,
    }


def _mixtral_fields(cfg: ModelConfig) -> dict[str, Any]:
    """What a Mixtral config.json says beyond (or instead of) a Llama one."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": expert_dim_of(cfg),
        "num_local_experts": cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    rope_theta, scaling = cfg.attention.rope_theta, _rope_scaling_fields(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_dim_of(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "num_key_value_heads": cfg.attention.n_kv_heads,
        "head_dim": head_dim_of(cfg),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads the top-level rope_theta and rope_scaling, >= 5 reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {**scaling, "rope_theta": rope_theta},
        **({"rope_scaling": scaling} if cfg.attention.rope_scaling.type != "none" else {}),
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


# Hugging Face's RoPE parameter -> RopeScalingConfig's field, for each scaling type that uses it.
_ROPE_FIELDS = {
    "factor": ("factor", ("linear", "dynamic", "yarn", "llama3")),
    "original_max_position_embeddings": ("original_max_seq_len", ("yarn", "llama3")),
    "low_freq_factor": ("low_freq_factor", ("llama3",)),
    "high_freq_factor": ("high_freq_factor", ("llama3",)),
    "beta_fast": ("beta_fast", ("yarn",)),
    "beta_slow": ("beta_slow", ("yarn",)),
    "truncate": ("truncate", ("yarn",)),
    "attention_factor": ("attention_factor", ("yarn",)),
    "mscale": ("mscale", ("yarn",)),
    "mscale_all_dim": ("mscale_all_dim", ("yarn",)),
}


def _rope_scaling_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The RoPE scaling as Hugging Face's rope_parameters name it (without rope_theta): the type and the
    fields it reads, those left unset omitted."""
    scaling = cfg.attention.rope_scaling
    kind = "default" if scaling.type == "none" else scaling.type
    fields = {
        name: getattr(scaling, ours)
        for name, (ours, kinds) in _ROPE_FIELDS.items()
        if kind in kinds and getattr(scaling, ours) is not None
    }
    return {"rope_type": kind, **fields}


def _rope_of(hf: dict[str, Any]) -> tuple[float, RopeScalingConfig]:
    """rope_theta and the RoPE scaling, from rope_parameters (transformers >= 5) or rope_theta and
    rope_scaling (earlier); scalings megascale lacks are refused."""
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    supported = ("default", "linear", "dynamic", "yarn", "llama3")
    if rope_type not in supported:
        raise ConfigError(
            f"convert: config.json RoPE type {rope_type!r} is not supported; megascale implements "
            f"{', '.join(supported)}"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(
            f"convert: config.json partial_rotary_factor = {partial!r} is not supported; megascale rotates "
            "every channel of a head (1.0)"
        )
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, RopeScalingConfig()
    fields = {
        ours: params[name]
        for name, (ours, kinds) in _ROPE_FIELDS.items()
        if rope_type in kinds and params.get(name) is not None
    }
    if rope_type == "yarn" and "factor" not in fields:  # DeepSeek-V3's way: the lengths' ratio
        fields["factor"] = hf["max_position_embeddings"] / fields["original_max_seq_len"]
    return theta, RopeScalingConfig(type=rope_type, **fields)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Llama config.json (as a dict); ConfigError if it is not a plain Llama.

    ffn_dim is left unset when intermediate_size is what megascale would derive anyway, so that
    exporting a default config and importing it back gives an equal ModelConfig.
    """
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mixtral", "qwen3", "qwen3_moe"):
        raise ConfigError(
            f"convert: config.json model_type = {model_type!r} is not supported; 'llama', 'mixtral', "
            "'qwen3' and 'qwen3_moe' convert"
        )
    if hf.get("use_sliding_window"):
        raise ConfigError(
            "convert: config.json use_sliding_window = True is not supported; megascale's Qwen3 has full "
            "causal attention (use_sliding_window false)"
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
    rope_theta, rope_scaling = _rope_of(hf)
    head_dim = hf.get("head_dim") or dim // n_heads
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
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            head_dim=None if head_dim * n_heads == dim else head_dim,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        ),
    )
    if model_type == "mixtral":
        cfg.moe = _moe_config_from_mixtral(hf)
    elif model_type == "qwen3_moe":
        cfg.moe = _moe_config_from_qwen3(hf)
    if model_type != "mixtral" and hf["intermediate_size"] != ffn_dim_of(cfg):
        cfg.ffn_dim = hf["intermediate_size"]  # the dense layers' (Qwen3-MoE's mlp_only_layers)
    return cfg


def _moe_config_from_qwen3(hf: dict[str, Any]) -> MoEConfig:
    """Qwen3-MoE's layers: softmax routing, the chosen scores normalised if norm_topk_prob, dropless,
    an MoE layer in every block after the first `mlp_only_layers`."""
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(
            f"convert: config.json decoder_sparse_step = {hf['decoder_sparse_step']!r} is not supported; "
            "megascale's MoE layers are every block's after the dense first ones (decoder_sparse_step 1)"
        )
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"convert: config.json mlp_only_layers = {dense!r} is not supported; megascale keeps the first "
            "k layers dense (mlp_only_layers = [0, ..., k-1])"
        )
    return MoEConfig(
        experts=hf.get("num_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_dim=hf["moe_intermediate_size"],
        dense_layers=len(dense),
        normalize_weights=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )


def _moe_config_from_mixtral(hf: dict[str, Any]) -> MoEConfig:
    """Mixtral's MoE layers: every block's, softmax routing with the chosen scores normalised, dropless."""
    for key, what in (
        ("sliding_window", "full causal attention"),
        ("router_jitter_noise", "no router noise"),
    ):
        if hf.get(key):
            raise ConfigError(
                f"convert: config.json {key} = {hf[key]!r} is not supported; megascale's Mixtral has "
                f"{what} ({key} null or 0)"
            )
    return MoEConfig(
        experts=hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_dim=hf["intermediate_size"],
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )


_DENSE_FFN_KEYS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_QK_NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
# Where each family keeps an MoE layer (after "model.layers.{i}.") and its experts' names for our stacked
# weights [experts, in, out], each stored per expert as a linear weight [out, in].
_MOE_LAYOUTS = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}


def _moe_layers(cfg: ModelConfig) -> range:
    return range(cfg.moe.dense_layers, cfg.n_layers) if cfg.moe.experts else range(0)


def _moe_layout(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    return _MOE_LAYOUTS["qwen3_moe" if cfg.attention.qk_norm else "mixtral"]


def _key_map(cfg: ModelConfig) -> dict[str, str]:
    """Every megascale state-dict key that maps 1:1 -> its Hugging Face name (experts aside)."""
    names = dict(_GLOBAL_KEYS)
    prefix, _ = _moe_layout(cfg)
    for i in range(cfg.n_layers):
        layer = {**_LAYER_KEYS, **(_QK_NORM_KEYS if cfg.attention.qk_norm else {})}
        if i in _moe_layers(cfg):
            layer["feed_forward.router.gate.weight"] = f"{prefix}.gate.weight"
        else:
            layer.update(_DENSE_FFN_KEYS)
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in layer.items()})
    return names


def _expert_keys(cfg: ModelConfig) -> dict[str, list[str]]:
    """Each stacked expert weight of ours -> the family's per-expert names, in expert order."""
    prefix, names = _moe_layout(cfg)
    return {
        f"layers.{i}.feed_forward.experts.{ours}": [
            f"model.layers.{i}.{prefix}.experts.{e}.{theirs}.weight" for e in range(cfg.moe.experts)
        ]
        for i in _moe_layers(cfg)
        for ours, theirs in names.items()
    }


def _bias_keys(cfg: ModelConfig) -> list[str]:
    """The routing biases, which Hugging Face's models have none of (zero without bias_update_rate)."""
    return [f"layers.{i}.feed_forward.router.expert_bias" for i in _moe_layers(cfg)]


def _check_keys(found: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"convert: {what} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megascale weights -> Hugging Face Llama weights: the same tensors renamed, lm_head dropped if tied."""
    check_exportable(cfg)
    names, experts = _key_map(cfg), _expert_keys(cfg)
    found = set(state_dict) - set(_bias_keys(cfg))
    if cfg.tie_embeddings:
        # A tied model's state_dict lists the shared tensor under both names; Llama stores it once.
        names.pop("output.weight")
        found.discard("output.weight")
    _check_keys(found, set(names) | set(experts), "megascale state dict")
    hf_sd = {names[key]: state_dict[key] for key in names}
    for ours, theirs in experts.items():
        hf_sd.update(zip(theirs, (weight.T for weight in state_dict[ours].unbind(0))))
    return hf_sd


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights -> a state dict that `Transformer(cfg).load_state_dict` accepts."""
    theirs_to_ours = {theirs: ours for ours, theirs in _key_map(cfg).items()}
    experts = _expert_keys(cfg)
    # Old checkpoints also store RoPE's inverse frequencies, which megascale recomputes.
    found = {key for key in hf_sd if not key.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        theirs_to_ours.pop("lm_head.weight")
        found.discard("lm_head.weight")
    expected = set(theirs_to_ours) | {name for names in experts.values() for name in names}
    _check_keys(found, expected, "Hugging Face state dict")
    state_dict = {ours: hf_sd[theirs] for theirs, ours in theirs_to_ours.items()}
    for ours, theirs in experts.items():
        state_dict[ours] = torch.stack([hf_sd[name].T for name in theirs])
    for key in _bias_keys(cfg):
        state_dict[key] = torch.zeros(cfg.moe.experts)
    if cfg.tie_embeddings:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    token_ids: dict[str, int] | None = None,
) -> Path:
    """Write config.json and model.safetensors to out_dir (created); return out_dir. `token_ids`: the
    tokenizer's special token ids (bos_token_id, eos_token_id) for config.json.

    The folder loads with `LlamaForCausalLM.from_pretrained(out_dir)`.
    """
    hf_config = hf_config_of(cfg) | (token_ids or {})
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
