"""The MoE layer on one device (models/moe.py) against independent references: Hugging Face's Mixtral,
Qwen3-MoE and DeepSeek-V3 blocks for routing and expert compute, an explicit per-token loop for capacity,
autograd on an added loss for the auxiliary loss's gradient."""

import copy

import pytest
import torch
import torch.nn.functional as F

from megascale.config import load_config
from megascale.models.llama import Transformer
from megascale.models.moe import MoE, training_step

DIM, EXPERTS, EXPERT_DIM = 32, 4, 48


def moe_config(*overrides: str):
    return load_config(
        None,
        [
            f"--model.dim={DIM}",
            "--model.n_layers=2",
            "--model.vocab_size=96",
            "--model.max_seq_len=32",
            "--data.seq_len=32",
            f"--model.moe.experts={EXPERTS}",
            f"--model.moe.expert_dim={EXPERT_DIM}",
            *overrides,
        ],
    ).model


def _layer(*overrides: str) -> MoE:
    torch.manual_seed(0)
    layer = MoE(moe_config(*overrides))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.2)
    return layer


def _hf_experts(hf_experts, layer: MoE) -> None:
    """Our stacked weights into transformers' experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    experts = layer.experts
    with torch.no_grad():
        hf_experts.gate_up_proj.copy_(torch.cat([experts.w1, experts.w3], dim=2).transpose(1, 2))
        hf_experts.down_proj.copy_(experts.w2.transpose(1, 2))


def test_softmax_routing_matches_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    layer = _layer("--model.moe.top_k=2")
    hf = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=DIM, intermediate_size=EXPERT_DIM, num_local_experts=EXPERTS, num_experts_per_tok=2
        )
    ).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.gate.weight)
    _hf_experts(hf.experts, layer)
    x = torch.randn(3, 10, DIM)
    torch.testing.assert_close(layer.eval()(x), hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_routing_matches_qwen3_moe_with_and_without_normalised_weights(normalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    layer = _layer("--model.moe.top_k=3", f"--model.moe.normalize_weights={str(normalize).lower()}")
    config = Qwen3MoeConfig(
        hidden_size=DIM,
        moe_intermediate_size=EXPERT_DIM,
        num_experts=EXPERTS,
        num_experts_per_tok=3,
        norm_topk_prob=normalize,
    )
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.gate.weight)
    _hf_experts(hf.experts, layer)
    x = torch.randn(2, 12, DIM)
    torch.testing.assert_close(layer.eval()(x), hf(x), rtol=1e-5, atol=1e-5)


def test_sigmoid_routing_with_bias_scale_and_shared_expert_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    layer = _layer(
        "--model.moe.top_k=2",
        "--model.moe.score=sigmoid",
        "--model.moe.route_scale=2.5",
        "--model.moe.shared_experts=1",
    )
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    config = DeepseekV3Config(
        hidden_size=DIM,
        moe_intermediate_size=EXPERT_DIM,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    hf = DeepseekV3MoE(config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.gate.weight)
        hf.gate.e_score_correction_bias.copy_(layer.router.expert_bias)
        shared = layer.shared
        hf.shared_experts.gate_proj.weight.copy_(shared.w1.weight)
        hf.shared_experts.up_proj.weight.copy_(shared.w3.weight)
        hf.shared_experts.down_proj.weight.copy_(shared.w2.weight)
    _hf_experts(hf.experts, layer)
    x = torch.randn(2, 9, DIM)
    torch.testing.assert_close(layer.eval()(x), hf(x), rtol=1e-5, atol=1e-5)


def _loop_reference(layer: MoE, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Token by token, expert by expert: each expert takes each sequence's token slots in token order, up
    to `capacity` of them."""
    flat = x.reshape(-1, DIM)
    weights, chosen, _ = layer.router(flat)
    experts, out = layer.experts, torch.zeros_like(flat)
    for sequence in range(x.shape[0]):
        taken = [0] * EXPERTS
        for token in range(sequence * x.shape[1], (sequence + 1) * x.shape[1]):
            for slot in range(layer.top_k):
                e = int(chosen[token, slot])
                if capacity is not None and taken[e] >= capacity:
                    continue
                taken[e] += 1
                hidden = F.silu(flat[token] @ experts.w1[e]) * (flat[token] @ experts.w3[e])
                out[token] += weights[token, slot] * (hidden @ experts.w2[e])
    return out.view_as(x)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_grouped_compute_and_capacity_match_a_loop_over_tokens(capacity_factor):
    extra = [f"--model.moe.capacity_factor={capacity_factor}"] if capacity_factor else []
    layer = _layer("--model.moe.top_k=2", *extra)
    x = torch.randn(3, 8, DIM)
    capacity = None if capacity_factor is None else int(capacity_factor * 8 * 2 / EXPERTS)  # per sequence
    got = layer.train()(x)
    assert int(layer.load.sum()) == 0  # outside a training step nothing is counted
    with training_step():
        assert torch.equal(layer(x), got)
    torch.testing.assert_close(got, _loop_reference(layer, x, capacity), rtol=1e-5, atol=1e-5)
    assert int(layer.load.sum()) == 48  # every routed slot is counted for balancing, dropped or not
    assert (int(layer.dropped) > 0) == (capacity is not None)


def test_what_capacity_drops_does_not_depend_on_how_sequences_are_batched():
    layer = _layer("--model.moe.capacity_factor=0.5")
    x = torch.randn(4, 8, DIM)
    together = layer.train()(x)
    apart = torch.cat([layer(x[:1]), layer(x[1:3]), layer(x[3:])])
    torch.testing.assert_close(together, apart, rtol=1e-6, atol=1e-6)


