"""The step protocol on one process (parallel/step.py): `forward_backward` accumulates the gradient of the
micro-batches' mean loss, `evaluate` computes a loss without gradients, `clip_gradients` clips the global
norm; each checked against autograd on the whole batch at once."""

import copy
from contextlib import nullcontext

import pytest
import torch

from megascale.config import MoEConfig
from megascale.models.llama import Transformer
from megascale.models.moe import MoE
from megascale.parallel.step import ParallelModel
from megascale.trainer import next_token_loss
from tests.parallel.tiny import SEQ, VOCAB, tiny_model_config


def _one_process(model: torch.nn.Module) -> ParallelModel:
    return ParallelModel(
        [model],
        device=torch.device("cpu"),
        autocast_dtype=None,
        tensor_parallel=False,
        gather_early=False,
        zero1=False,
        routed=any(isinstance(module, MoE) for module in model.modules()),
    )


def _batches(count: int, size: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(VOCAB, (count * size, SEQ + 1), generator=generator)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(size)]


def test_forward_backward_gives_the_gradient_of_the_mean_loss_over_micro_batches():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    reference = copy.deepcopy(model)
    batches = _batches(3)
    spans = []
    stepped = _one_process(model)
    stepped.time_phases(lambda name, **args: spans.append((name, args["micro_batch"])) or nullcontext())

    loss = stepped.forward_backward(batches, next_token_loss)

    inputs, labels = (torch.cat(column) for column in zip(*batches))
    expected = next_token_loss(reference(inputs), labels)  # equal micro-batches: the mean of their means
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert spans == [(phase, index) for index in range(3) for phase in ("forward", "backward")]


def test_evaluate_leaves_no_gradient_and_clip_gradients_clips_the_global_norm():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    stepped = _one_process(model)
    batches = _batches(2)
    inputs, labels = batches[0]
    with torch.no_grad():
        expected = next_token_loss(model(inputs), labels)

    assert stepped.micro_batches_per_evaluation == 1
    torch.testing.assert_close(stepped.evaluate(batches[:1], next_token_loss), expected)
    assert all(param.grad is None for param in model.parameters())

    stepped.forward_backward(batches, next_token_loss)
    grads = [param.grad.clone() for param in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(grad) for grad in grads]))
    got = stepped.clip_gradients(max_norm=float(norm) / 4)
    torch.testing.assert_close(got, norm)
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(param.grad, grad / 4, rtol=1e-4, atol=1e-8)


def test_finish_step_moves_the_routing_biases_and_reports_the_routers_health():
    moe = MoEConfig(experts=4, top_k=2, capacity_factor=0.5, bias_update_rate=0.01, aux_loss_coeff=0.1)
    cfg = tiny_model_config(moe=moe)
    torch.manual_seed(0)
    model = Transformer(cfg)
    stepped = _one_process(model)
    stepped.forward_backward(_batches(2), next_token_loss)
    layers = stepped.moe_layers
    loads = [layer.load.clone() for layer in layers]
    dropped = sum(float(layer.dropped) for layer in layers)
    balance = [float(layer.balance[0] / layer.balance[1]) for layer in layers]  # 2 micro-batches each
    assert all(int(layer.balance[1]) == 2 for layer in layers)

    health = stepped.finish_step()

    assert health["moe_load_max_over_mean"] == max(float(load.max() / load.mean()) for load in loads)
    for index, load in zip(stepped.moe_layer_indices, loads):  # and each layer's, by its block index
        assert health[f"moe_layer{index}_load_max_over_mean"] == pytest.approx(
            float(load.max() / load.mean())
        )
    assert stepped.moe_layer_indices == list(range(cfg.n_layers))
    assert health["moe_aux_loss"] == pytest.approx(sum(balance) / len(balance))
    assert health["moe_dropped_fraction"] == dropped / sum(float(load.sum()) for load in loads) > 0
    for layer, load in zip(layers, loads):
        assert torch.equal(layer.router.expert_bias, 0.01 * torch.sign(load.mean() - load))
        assert layer.load.sum() == 0 and layer.dropped == 0
