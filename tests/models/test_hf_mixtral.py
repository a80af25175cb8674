"""Hugging Face Mixtral interop (models/hf.py): a random MixtralForCausalLM imported gives its logits, a
megascale MoE model exported loads in transformers with the same logits, and the round trip is exact."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megascale.config import load_config  # noqa: E402
from megascale.errors import ConfigError  # noqa: E402
from megascale.models.hf import check_exportable, load_hf, save_hf  # noqa: E402
from megascale.models.llama import Transformer  # noqa: E402

MIXTRAL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=64,
    max_position_embeddings=32,
    rope_theta=1e6,
)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_a_random_mixtral_imports_with_its_logits(tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).eval()
    hf_model.save_pretrained(tmp_path / "mixtral")
    cfg, state_dict = load_hf(tmp_path / "mixtral")
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.moe.expert_dim) == (4, 2, 48)
    model = Transformer(cfg).eval()
    model.load_state_dict(state_dict)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), hf_model(_tokens()).logits, atol=1e-5, rtol=0)


def test_an_moe_model_exports_as_mixtral_and_round_trips_exactly(tmp_path):
    args = ["--model.dim=32", "--model.n_layers=2", "--model.vocab_size=64", "--model.max_seq_len=32"]
    moe = ["--model.moe.experts=4", "--model.moe.expert_dim=40", "--model.attention.n_heads=4"]
    cfg = load_config(None, [*args, *moe, "--data.seq_len=32"]).model
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(hf_model(_tokens()).logits, model(_tokens()), atol=1e-5, rtol=0)
    imported_cfg, state_dict = load_hf(tmp_path / "hf")
    assert imported_cfg.moe == cfg.moe
    for key, value in model.state_dict().items():
        assert torch.equal(state_dict[key], value), key


@pytest.mark.parametrize(
    "change, field",
    [
        ("--model.moe.shared_experts=1", "model.moe.shared_experts = 1"),
        ("--model.moe.score=sigmoid", "model.moe.score = 'sigmoid'"),
        ("--model.moe.bias_update_rate=0.001", "model.moe.bias_update_rate = 0.001"),
        ("--model.moe.capacity_factor=1.0", "model.moe.capacity_factor = 1.0"),
        ("--model.moe.dense_layers=1", "model.moe.dense_layers = 1"),
    ],
)
def test_moe_settings_mixtral_lacks_refuse_to_export(change, field):
    cfg = load_config(None, ["--model.moe.experts=4", change]).model
    with pytest.raises(ConfigError, match=f"{field} has no Hugging Face Mixtral equivalent"):
        check_exportable(cfg)


def test_a_mixtral_with_a_sliding_window_refuses_to_import(tmp_path):
    hf_model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL, sliding_window=8))
    hf_model.save_pretrained(tmp_path / "mixtral")
    with pytest.raises(ConfigError, match="sliding_window = 8 is not supported"):
        load_hf(tmp_path / "mixtral")
