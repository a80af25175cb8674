"""ParallelDims: the one owner of the 3D layout, its validation, the device mesh and every process group.

The layout is pp x dp_replicate x dp_shard x tp = world. Ranks are numbered with TP innermost (the fastest
links, inside a node), then data parallelism, then pipeline stages outermost (paper §2: DP groups are built
before PP groups so that DP traffic stays inside a pod); `parallel.rank_order = "tp-pp-dp"` swaps the outer
two. Every rule about which layouts are legal is
checked here, before any process group exists, so a bad layout costs one clear line and no hang.

Group creation follows paper §3.5 (communicator set-up on 2,048 GPUs went from 1,047 s to under 5 s, in
part by dropping the global barrier that followed each group). `init_device_mesh` has every rank call
`new_group` for every group of every dimension, members or not, and with `TORCH_DIST_INIT_BARRIER=1`
(torch's behaviour before 2.1, an opt-in since) each call ends in a store barrier of the whole world:
O(groups) global barriers, O(n^2) store traffic. Here each rank creates only the groups it belongs to
(`use_local_synchronization=True`: non-members never hear of a group, and a barrier, if turned on, is
among its members), one dimension after another. So every member reaches a group with the same groups
behind it (torch names a member-only group after its ranks and that count), and no rank waits on a group
whose members are busy with another: the order removes the need for a barrier between groups. DeviceMesh
has no switch for member-only creation, so it wraps the groups (`DeviceMesh.from_group`). `bench/init.py`
measures the three ways side by side; this class decides the shape and names the sub-meshes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megascale.config import JobConfig, fail
from megascale.config.parallel import V_SCHEDULES
from megascale.errors import ConfigError
from megascale.layout import MESH_ORDERS

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend  # the type of init_device_mesh's backend options


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(key: str, degrees: list[int]) -> str:
    """The end of a layout error: the degrees of `key` that would pass the rule it broke."""
    return f"; valid {key}: {', '.join(map(str, degrees))}" if degrees else f"; no {key} fits"


def _tp_fits(cfg: JobConfig, tp: int) -> bool:
    """Whether tensor parallelism of degree `tp` divides what it shards (`_validate_tensor_parallel`)."""
    model, attention = cfg.model, cfg.model.attention
    sharded = [model.dim, attention.n_heads, attention.n_kv_heads, model.vocab_size]
    if tp > 1 and model.position == "learned":
        sharded.append(model.max_seq_len)
    if tp > 1 and (cfg.parallel.sequence_parallel or cfg.parallel.moe_tp == "ep" and model.moe.experts):
        sharded.append(cfg.data.seq_len)
    return all(size % tp == 0 for size in sharded)


def _fitting_degrees(cfg: JobConfig, world_size: int) -> str:
    """For a pp x dp_replicate x tp that does not divide the world: each degree above 1 that would, the
    others kept (tp only where it divides what it shards, pp only where each stage gets a layer)."""
    par = cfg.parallel
    degrees = {"pp": par.pp, "dp_replicate": par.dp_replicate, "tp": par.tp}
    said = []
    for name, value in degrees.items():
        if value == 1:
            continue
        others = par.pp * par.dp_replicate * par.tp // value
        fits = [
            degree
            for degree in _divisors(world_size)
            if world_size % (others * degree) == 0
            and (name != "tp" or _tp_fits(cfg, degree))
            and (name != "pp" or degree * par.pp_virtual_stages <= cfg.model.n_layers)
        ]
        said.append(_valid(f"parallel.{name}", fits))
    return "".join(said)


@dataclass
class ParallelDims:
    """Degrees of each parallelism (`world_size` is their product) and, once `build_mesh` has run, the
    device mesh over them, which every question about this rank's place is answered from."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1
    moe_tp: str = "whole"
    rank_order: str = "tp-dp-pp"
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _context_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 (the rest of the world) and validate the whole layout against the job."""
        par = cfg.parallel
        fixed = par.pp * par.dp_replicate * par.tp
        dp_shard = par.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                fail(
                    "parallel pp x dp_replicate x tp",
                    fixed,
                    f"does not divide the world size {world_size}" + _fitting_degrees(cfg, world_size),
                )
            dp_shard = world_size // fixed
        dims = cls(
            pp=par.pp,
            dp_replicate=par.dp_replicate,
            dp_shard=dp_shard,
            tp=par.tp,
            ep=par.ep,
            cp=par.cp,
            moe_tp=par.moe_tp if cfg.model.moe.experts else "whole",  # a dense model has no experts
            rank_order=par.rank_order,
        )
        dims.validate(cfg, world_size)
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many distinct batches one step reads (the cp ranks of a dp_shard
        group share one)."""
        return self.dp_replicate * self.dp_shard // self.cp

    @property
    def fsdp_ranks(self) -> int:
        """Ranks holding the same layers, sharding them (FSDP) or replicating them: the data- and
        context-parallel ranks."""
        return self.dp_replicate * self.dp_shard

    @property
    def experts_over_tp(self) -> bool:
        """The MoE layers' experts are split over the tp ranks too (parallel.moe_tp = 'ep')."""
        return self.moe_tp == "ep" and self.tp > 1

    @property
    def expert_ranks(self) -> int:
        """Ranks an MoE layer's routed experts are split over: ep dp_shard ranks, times tp with
        parallel.moe_tp = 'ep'."""
        return self.ep * (self.tp if self.experts_over_tp else 1)

    def describe(self) -> str:
        """The layout in one phrase, e.g. 'pp 2 x dp 1x2 x tp 2 = 8 processes'."""
        if self.world_size == 1:
            return "1 process"
        experts = f" (sequence over cp {self.cp})" if self.cp > 1 else ""
        experts += f" (experts over ep {self.ep})" if self.ep > 1 else ""
        if self.experts_over_tp:
            experts = f" (experts over {f'ep {self.ep} x ' if self.ep > 1 else ''}tp {self.tp})"
        return (
            f"pp {self.pp} x dp {self.dp_replicate}x{self.dp_shard}{experts} x tp {self.tp} = "
            f"{self.world_size} processes"
        )

    def validate(self, cfg: JobConfig, world_size: int) -> None:
        """Every layout rule, each failing with the field, its value and what would fit."""
        if self.world_size != world_size:
            rest = self.pp * self.dp_replicate * self.tp
            fix = (
                f"; --parallel.dp_shard={world_size // rest} fits (or -1: the rest of the world)"
                if world_size % rest == 0
                else _fitting_degrees(cfg, world_size)
            )
            raise ConfigError(
                f"config: parallel layout pp x dp_replicate x dp_shard x tp = {self.pp} x "
                f"{self.dp_replicate} x {self.dp_shard} x {self.tp} = {self.world_size} must equal the world "
                f"size {world_size}{fix}"
            )
        self._validate_tensor_parallel(cfg)
        self._validate_expert_parallel(cfg)
        self._validate_context_parallel(cfg)
        self._validate_pipeline(cfg)
        self._validate_float8(cfg)
        self._validate_batch(cfg)

    def _tp_choices(self, cfg: JobConfig) -> str:
        """The tp degrees of this world size that divide what tensor parallelism shards."""
        return _valid("parallel.tp", [tp for tp in _divisors(self.world_size) if _tp_fits(cfg, tp)])

    def _ep_choices(self, experts: int) -> str:
        """The ep degrees dividing dp_shard whose expert ranks (x tp, moe_tp = 'ep') divide the experts."""
        over_tp = self.tp if self.experts_over_tp else 1
        return _valid("parallel.ep", [ep for ep in _divisors(self.dp_shard) if experts % (ep * over_tp) == 0])

    def _cp_choices(self, cfg: JobConfig) -> str:
        """The cp degrees dividing dp_shard that split data.seq_len into 2 x cp equal chunks."""
        seq_len = cfg.data.seq_len
        return _valid("parallel.cp", [cp for cp in _divisors(self.dp_shard) if seq_len % (2 * cp) == 0])

    def _validate_tensor_parallel(self, cfg: JobConfig) -> None:
        """What tensor parallelism shards must divide by parallel.tp."""
        model, training, par = cfg.model, cfg.training, cfg.parallel
        heads, kv_heads = model.attention.n_heads, model.attention.n_kv_heads
        for key, value in (
            ("model.dim", model.dim),
            ("model.attention.n_heads", heads),
            ("model.attention.n_kv_heads", kv_heads),
            ("model.vocab_size", model.vocab_size),
        ):
            if value % self.tp:
                fail(key, value, f"is not divisible by parallel.tp = {self.tp}{self._tp_choices(cfg)}")
        if self.tp > 1 and model.position == "learned" and model.max_seq_len % self.tp:
            fail(
                "model.max_seq_len",
                model.max_seq_len,
                f"is not divisible by parallel.tp = {self.tp} "
                f"(the learned position table is sharded like the embedding){self._tp_choices(cfg)}",
            )
        if self.tp > 1 and par.sequence_parallel and cfg.data.seq_len % self.tp:
            fail(
                "data.seq_len",
                cfg.data.seq_len,
                f"is not divisible by parallel.tp = {self.tp} (sequence parallelism shards the sequence)"
                + self._tp_choices(cfg),
            )
        if self.tp > 1 and model.attention.qk_norm:
            fail(
                "model.attention.qk_norm",
                True,
                f"cannot be used with parallel.tp = {self.tp}: the heads' shared QK-norm gain would get a "
                "partial gradient on each tensor-parallel rank; set --parallel.tp=1",
            )
        if self.tp > 1 and training.compile:
            fail(
                "training.compile",
                True,
                f"cannot be used with parallel.tp = {self.tp}: a compiled tensor-parallel block fails in "
                "its backward (DTensor is handed a plain gradient; torch 2.13, found on CPU, untested on "
                "GPU); set --training.compile=false",
            )

    def _validate_expert_parallel(self, cfg: JobConfig) -> None:
        """Expert parallelism splits an MoE model's experts over a slice of the dp_shard ranks (and over
        the tp ranks with parallel.moe_tp = 'ep')."""
        experts = cfg.model.moe.experts
        if self.experts_over_tp and cfg.data.seq_len % self.tp:
            fail(
                "data.seq_len",
                cfg.data.seq_len,
                f"is not divisible by parallel.tp = {self.tp} (parallel.moe_tp = 'ep' routes each tp "
                "rank's part of the sequence)" + self._tp_choices(cfg),
            )
        if self.expert_ranks == 1:
            return
        if not experts:
            fail("parallel.ep", self.ep, "needs an MoE model (model.moe.experts > 0); set --parallel.ep=1")
        if self.dp_shard % self.ep:
            fail(
                "parallel.ep",
                self.ep,
                f"does not divide parallel.dp_shard = {self.dp_shard} (the experts are split over dp_shard "
                f"ranks){self._ep_choices(experts)}",
            )
        over = f"parallel.ep = {self.ep}"
        if self.experts_over_tp:
            over = f"parallel.ep x tp = {self.expert_ranks}"
        if experts % self.expert_ranks:
            fail("model.moe.experts", experts, f"is not divisible by {over}{self._ep_choices(experts)}")
        if cfg.parallel.activation_checkpoint == "selective":
            fail(
                "parallel.activation_checkpoint",
                "selective",
                f"cannot be used with {over}: the experts' FSDP unit inside the block runs other ops when "
                "recomputed than in the forward; use 'full' or 'none'",
            )

    def _validate_context_parallel(self, cfg: JobConfig) -> None:
        """Context parallelism splits every sequence over a slice of the dp_shard ranks."""
        if self.cp == 1:
            return
        model = cfg.model
        if self.dp_shard % self.cp:
            fail(
                "parallel.cp",
                self.cp,
                f"does not divide parallel.dp_shard = {self.dp_shard} (the sequence is split over dp_shard "
                f"ranks){self._cp_choices(cfg)}",
            )
        if cfg.data.seq_len % (2 * self.cp):
            fail(
                "data.seq_len",
                cfg.data.seq_len,
                f"is not divisible by 2 x parallel.cp = {2 * self.cp} (each cp rank holds 2 equal chunks)"
                + self._cp_choices(cfg),
            )
        if model.position != "rope":
            fail(
                "model.position",
                model.position,
                f"cannot be used with parallel.cp = {self.cp}: a learned position table is read by "
                "contiguous position; use 'rope'",
            )
        if model.moe.experts and self.experts_over_tp:
            fail(
                "parallel.moe_tp",
                "ep",
                f"cannot be used with parallel.cp = {self.cp}: an MoE layer's tp ranks would route parts "
                "of each cp rank's two sequence chunks, whose counts are exchanged over the cp ring only; "
                "set --parallel.moe_tp=whole",
            )

    def _validate_pipeline(self, cfg: JobConfig) -> None:
        """The stages must have layers to hold, and the schedule must support them."""
        model, par = cfg.model, cfg.parallel
        stages = self.pp * par.pp_virtual_stages
        if stages > model.n_layers:
            fits = [pp for pp in _divisors(self.world_size) if pp * par.pp_virtual_stages <= model.n_layers]
            fail(
                "parallel.pp",
                self.pp,
                f"x pp_virtual_stages = {par.pp_virtual_stages} gives {stages} "
                f"stages, more than model.n_layers = {model.n_layers}" + _valid("parallel.pp", fits),
            )
        if self.pp > 1 and model.tie_embeddings and par.pp_schedule not in V_SCHEDULES:
            fail(
                "model.tie_embeddings",
                True,
                f"cannot be used with parallel.pp = {self.pp} and parallel.pp_schedule = "
                f"{par.pp_schedule!r}: the embedding and the output layer live on different ranks; set "
                f"--model.tie_embeddings=false, or a schedule whose V holds both on one rank "
                f"({', '.join(V_SCHEDULES)})",
            )
        if par.pp_schedule in V_SCHEDULES:
            self._validate_v_schedule(cfg)
        elif par.pp_virtual_stages > 1 and par.pp_schedule != "interleaved_1f1b":
            fail(
                "parallel.pp_virtual_stages",
                par.pp_virtual_stages,
                f"needs parallel.pp_schedule = 'interleaved_1f1b', not {par.pp_schedule!r}",
            )

    def _validate_v_schedule(self, cfg: JobConfig) -> None:
        """The zero-bubble schedules hold two stages a rank, run only on torch's schedule runtime, and
        split each backward into its input and weight gradients, which torch.compile cannot do."""
        par, schedule = cfg.parallel, repr(cfg.parallel.pp_schedule)
        if self.pp == 1:
            return
        if par.pp_virtual_stages != 2:
            fail(
                "parallel.pp_virtual_stages",
                par.pp_virtual_stages,
                f"must be 2 with parallel.pp_schedule = {schedule} (two stages a rank, in a V); set "
                "--parallel.pp_virtual_stages=2",
            )
        if not par.overlap.pp:
            fail(
                "parallel.overlap.pp",
                False,
                f"cannot be used with parallel.pp_schedule = {schedule}: it runs only with its receives "
                "posted early (torch's schedule runtime); set --parallel.overlap.pp=true",
            )
        if cfg.training.compile:
            fail(
                "training.compile",
                True,
                f"cannot be used with parallel.pp_schedule = {schedule}: torch cannot split a compiled "
                "block's backward into input and weight gradients; set --training.compile=false or "
                "--parallel.pp_schedule=interleaved_1f1b",
            )
        if par.activation_checkpoint == "selective":
            fail(
                "parallel.activation_checkpoint",
                "selective",
                f"cannot be used with parallel.pp_schedule = {schedule}: a selectively checkpointed "
                "region allows one backward, and the schedule runs two (input, then weight gradients); "
                "use 'full' or 'none'",
            )
        if self.tp > 1:
            fail(
                "parallel.pp_schedule",
                par.pp_schedule,
                f"cannot be used with parallel.tp = {self.tp}: torch 2.13 runs a stage's deferred weight "
                "gradients in groups whose order it keys on object identity, so the tp ranks can issue "
                "the collectives inside them (a sequence-parallel norm's gradient reduction) in different "
                "orders; use --parallel.pp_schedule=interleaved_1f1b",
            )
        if par.zero_stage == 3 and self.fsdp_ranks > 1:
            fail(
                "parallel.zero_stage",
                3,
                f"cannot be used with parallel.pp_schedule = {schedule} and data parallelism: torch 2.13's "
                "schedule loses the deferred weight gradients of a stage whose parameters FSDP frees "
                "after the forward; set --parallel.zero_stage=2",
            )

        if cfg.model.tie_embeddings and self.fsdp_ranks > 1:
            fail(
                "model.tie_embeddings",
                True,
                f"cannot be used with parallel.pp_schedule = {schedule} and FSDP over {self.fsdp_ranks} "
                "data-parallel ranks: the V's first and last stage are each sharded on their own, and "
                "their shared weight cannot be in both; set --model.tie_embeddings=false, or "
                "--parallel.dp_shard=1 --parallel.dp_replicate=1",
            )

    def _validate_float8(self, cfg: JobConfig) -> None:
        """Float8 layers are torchao's modules: a path that multiplies their weights itself would bypass
        them."""
        training, par = cfg.training, cfg.parallel
        if training.fp8 == "none":
            return
        if self.tp > 1 and par.sequence_parallel and par.overlap.tp:
            fail(
                "training.fp8",
                training.fp8,
                f"cannot be used with parallel.overlap.tp at parallel.tp = {self.tp}: the overlapped "
                "tensor-parallel GEMMs multiply the weights themselves, in the compute precision; set "
                "--parallel.overlap.tp=false",
            )

    def _validate_batch(self, cfg: JobConfig) -> None:
        """The global batch must split into data-parallel ranks, micro-batches and pipeline slots."""
        training, par = cfg.training, cfg.parallel
        per_rank_batch = training.global_batch_size // self.dp
        if training.global_batch_size % self.dp:
            fail(
                "training.global_batch_size",
                training.global_batch_size,
                f"is not divisible by the data-parallel degree {self.dp} (dp_replicate x dp_shard"
                + (" / cp)" if self.cp > 1 else ")"),
            )

        def suggestion(fits) -> str:
            """The fix: the largest micro-batch size dividing the per-rank batch whose micro-batch count
            `fits`, or a larger global batch when none does."""
            sizes = [size for size in range(per_rank_batch, 0, -1) if per_rank_batch % size == 0]
            good = [size for size in sizes if fits(size, per_rank_batch // size)]
            if good:
                return f"; try --training.micro_batch_size={good[0]}"
            return "; raise training.global_batch_size"

        if per_rank_batch % training.micro_batch_size:
            fail(
                "training.micro_batch_size",
                training.micro_batch_size,
                f"does not divide the per-rank batch {per_rank_batch} (global_batch_size / dp)"
                + suggestion(lambda size, count: size <= training.micro_batch_size),
            )
        microbatches = per_rank_batch // training.micro_batch_size
        count = f"{microbatches} micro-batch{'' if microbatches == 1 else 'es'} per step"
        if self.pp > 1 and microbatches < self.pp:
            fail(
                "training.micro_batch_size",
                training.micro_batch_size,
                f"leaves {count}, fewer than parallel.pp = {self.pp} (the pipeline schedule needs at least "
                "pp)" + suggestion(lambda size, count: count >= self.pp),
            )
        if self.pp > 1 and par.pp_schedule == "dualpipev" and microbatches < 2 * self.pp:
            fail(
                "training.micro_batch_size",
                training.micro_batch_size,
                f"leaves {count}; DualPipeV needs at least its 2 x parallel.pp = {2 * self.pp} stages"
                + suggestion(lambda size, count: count >= 2 * self.pp),
            )
        if self.pp > 1 and par.pp_schedule == "interleaved_1f1b" and microbatches % self.pp:
            fail(
                "training.micro_batch_size",
                training.micro_batch_size,
                f"leaves {count}; interleaved 1F1B needs a multiple of parallel.pp = {self.pp}"
                + suggestion(lambda size, count: count % self.pp == 0),
            )

    def build_mesh(
        self, device_type: str, timeout_s: float | None = None, *, barrier_free: bool = True
    ) -> DeviceMesh:
        """The 4-D mesh over pp, dp_replicate, dp_shard and tp, nested as `rank_order` says; its groups'
        collectives time out after `timeout_s` (DeviceMesh's own groups would otherwise take torch's
        30-minute default, not the default group's timeout).

        Every rank calls it once, right after `init_process_group` (or with the same process groups created
        before on every rank: a group's name counts them). With `barrier_free` (the default) a rank creates
        only its own groups, one per dimension, and takes part in no other rank's group creation;
        `barrier_free=False` is torch's `init_device_mesh`, kept for `bench/init.py` to compare against.

        Eager communicator set-up: gloo connects a group's members when the group is created, so there is
        nothing to start early on CPU. On an accelerator (untested: no accelerator here) the groups get
        the current device as `device_id`, which makes NCCL connect at creation rather than at the first
        collective; if the default group is already bound to a device, torch's own path is taken instead,
        as it splits the default communicator (ncclCommSplit needs every rank, members or not).
        """
        names = MESH_ORDERS[self.rank_order]
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        shape = tuple(sizes[name] for name in names)
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        bound_device = dist.distributed_c10d._get_default_group().bound_device_id
        if barrier_free and bound_device is None:
            self._mesh = self._mesh_of_own_groups(device_type, names, shape, timeout)
        else:
            self._mesh = self._torch_mesh(device_type, names, shape, timeout)
        if self.expert_ranks > 1:
            self._expert_mesh = self._mesh_of_own_groups(device_type, *self._expert_ranks(), timeout)
        if self.cp > 1:
            # This rank's dp_shard ranks as (batch, cp), cp innermost: a ring of adjacent ranks.
            ranks = self.sub_mesh("dp_shard").mesh.reshape(self.dp_shard // self.cp, self.cp)
            self._context_mesh = self._mesh_of_own_groups(device_type, ("batch", "cp"), ranks, timeout)
        return self._mesh

    def _expert_ranks(self) -> tuple[tuple[str, ...], torch.Tensor]:
        """The expert mesh's dimension names and ranks: this rank's dp_shard ranks as (edp, ep), ep
        innermost, so an expert-parallel group is adjacent ranks (inside a node, where the all-to-all is
        cheapest); with the experts over the tp ranks too, its ep dimension is (ep, tp), tp innermost;
        under HSDP, each replica's alike."""
        names = ("dp_replicate", "dp_shard", "tp") if self.experts_over_tp else ("dp_replicate", "dp_shard")
        shape = (self.dp_replicate, self.dp_shard // self.ep, self.expert_ranks)
        ranks = self.sub_mesh(*names).mesh.reshape(shape)
        if self.dp_replicate > 1:
            return ("dp_replicate", "edp", "ep"), ranks
        return ("edp", "ep"), ranks[0]

    @staticmethod
    def _torch_mesh(
        device_type: str, names: tuple[str, ...], shape: tuple[int, ...], timeout: timedelta | None
    ) -> DeviceMesh:
        """torch's `init_device_mesh`, every group bounded by `timeout`."""
        override: dict[int | str, str | Backend.Options | tuple[str, Backend.Options]] | None = None
        if timeout is not None and device_type == "cpu":
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in the stubs
            options._timeout = timeout
            override = {name: ("gloo", options) for name in names}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
        if timeout is not None and device_type != "cpu":  # untested: no accelerator here
            for name in names:
                dist.distributed_c10d._set_pg_timeout(timeout, mesh[name].get_group())
        return mesh

    @property
    def mesh(self) -> DeviceMesh | None:
        """The mesh `build_mesh` built; None in a one-process job, which has none."""
        if self._mesh is None and self.world_size > 1:
            raise RuntimeError(f"ParallelDims.mesh: build_mesh has not run for {self.describe()}")
        return self._mesh

    def sub_mesh(self, *names: str) -> DeviceMesh:
        """The mesh over some of its dimensions ('pp', 'dp_replicate', 'dp_shard', 'tp'), in mesh order;
        multi-process jobs only."""
        mesh = self.mesh
        if mesh is None:
            raise RuntimeError(f"ParallelDims.sub_mesh{names}: a one-process job has no mesh")
        return mesh[names[0] if len(names) == 1 else names]

    def expert_mesh(self) -> DeviceMesh:
        """The mesh (edp, ep) over this rank's dp_shard group (times its tp group with the experts over
        the tp ranks), (dp_replicate, edp, ep) under HSDP: the experts are split over 'ep' and their
        weights sharded by FSDP over 'edp' (and replicated over 'dp_replicate'); jobs with
        `expert_ranks` > 1 only."""
        if self._expert_mesh is None:
            raise RuntimeError(f"ParallelDims.expert_mesh: no expert mesh for {self.describe()}")
        return self._expert_mesh

    def context_group(self) -> dist.ProcessGroup:
        """This rank's ring of cp ranks, which split the sequences of one batch; jobs with cp > 1 only."""
        if self._context_mesh is None:
            raise RuntimeError(f"ParallelDims.context_group: no context mesh for {self.describe()}")
        return self._context_mesh["cp"].get_group()

    def context_rank(self) -> int:
        """This rank's index among its cp ranks: which chunks of each sequence it holds; 0 without cp."""
        return self.local_rank("dp_shard") % self.cp if self.mesh is not None else 0

    @staticmethod
    def _mesh_of_own_groups(
        device_type: str,
        names: tuple[str, ...],
        shape_or_ranks: tuple[int, ...] | torch.Tensor,
        timeout: timedelta | None,
    ) -> DeviceMesh:
        """This rank's group along each dimension (the ranks sharing all its other coordinates), created
        by their members only, dimension by dimension, and wrapped as the mesh `init_device_mesh` builds.
        The mesh is over the whole world in the given shape, or over the given tensor of ranks."""
        if isinstance(shape_or_ranks, torch.Tensor):
            ranks = shape_or_ranks
        else:
            ranks = torch.arange(dist.get_world_size()).reshape(shape_or_ranks)
        coordinate = [int(index) for index in (ranks == dist.get_rank()).nonzero()[0]]
        on_cpu = device_type == "cpu"
        device_id = None if on_cpu else torch.device(device_type, torch.accelerator.current_device_index())
        groups = []
        for dim, name in enumerate(names):
            line = tuple(slice(None) if other == dim else index for other, index in enumerate(coordinate))
            groups.append(
                dist.new_group(
                    ranks[line].tolist(),
                    timeout=timeout,
                    backend="gloo" if on_cpu else None,
                    use_local_synchronization=True,
                    group_desc=f"mesh_{name}",
                    device_id=device_id,
                )
            )
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)

    @staticmethod
    def checkpoint_group() -> dist.ProcessGroup:
        """A gloo group of all ranks for background checkpoint saves, whose collectives must not share a
        group with training's (they run concurrently, from another thread). Collective."""
        return dist.new_group(backend="gloo")

    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same state as this one (its DP replicas), or None without replicas:
        on recovery one of them reads the checkpoint and broadcasts it to the rest."""
        return self.sub_mesh("dp_replicate").get_group() if self.dp_replicate > 1 else None

    def local_rank(self, name: str) -> int:
        """This rank's index along one dimension; 0 in a one-process job."""
        return self.sub_mesh(name).get_local_rank() if self.mesh is not None else 0

    def coordinates(self) -> dict[str, int]:
        """This rank's place in the layout: pipeline stage, data-parallel rank, tensor-parallel rank, and
        with expert parallelism its expert-parallel rank (which experts it holds)."""
        place = {"pp": self.local_rank("pp"), "dp": self.dp_rank(), "tp": self.local_rank("tp")}
        if self.cp > 1:
            place["cp"] = self.context_rank()
        if self.expert_ranks > 1:
            place["ep"] = self.expert_mesh()["ep"].get_local_rank()
        return place

    def stage_of_ranks(self) -> list[int]:
        """The pipeline stage of every global rank, indexed by rank."""
        return self._index_of_ranks("pp")

    def ep_of_ranks(self) -> list[int]:
        """The expert-parallel rank of every global rank, indexed by rank: its dp_shard index modulo ep
        (the dp_shard ranks are laid out as (edp, ep), ep innermost), with the experts over the tp ranks
        too that times tp plus its tp index."""
        ep_index = [index % self.ep for index in self._index_of_ranks("dp_shard")]
        if not self.experts_over_tp:
            return ep_index
        return [ep * self.tp + tp for ep, tp in zip(ep_index, self._index_of_ranks("tp"))]

    def _index_of_ranks(self, name: str) -> list[int]:
        """Every global rank's index along the mesh dimension `name`, indexed by rank."""
        mesh = self.mesh
        if mesh is None:
            return [0]
        indices = [0] * mesh.mesh.numel()
        dim = list(mesh.mesh_dim_names or ()).index(name)
        for index, rank in zip(itertools.product(*map(range, mesh.mesh.shape)), mesh.mesh.flatten().tolist()):
            indices[rank] = index[dim]
        return indices

    def dp_rank(self) -> int:
        """Which of the step's dp batches this rank reads: its index among the dp_replicate x dp_shard
        ranks, the cp ranks of one ring counting once."""
        batches = self.dp_shard // self.cp
        return self.local_rank("dp_replicate") * batches + self.local_rank("dp_shard") // self.cp

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP; replicas
        alone (dp_shard = 1) are HSDP with shards of one, which is plain data parallelism."""
        return self.sub_mesh(*(("dp_replicate",) if self.dp_replicate > 1 else ()), "dp_shard")
