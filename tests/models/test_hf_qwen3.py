"""Hugging Face Qwen3 and Qwen3-MoE interop (models/hf.py): QK-norm and a head size set apart from
hidden_size / heads. A random Qwen3ForCausalLM or Qwen3MoeForCausalLM (dense first layers, unnormalised
routing weights) imports with its logits; a megascale model with QK-norm exports as one, loads in
transformers with the same logits, and reads back bit for bit."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megascale.config import load_config  # noqa: E402
from megascale.errors import ConfigError  # noqa: E402
from megascale.models.hf import check_exportable, load_hf, model_config_from_hf, save_hf  # noqa: E402
from megascale.models.llama import Transformer  # noqa: E402

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4 x 16 = 64 != hidden_size 32
    max_position_embeddings=32,
    rope_theta=1e6,
)
QWEN3_MOE = dict(
    **SHAPE,
    moe_intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    norm_topk_prob=False,
)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Norm gains away from 1, so that a QK-norm left out or misplaced shows in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize(
    "build",
    [
        lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE)),
        lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)),
    ],
    ids=["qwen3", "qwen3_moe"],
)
def test_a_random_qwen3_imports_with_its_logits(build, tmp_path):
    torch.manual_seed(0)
    hf_model = _randomised(build())
    hf_model.save_pretrained(tmp_path / "hf")
    cfg, state_dict = load_hf(tmp_path / "hf")
    assert cfg.attention.qk_norm and cfg.attention.head_dim == 16
    model = Transformer(cfg).eval()
    model.load_state_dict(state_dict)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), hf_model(_tokens()).logits, atol=1e-5, rtol=0)


def test_qwen3_moe_config_maps_to_dense_first_layers_and_unnormalised_weights():
    cfg = model_config_from_hf(transformers.Qwen3MoeConfig(**QWEN3_MOE).to_dict())
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.expert_dim, cfg.moe.dense_layers) == (4, 2, 24, 1)
    assert cfg.moe.normalize_weights is False and cfg.ffn_dim == 48


@pytest.mark.parametrize("experts", [0, 4], ids=["qwen3", "qwen3_moe"])
def test_a_qk_norm_model_exports_as_qwen3_and_round_trips_exactly(experts, tmp_path):
    args = ["--model.dim=32", "--model.n_layers=3", "--model.vocab_size=64", "--model.max_seq_len=32"]
    args += ["--model.attention.qk_norm=true", "--model.attention.head_dim=16", "--data.seq_len=32"]
    if experts:
        args += [f"--model.moe.experts={experts}", "--model.moe.dense_layers=1", "--model.moe.expert_dim=24"]
    cfg = load_config(None, args).model
    torch.manual_seed(0)
    model = _randomised(Transformer(cfg))
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == ("Qwen3MoeForCausalLM" if experts else "Qwen3ForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf_model(_tokens()).logits, model(_tokens()), atol=1e-5, rtol=0)
    imported, state_dict = load_hf(tmp_path / "hf")
    assert imported == cfg
    for key, value in model.state_dict().items():
        assert torch.equal(state_dict[key], value), key


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
    ],
)
def test_qwen3_moe_layouts_megascale_lacks_refuse_to_import(change, message):
    hf = {**transformers.Qwen3MoeConfig(**QWEN3_MOE).to_dict(), **change}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        model_config_from_hf(hf)


def test_a_qk_norm_model_with_shared_experts_is_refused_by_the_export():
    args = ["--model.attention.qk_norm=true", "--model.moe.experts=4", "--model.moe.shared_experts=1"]
    with pytest.raises(ConfigError, match="model.moe.shared_experts = 1 has no Hugging Face Qwen3-MoE"):
        check_exportable(load_config(None, args).model)
