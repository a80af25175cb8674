"""MegaScale's overlap of data-parallel communication with compute, on FSDP2 (paper §3.2).

With `parallel.overlap.dp`: FSDP2 overlaps on an accelerator by issuing all-gathers on a
second stream, but without streams (CPU, gloo) each all-gather blocks where it is issued. So every unit's
all-gather is made asynchronous and issued one unit ahead, in the order the computation consumes them
(forward: root, block 0, 1, ...; backward: the reverse), and waited for only in the pre-forward or
pre-backward of the unit that needs it; the step's first all-gather is issued before its batch is
fetched (`issue_first_all_gathers`), so it overlaps data loading. FSDP2 provides the prefetch hooks; this
module only decides the units, the mode and the order.

The gradient reduce-scatter: on an accelerator FSDP2 runs it on a stream of its own (untested here: no
GPU); without streams it blocks where it is issued, right after each unit's backward, so the rest of the
backward waits for it. FSDP2 lets the reduce-scatter be replaced (`set_custom_reduce_scatter`) but calls
the replacement as a blocking one, so `GradientReductions` issues it asynchronously and keeps the works;
FSDP2 only makes the unit's gradients views of the output, which nobody reads until
`GradientReductions.wait()` before the gradients are clipped. Where FSDP2 would read the output at once
(adding it to gradients an earlier micro-batch left), the reduction is made blocking, after the pending
ones; HSDP's all-reduce reads it too, so HSDP keeps FSDP2's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # no public name in torch 2.13
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin  # nor here


def prefetch_one_unit_ahead(root: FSDPModule, units: list[FSDPModule]) -> None:
    """Asynchronous all-gathers, each issued as the unit before it (in consumption order) begins."""
    root._set_unshard_async_op(True)  # private in torch 2.13: the only switch to async pre-forward gathers
    order = [root, *units]
    for before, after in zip(order, order[1:]):
        before.set_modules_to_forward_prefetch([after])
    for later, earlier in zip(units[::-1], units[::-1][1:]):
        later.set_modules_to_backward_prefetch([earlier])


def issue_first_all_gathers(parts: list[nn.Module]) -> None:
    """Start each part's root all-gather now (before the batch is fetched); FSDP waits for it in the part's
    pre-forward. Parts that are not FSDP units (no data parallelism) are left alone."""
    for part in parts:
        if isinstance(part, FSDPModule):
            part.unshard(async_op=True)


class GradientReductions:
    """The gradient reduce-scatters in flight; `wait()` before anything reads the gradients."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # each work and its input, kept alive

    def wait(self) -> None:
        while self.pending:
            work, _ = self.pending.pop(0)
            work.wait()


class AsyncReduceScatter(DefaultAllocMixin, ReduceScatter):
    """One FSDP unit's reduce-scatter, issued asynchronously unless FSDP2 is about to read its output."""

    def __init__(self, params: list[nn.Parameter], reductions: GradientReductions):
        self.params, self.reductions = params, reductions

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if any(param.grad is not None for param in self.params):  # FSDP2 adds the output to them next
            self.reductions.wait()  # those gradients may be an earlier reduction's output
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
        work = dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=True)
        self.reductions.pending.append((work, input_tensor))
        return None
