"""What `megascale plan` prints: the job, the fastest layouts, the best one's placement and overrides.

Each layout's line splits its step into compute, exposed communication, bubble and the rest; `--explain`
adds every term, the memory by kind and the hardware profile's numbers, to check a prediction by hand.
"""

from __future__ import annotations

import dataclasses

from megascale.config import JobConfig, load_config
from megascale.errors import ConfigError
from megascale.models.flops import attention_flops_per_token, attention_span, flops_per_token, num_params
from megascale.plan.compute import keys_per_query
from megascale.plan.experts import is_moe
from megascale.plan.hardware import HardwareProfile
from megascale.plan.job import MIXED_BF16, Cluster, Job, Layout, job_from_config, layout_from_config
from megascale.plan.placement import choose_rank_order
from megascale.plan.profiles import profile_named
from megascale.plan.search import MEMORY_HEADROOM, Plan, fastest_per_split, memory_limit_bytes, search
from megascale.plan.step import estimate_step
from megascale.plan.systems import SYSTEMS

ATTENTION_KERNELS = {  # as the assumptions line names them (`megascale.plan.compute.attention_seconds`)
    "fused": "fused (the device's fastest)",
    "flash2": "FlashAttention-2",
    "flash": "FlashAttention-1",
    "materialized": "over materialised scores",
}
GROUPS = {
    "compute": ("gemm", "attention", "elementwise", "host_dispatch", "recompute", "output_layer"),
    "comm": ("tp_exposed", "ep_exposed", "cp_exposed", "pp_exposed", "dp_exposed"),
    "bubble": ("bubble",),
    "other": ("stragglers", "core_sharing", "optimizer", "host"),
}
EXPLAIN = {  # what each term of `megascale.plan.step` stands for (docs/planning.md, "The model")
    "gemm": "linear layers, each GEMM on a roofline by its shape (at the float8 peak with --fp8)",
    "attention": "score matmuls in the system's attention kernel, or over materialised scores",
    "elementwise": "norms, activations, residuals (and float8 casts, MoE routing) through HBM",
    "host_dispatch": "host time per block the device cannot hide (measured on CPU; 0 on GPU)",
    "recompute": "the forward again: all of it under full recomputation, part under selective or op",
    "output_layer": "vocabulary projection on the last stage (and host time outside the blocks)",
    "tp_exposed": "TP/SP collectives (or sequence-parallel attention's all-to-alls) not hidden",
    "ep_exposed": "expert-parallel all-to-alls not hidden behind the experts' GEMMs",
    "cp_exposed": "context parallelism's ring transfers that outlast each ring step's attention",
    "pp_exposed": "pipeline sends/receives on the critical path (all of them when blocking)",
    "bubble": "pipeline fill and drain: (pp - 1)/v micro-batch times",
    "stragglers": "expected wait for the slowest host (--straggler-hosts, --straggler-slowdown)",
    "core_sharing": "too few CPU cores: all processes' core time over the cores, past the critical path",
    "dp_exposed": "gradient reduce-scatter and weight all-gather(s) not hidden behind compute",
    "optimizer": "update (norm, clipping, optimizer step): memory traffic and host dispatch",
    "host": "data loading and host stalls the system does not hide",
}


def plan_and_render(args) -> str:
    """The plan for `megascale plan`'s parsed arguments (see megascale.plan.command), as text."""
    cfg = load_config(args.config, getattr(args, "overrides", []))
    profile = _with_network(profile_named(args.hardware, threads=cfg.training.threads or 1), args)
    system = args.system or ("trainer" if args.hardware == "cpu" else "megascale")
    job = _job(cfg, args.batch, system)
    on_gpu = args.hardware != "cpu"
    dtype = args.dtype or ("bfloat16" if on_gpu and cfg.training.dtype == "float32" else cfg.training.dtype)
    if on_gpu and not args.dtype and dtype not in profile.peak_tflops:  # V100: no bfloat16
        dtype = "float16"
    job = dataclasses.replace(job, dtype=dtype, fp8=job.fp8 or getattr(args, "fp8", False))
    if job.fp8:
        profile.peak_flops("float8")  # a clear error where the device has no float8 peak
    cluster = Cluster(args.devices, args.straggler_hosts, args.straggler_slowdown)
    features = SYSTEMS[system]
    if args.config_layout:
        layout = _config_layout(cfg, args.devices, job)
        plans = [Plan(layout, estimate_step(job, layout, features, profile, cluster))]
    else:
        pinned = ("tp", "pp", "cp")
        fixed = {key: getattr(args, key) for key in pinned if getattr(args, key) is not None}
        plans = search(job, cluster, profile, features, fixed, skip_selective=features.fused_kernels)
    return render(job, fastest_per_split(plans)[: args.top], profile, cluster, system, args.explain)