def test_the_auxiliary_loss_gets_the_gradient_of_an_added_sequence_wise_loss():
    layer = _layer("--model.moe.aux_loss_coeff=0.1")
    reference = copy.deepcopy(layer)
    x = torch.randn(3, 8, DIM)
    with training_step(aux_loss_scale=0.5):
        (layer.train()(x).square().mean() * 0.5).backward()
    reference.aux_loss_coeff = 0.0  # the same forward, with the auxiliary loss added by hand
    out = reference.train()(x)
    _, chosen, scores = reference.router(x.reshape(-1, DIM))
    aux = torch.stack(
        [
            EXPERTS * (torch.bincount(c.flatten(), minlength=EXPERTS) / c.numel() * s.mean(dim=0)).sum()
            for c, s in zip(chosen.view(3, -1), scores.view(3, 8, EXPERTS))
        ]
    ).mean()
    ((out.square().mean() + 0.1 * aux) * 0.5).backward()
    for (name, got), want in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert layer.router.gate.weight.grad.abs().sum() > 0


def test_the_bias_update_moves_routing_toward_the_underloaded_experts():
    layer = _layer("--model.moe.bias_update_rate=0.01")
    layer.load.copy_(torch.tensor([10.0, 2.0, 5.0, 3.0]))  # mean 5
    layer.update_bias()
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert layer.load.sum() == 0


def test_dense_layers_first_then_moe_layers():
    model = Transformer(moe_config("--model.n_layers=3", "--model.moe.dense_layers=1"))
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers.values()]
    assert kinds == ["FeedForward", "MoE", "MoE"]
    tokens = torch.randint(96, (2, 16))
    model(tokens).float().logsumexp(-1).mean().backward()
    assert all(param.grad is not None for param in model.parameters())


def test_bad_moe_configs_are_refused_naming_the_field():
    from megascale.errors import ConfigError

    with pytest.raises(ConfigError, match="model.moe.top_k = 5 exceeds model.moe.experts = 4"):
        moe_config("--model.moe.top_k=5")
    with pytest.raises(ConfigError, match="model.moe.dense_layers = 2 leaves no MoE layer"):
        moe_config("--model.moe.dense_layers=2")


def test_parameters_count_every_expert_and_flops_count_the_active_ones():
    from megascale.models.flops import flops_per_token, num_params

    cfg = moe_config("--model.n_layers=3", "--model.moe.dense_layers=1", "--model.moe.shared_experts=1")
    assert num_params(cfg) == sum(param.numel() for param in Transformer(cfg).parameters())
    dense = load_config(
        None,
        [
            f"--model.dim={DIM}",
            "--model.n_layers=3",
            "--model.vocab_size=96",
            f"--model.ffn_dim={EXPERT_DIM}",
        ],
    ).model
    # top_k = 1 and one shared expert: each MoE layer computes two dense MLPs' worth, plus its router.
    one_routed = moe_config(
        "--model.n_layers=3",
        f"--model.ffn_dim={EXPERT_DIM}",
        "--model.moe.top_k=1",
        "--model.moe.shared_experts=1",
        "--model.moe.dense_layers=1",
    )
    mlp = 3 * DIM * EXPERT_DIM
    extra_per_moe_layer = mlp + DIM * EXPERTS
    want = flops_per_token(dense, 32) + 6 * 2 * extra_per_moe_layer
    assert flops_per_token(one_routed, 32) == want


def test_a_forward_recomputed_by_activation_checkpointing_is_counted_once():
    from torch.utils.checkpoint import checkpoint

    layer = _layer("--model.moe.aux_loss_coeff=0.01").train()
    x = torch.randn(2, 8, DIM, requires_grad=True)
    with training_step():
        checkpoint(layer, x, use_reentrant=False).square().mean().backward()
    assert int(layer.load.sum()) == 2 * 8 * 2


def test_top_1_with_normalised_weights_gives_the_router_an_exactly_zero_gradient():
    """A normalised single weight is s / s = 1, whose derivative is 0: computed through autograd it is
    rounding noise, which Adam turns into full-size router updates that differ between layouts."""
    cfg = load_config(None, ["--model.dim=32", "--model.moe.experts=4", "--model.moe.top_k=1"]).model
    torch.manual_seed(0)
    layer = MoE(cfg)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(2, 16, 32)
    layer(x).square().sum().backward()
    gate = layer.router.gate.weight.grad
    assert gate is not None and torch.count_nonzero(gate) == 0
    weights, _, _ = layer.router(x.view(-1, 32))
    assert torch.equal(weights, torch.ones_like(weights))


def test_a_compiled_layer_compiles_once_whatever_the_routing_and_matches_eager():
    """Each batch routes a different number of slots to each expert: compiled, the layer is traced once
    (the routed part runs eager) and gives the eager layer's output, loss and gradients. Before the
    routed part was left out, each new count recompiled it, and its data-dependent sizes broke the graph
    in a dozen places."""
    layer = _layer("--model.moe.capacity_factor=1.0", "--model.moe.aux_loss_coeff=0.01")
    compiled = copy.deepcopy(layer)
    compiled.compile()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(seed))
            for module in (layer, compiled):
                with training_step(aux_loss_scale=1.0):
                    module.train()(x).square().mean().backward()
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(compiled.named_parameters(), layer.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(compiled.load, layer.load) and torch.equal(compiled.dropped, layer.dropped)
