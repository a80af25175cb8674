"""The layout's degrees, pp x dp_replicate x dp_shard x tp = world (with ep and cp inside dp_shard), and every
rule about which layouts are legal, checked before any process group exists, so that a bad layout costs
one clear line (the field, its value, and the degrees or settings that would pass) and no hang. The device
mesh over the degrees is ParallelDims' (dims.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from megascale.config import JobConfig, fail
from megascale.config.parallel import V_SCHEDULES
from megascale.errors import ConfigError


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
class Degrees:
    """Degrees of each parallelism (`world_size` is their product), checked against a job's config."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1
    moe_tp: str = "whole"
    rank_order: str = "tp-dp-pp"

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> Self:
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