def _with_network(profile: HardwareProfile, args) -> HardwareProfile:
    """The profile with the command line's NIC rate and GPUs per node, where given."""
    changes: dict = {}
    if args.nic_gbps:
        changes["inter_node_bytes_per_s"] = args.nic_gbps * 1e9 / 8
    if args.gpus_per_node:
        changes["devices_per_node"] = args.gpus_per_node
    return dataclasses.replace(profile, **changes) if changes else profile


def assumptions(job: Job, profile: HardwareProfile, cluster: Cluster, system: str) -> str:
    """The line above every answer: what the prediction takes as given."""
    features = SYSTEMS[system]
    overlaps = [name for name in ("tp", "pp", "dp", "cp") if getattr(features, f"{name}_overlap")]
    overlaps += ["ep"] if features.ep_overlap != "none" else []
    overlaps += ["tp backward"] if features.tp_backward_overlap and not features.tp_overlap else []
    if features.dp_overlap and not features.dp_overlap_pipelined:
        overlaps[overlaps.index("dp")] = "dp without a pipeline"
    attention = ATTENTION_KERNELS[features.attention]
    stragglers = (
        f"{cluster.straggler_host_fraction:.3g} of hosts {cluster.straggler_slowdown:.0%} slower"
        if cluster.straggler_host_fraction
        else "none"
    )
    float8 = f" (linear layers float8 at {profile.peak_flops('float8') / 1e12:.4g})" if job.fp8 else ""
    peak, intra = profile.peak_flops(job.dtype) / 1e12, profile.intra_node_bytes_per_s / 1e9
    return (
        f"assumed: {job.dtype} at {peak:.4g} TFLOP/s peak per device{float8}; "
        f"{profile.devices_per_node} per node, intra-node {intra:.4g} GB/s and "
        f"NIC {profile.inter_node_bytes_per_s * 8 / 1e9:.4g} Gb/s per device at "
        f"{profile.network_efficiency:.0%} efficiency; overlapped: {', '.join(overlaps) or 'nothing'}; "
        f"attention {attention}; host stall {features.host_stall_s:g} s; stragglers {stragglers}"
    )


def _job(cfg: JobConfig, batch: int | None, system: str) -> Job:
    job = job_from_config(cfg)
    job = dataclasses.replace(job, global_batch=batch or job.global_batch)
    return job if system == "trainer" else dataclasses.replace(job, precision=MIXED_BF16)


def _config_layout(cfg: JobConfig, devices: int, job: Job) -> Layout:
    """The config's own layout on `devices` (its dp_shard holds the cp ranks, so they divide by cp)."""
    par = cfg.parallel
    ranks = par.tp * par.pp * par.cp
    if devices % ranks:
        named = "parallel.tp x parallel.pp" + (" x parallel.cp" if par.cp > 1 else "")
        raise ConfigError(
            f"plan: --devices {devices} is not a multiple of {named} = {ranks}; "
            "give a multiple, or drop --config-layout to search"
        )
    layout = layout_from_config(cfg, devices)
    if job.global_batch % (layout.dp * layout.micro_batch):
        raise ConfigError(
            f"plan: --batch {job.global_batch} does not divide over dp {layout.dp} x micro-batch "
            f"{layout.micro_batch}; use a multiple of {layout.dp * layout.micro_batch}"
        )
    return layout


def config_overrides(layout: Layout, rank_order: str, moe: bool = False, rope: bool = True) -> str:
    """The overrides that make `megascale train` run `layout`, or why it cannot."""
    if layout.attention == "sp" or (moe and layout.tp > 1 and layout.moe_tp == "split"):
        return (
            "not by megascale's trainer: sequence-parallel attention, or experts split over the tp ranks, "
            "are MegaScale-MoE's and Megatron-LM's layouts (plan with --system trainer for layouts it trains)"
        )
    if layout.cp > 1 and not rope:
        return (
            "not by megascale's trainer: its context parallelism needs rotary positions "
            "(model.position = 'rope'), as a learned position table is read by contiguous position"
        )
    schedule = "zbv" if layout.zero_bubble else "interleaved_1f1b" if layout.virtual_stages > 1 else "1f1b"
    zero = f" --parallel.zero_stage={layout.zero_stage}" if layout.fsdp_ranks > 1 else ""
    zero += f" --parallel.cp={layout.cp}" if layout.cp > 1 else ""
    ep = layout.ep // layout.tp if layout.experts_over_tp else layout.ep
    zero += " --parallel.moe_tp=ep" if layout.experts_over_tp and layout.tp > 1 else ""
    zero += f" --parallel.ep={ep}" if ep > 1 else ""
    return (
        f"--parallel.tp={layout.tp} --parallel.pp={layout.pp} "
        f"--parallel.pp_virtual_stages={layout.virtual_stages} "
        f"--parallel.pp_schedule={schedule} --training.micro_batch_size={layout.micro_batch}{zero} "
        f"--parallel.activation_checkpoint={layout.recompute} --parallel.rank_order={rank_order}"
        + (" --parallel.pp_split=params" if layout.pp > 1 and layout.stage_split == "params" else "")
        + (" --parallel.activation_offload=true" if layout.offload else "")
    )


