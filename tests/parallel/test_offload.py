"""Activation offload moves what blocks save off the device and changes no number: loss and gradients equal
the plain model's bit for bit, the bytes that leave are what the offloaded blocks save, none stays on disk."""

import copy
import itertools
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from megascale.models import sharding
from megascale.models.llama import Transformer
from megascale.parallel.activation import apply_activation_checkpointing
from megascale.parallel.offload import ActivationOffload, apply_activation_offload
from tests.parallel.tiny import tiny_model_config

CPU = torch.device("cpu")


def _loss(model: nn.Module, tokens: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _offloaded(model: nn.Module, checkpoint: str = "none") -> tuple[nn.Module, ActivationOffload]:
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, blocks=sharding.BLOCKS, mode=checkpoint)
    offload = ActivationOffload(CPU)
    apply_activation_offload(wrapped, blocks=sharding.BLOCKS, offload=offload)
    return wrapped, offload


@pytest.mark.parametrize(
    ("block", "window", "checkpoint", "autocast"),
    [
        ("serial", None, "none", False),
        ("serial", None, "none", True),
        ("parallel", 8, "none", False),  # sliding windows save overlapping views, which stay
        ("serial", None, "full", False),
    ],
)
def test_offloaded_model_gives_identical_loss_and_grads(block, window, checkpoint, autocast):
    torch.manual_seed(0)
    cfg = tiny_model_config(block, window=window, n_layers=3)
    plain = Transformer(cfg)
    wrapped, offload = _offloaded(plain, checkpoint)
    apply_activation_checkpointing(plain, blocks=sharding.BLOCKS, mode=checkpoint)
    tokens = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, wrapped):
        for _ in range(2):  # the second step reuses the spill file's space
            model.zero_grad()
            loss = _loss(model, tokens, autocast)
            loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert offload._store.written_bytes > 0  # something did leave
    assert get_model_state_dict(wrapped).keys() == get_model_state_dict(plain).keys()


def _saved_bytes_by_block(model: Transformer, tokens: torch.Tensor) -> list[int]:
    """What each block's forward saves for the backward, counted by storage: activations, not the model's
    parameters or buffers."""
    state = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    saved: list[dict[int, int]] = [{} for _ in model.layers]
    current = [-1]
    for index, block in enumerate(model.layers.values()):
        block.register_forward_pre_hook(lambda *_, index=index: current.__setitem__(0, index))
        block.register_forward_hook(lambda *_: current.__setitem__(0, -1))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if current[0] >= 0 and storage.data_ptr() not in state:
            saved[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _loss(model, tokens, autocast=False)
    return [sum(block.values()) for block in saved]


def test_what_leaves_is_what_every_block_but_the_last_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the spill file is made
    torch.manual_seed(0)
    plain = Transformer(tiny_model_config(n_layers=4))
    tokens = torch.randint(0, 96, (4, 33), generator=torch.Generator().manual_seed(1))
    saved = _saved_bytes_by_block(copy.deepcopy(plain), tokens)
    wrapped, offload = _offloaded(plain)
    loss = _loss(wrapped, tokens, autocast=False)
    assert offload._store.written_bytes == sum(saved[:-1])  # the last block keeps its own
    assert os.listdir(tmp_path) == []  # the file has no name: nothing to leave behind
    loss.backward()
    del wrapped, offload, loss
    assert os.listdir(tmp_path) == []


class _Views(nn.Module):
    """Saves a transposed view, a strided slice with gaps and a view into a larger tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x @ self.weight  # [4, 8]
        gaps = wide[:, ::2]  # strides with gaps
        tail = wide.reshape(-1)[5:21].view(4, 4)  # offset into its storage
        return (gaps.t() @ tail).sum() + (wide.t() * 2).exp().sum()


class _OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Views(), "1": nn.Identity()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["1"](self.layers["0"](x))


def test_views_come_back_with_their_shape_strides_and_values():
    torch.manual_seed(0)
    plain = _OneBlock()
    wrapped, offload = _offloaded(plain)
    x = torch.randn(4, 8)
    grads = []
    for model in (plain, wrapped):
        model(x).backward()
        grads.append(model.layers["0"].weight.grad)
    assert offload._store.written_bytes > 0
    assert torch.equal(grads[0], grads[1])


class _Squares(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # saves x


def test_a_saved_storage_can_still_be_freed_by_its_owner():
    """FSDP frees a gathered weight by resizing its storage to 0 after the forward; a compiled block's
    graph saves such weights as plain tensors, which offload then copies: the copy must leave the storage
    resizable, and the backward uses the copy."""
    model = nn.Sequential()
    model.layers = nn.ModuleDict({"0": _Squares(), "1": nn.Identity()})
    offload = ActivationOffload(CPU)
    apply_activation_offload(model, blocks="layers", offload=offload)
    weight = torch.arange(4.0, requires_grad=True)
    gathered = weight * 1  # not a parameter of the block, as an all-gather's output is not
    out = model.layers["1"](model.layers["0"](gathered))
    gathered.untyped_storage().resize_(0)  # what FSDP does after the forward
    out.sum().backward()
    assert offload._store.written_bytes == 16
    assert torch.equal(weight.grad, 2 * torch.arange(4.0))