def render(
    job: Job, plans: list[Plan], profile: HardwareProfile, cluster: Cluster, system: str, explain: bool
) -> str:
    """The plan as text: a header, one line per layout, the best one's placement and overrides."""
    model = job.model
    lines = [
        f"{_millions(num_params(model))} parameters, {flops_per_token(model, job.seq_len):.3e} FLOPs/token, "
        f"batch {job.global_batch} x {job.seq_len} tokens on {cluster.devices:,} x {profile.name}, "
        f"system {system}",
        assumptions(job, profile, cluster, system),
        f"{'#':>2}  {'layout':<42} {'step s':>9} {'tokens/s':>12} {'MFU':>6} {'memory GB':>10}  "
        + "  ".join(f"{group:>7}" for group in GROUPS),
    ]
    limit_gb = memory_limit_bytes(profile, cluster.devices) / 1e9
    for index, plan in enumerate(plans, 1):
        estimate = plan.estimate
        groups = {group: sum(estimate.terms_s[term] for term in terms) for group, terms in GROUPS.items()}
        lines.append(
            f"{index:>2}  {plan.layout.describe():<42} {estimate.step_s:>9.4g} "
            f"{estimate.tokens_per_s:>12,.0f} "
            f"{100 * estimate.mfu:>5.1f}% {estimate.memory.total_bytes / 1e9:>10.1f}  "
            + "  ".join(f"{100 * seconds / estimate.step_s:>6.1f}%" for seconds in groups.values())
        )
    share = attention_share(job)
    run = keys_per_query(job.seq_len, model.attention.window) / attention_span(model, job.seq_len)
    lines.append(
        f"MFU counts attention unhalved (6N + 12 x layers x heads x head size x span FLOPs a token, as "
        f"Megatron-LM and torchtitan count it): {share:.0%} of these FLOPs are attention's, of which a "
        f"causal kernel runs {run:.0%}, so the devices run {1 - share * (1 - run):.0%} of the FLOPs the "
        "MFU counts"
    )
    best = plans[0]
    placement = choose_rank_order(best.layout, profile)
    lines += [
        f"memory limit {limit_gb:.1f} GB per device ({MEMORY_HEADROOM:.0%} of "
        f"{profile.hbm_bytes / 1e9:.0f} GB{' shared by the processes' if profile.host_cores else ''})",
        f"placement of #1: {placement.describe()}",
        "train #1 with: "
        + config_overrides(best.layout, placement.rank_order, is_moe(model), model.position == "rope"),
    ]
    if explain:
        lines += explain_lines(best, profile)
    return "\n".join(lines) + "\n"


def attention_share(job: Job) -> float:
    """Attention's share of the FLOPs a token is counted (`flops_per_token`: unhalved, whatever the mask)."""
    return attention_flops_per_token(job.model, job.seq_len) / flops_per_token(job.model, job.seq_len)


def _millions(count: int) -> str:
    return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


def explain_lines(plan: Plan, profile: HardwareProfile) -> list[str]:
    """Every term of one step, the memory by kind, and the profile's numbers."""
    estimate = plan.estimate
    lines = [
        "",
        f"step of #1 ({plan.layout.describe()}), {estimate.micro_batches} micro-batches per pipeline:",
    ]
    for term, seconds in estimate.terms_s.items():
        share = 100 * seconds / estimate.step_s
        lines.append(f"  {term:<14} {seconds:>11.4g} s {share:>6.1f}%  {EXPLAIN[term]}")
    lines.append(f"  {'step':<14} {estimate.step_s:>11.4g} s")
    kinds = {"weights": "weights_bytes", "gradients": "grads_bytes", "optimizer": "optimizer_bytes"}
    kinds["activations"] = "activations_bytes"
    held = ", ".join(f"{kind} {getattr(estimate.memory, name) / 1e9:.2f} GB" for kind, name in kinds.items())
    lines.append(f"memory per device at the step's peak: {held}")
    lines.append(f"profile {profile.name} ({profile.source}); each constant's source is in megascale/plan/:")
    for field in dataclasses.fields(profile):
        if type(value := getattr(profile, field.name)) in (int, float):
            lines.append(
                f"  {field.name} = {value:.4g}" if isinstance(value, float) else f"  {field.name} = {value}"
            )
    return lines
