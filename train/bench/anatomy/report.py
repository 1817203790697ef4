"""The anatomy section's lines in bench.md: findings (where the step's time goes, what compiling changes,
the batch memory allows, each switch's gain) and one table of the variants."""

from __future__ import annotations

from typing import Any

# Issue 30: MFU of the full train step (bf16, clipping and EMA included) on one H100 / H200, by resolution.
MFU_TARGETS = {"256": 0.35, "512": 0.40}
LISTED = 4  # families / phases named per line
DEVICE_FAMILIES_LISTED = 7


def _top(shares: dict[str, float], total: float, unit: float = 1000.0) -> str:
    items = sorted(shares.items(), key=lambda kv: -kv[1])[:LISTED]
    return ", ".join(f"{name} {unit * s:.1f} ms ({100 * s / total:.0f}%)" for name, s in items)


def step_findings(res: str, step: dict[str, Any]) -> list[str]:
    """The train section's step at one resolution: MFU against issue 30's target, and on a GPU how busy the
    device is and which kernels fill it."""
    lines = []
    if step["mfu"] is not None:
        target = MFU_TARGETS.get(res)
        against = f", target {target:.0%}" if target else ""
        lines.append(
            f"{res} px: offline step MFU {step['mfu']:.1%} ({step['tflops_per_s']:.1f} TFLOP/s{against}), "
            f"clipping and EMA included ({step['clipping_and_ema_share']:.1%} of the step)"
        )
    profile = step.get("profile", {})
    if busy := profile.get("device_busy_share"):
        families = list(profile["seconds_by_family"].items())[:DEVICE_FAMILIES_LISTED]
        lines.append(
            f"{res} px: the device is busy {busy:.0%} of the step (the rest: waiting on the host); kernel "
            f"time a step by family: {', '.join(f'{name} {1e3 * s:.1f} ms' for name, s in families)}"
        )
    return lines


def eager_findings(res: int, eager: dict[str, Any]) -> list[str]:
    phases, families = eager["seconds_by_phase"], eager["seconds_by_family"]
    total = sum(phases.values()) or 1.0
    fp32 = eager["fp32_bytes_under_autocast"]
    lines = [
        f"anatomy {res} px: {eager['top_level_aten_ops_per_step']:,.0f} top-level ATen ops per step "
        f"({eager['aten_ops_computing']:,} computing ops dispatched, {eager['aten_ops']:,} with views); "
        f"{eager['time_kind']} by phase: {_top(phases, total)}; by op family: {_top(families, total)}",
        f"anatomy {res} px: ops move {eager['bytes_moved'] / 1e9:,.2f} GB per step (inputs + outputs, an "
        f"upper bound); under autocast {fp32 / 1e9:,.2f} GB of it is convolution / matmul / norm work left "
        "in fp32" + (f" ({', '.join(eager['fp32_bytes_under_autocast_by_family'])})" if fp32 else ""),
    ]
    if "state_update_bytes_per_param" in eager:
        lines.append(state_update_finding(res, eager))
    return lines


def state_update_finding(res: int, eager: dict[str, Any]) -> str:
    """Each rank's clipping + optimizer + EMA bytes per parameter, counted, against the planner's formula."""
    counted, formula = eager["state_update_bytes_per_param"], eager["state_update_formula_bytes_per_param"]
    by_phase = eager["bytes_by_phase"]
    parts = ", ".join(
        f"{phase} {moved / 1e6:,.1f} MB" for phase, moved in by_phase.items() if phase != "step"
    )
    against = "no formula: the optimizer is not fused"
    if formula is not None:
        flag = "" if abs(counted - formula) <= 0.01 * formula else " - differs: update the planner's table"
        against = f"the dry-run plan prices {formula:g}{flag}"
    return (
        f"anatomy {res} px: state update (each rank's, after backward: {parts}) {counted:.1f} B a U-Net "
        f"parameter counted ({against}); DDP runs it over every parameter on every GPU, FSDP over 1/world"
    )


def compiled_finding(res: int, eager: dict[str, Any], compiled: dict[str, Any]) -> str:
    flag = ""
    if compiled["graph_breaks"] or compiled["recompiles_after_first_step"]:
        flag = " - must be 0 breaks and 0 recompiles after the first step"
    return (
        f"anatomy {res} px: compile ({compiled['backend']}) {compiled['compile_s']:.1f} s for forward + "
        f"backward, {compiled['graphs']} graph(s), {compiled['graph_breaks']} graph breaks, "
        f"{compiled['recompiles_after_first_step']} recompiles after the first step{flag}; top-level ATen "
        f"ops per step {eager['top_level_aten_ops_per_step']:,.0f} eager -> "
        f"{compiled['top_level_aten_ops_per_step']:,.0f} compiled; "
        f"step {1000 * compiled['steady_step_s']:.1f} ms"
    )


def memory_finding(memory: dict[str, Any]) -> str:
    per_image = memory["activation_bytes_per_image"] / 1e9
    parts = []
    for where, fits in memory["batch_per_gpu"].items():
        sizes = ", ".join(f"{gpu} {fit['power_of_two']}" for gpu, fit in fits.items())
        parts.append(f"{where.replace('_', ' ')}: {sizes}")
    return f"anatomy: activations {per_image:.3f} GB per image; batch per GPU that fits - {'; '.join(parts)}"


def variant_findings(variants: dict[str, Any], baseline: str) -> list[str]:
    lines = []
    for res, runs in variants.items():
        parts = []
        for name, run in runs.items():
            mfu = "" if run["mfu"] is None else f", MFU {100 * run['mfu']:.1f}%"
            fp32 = run.get("fp32_bytes_under_autocast")
            proxy = "" if fp32 is None else f", {fp32 / 1e6:,.1f} MB fp32 under autocast"
            launches = f", {run['top_level_aten_ops_per_step']:,.0f} top-level ops"
            rate = f"{run['images_per_s_per_device']:,.1f} img/s"
            first = f", first step {run['first_step_s']:.1f} s" if "first_step_s" in run else ""
            skipped = run.get("cudagraph_skips")
            graphs = "" if not skipped else f", {skipped} graph(s) not captured as CUDA graphs: see the log"
            parts.append(f"{name} {run['gain']:.2f}x ({rate}{mfu}{launches}{proxy}{first}{graphs})")
        line = f"{res} px, full step with clipping and EMA, gain over {baseline}: {'; '.join(parts)}"
        best = max((run["mfu"] or 0.0) for run in runs.values())
        if res in MFU_TARGETS and any(run["mfu"] is not None for run in runs.values()):
            verdict = "meets" if best >= MFU_TARGETS[res] else "below"
            line += f" - best MFU {100 * best:.1f}% {verdict} the {100 * MFU_TARGETS[res]:.0f}% target"
        lines.append(line)
    return lines


ENCODE_TARGET = 0.9  # issue 30: the encode pipeline at >= 0.9x of the slower of its workers and its models


def vae_findings(encode: dict[str, Any]) -> list[str]:
    """The VAE encoder alone per resolution and switch, and the pipeline against the issue's target."""
    lines = []
    for res, runs in encode.get("vae", {}).items():
        base = runs["as_built"]["images_per_s"]
        parts = []
        for name, run in runs.items():
            mfu = "" if run.get("mfu") is None else f", MFU {100 * run['mfu']:.1f}%"
            error = next(v for k, v in run.items() if k.startswith("error_over_std"))
            parts.append(
                f"{name} {run['images_per_s']:,.1f} img/s ({run['images_per_s'] / base:.2f}x{mfu}; "
                f"mean error p99 {error['p99']:.3f} std)"
            )
        lines.append(f"VAE encoder alone {res} px: {'; '.join(parts)}")
    if "share_of_bound" in encode:
        # an encode job runs for hours: its rate once running is what the target is about
        share = encode.get("steady_share_of_bound", encode["share_of_bound"])
        when = " once running" if "steady_share_of_bound" in encode else ""
        verdict = "meets" if share >= ENCODE_TARGET else "below"
        lines.append(
            f"encode pipeline{when} at {100 * share:.0f}% of its bound: {verdict} the "
            f"{100 * ENCODE_TARGET:.0f}% target"
        )
    return lines


def anatomy_findings(anatomy: dict[str, Any]) -> list[str]:
    res, eager = anatomy["resolution"], anatomy["eager"]
    notes = eager_findings(res, eager)
    if compiled := anatomy.get("compiled"):
        notes.append(compiled_finding(res, eager, compiled))
    notes.append(memory_finding(anatomy["memory"]))
    if layouts := anatomy.get("conv_backward_layouts"):
        notes.append(layout_finding(layouts))
    if variants := anatomy.get("variants"):
        notes += variant_findings(variants, anatomy.get("baseline", "recipe"))
    return notes


def layout_finding(layouts: dict[str, Any]) -> str:
    """The compiled backward's convolution inputs in the GPU layout, without and with keep_channels_last."""

    def fed(counts: dict[str, int]) -> str:
        return f"{counts['nchw_gradient']} an NCHW gradient and {counts['nchw_input']} an NCHW input"

    without, kept = layouts["without"], layouts["keep_channels_last"]
    used = "on in the recipe" if layouts["recipe_keeps_channels_last"] else "off in the recipe"
    return (
        f"compiled backward, channels_last: of {without['convolution_backwards']} convolution backwards, "
        f"{fed(without)} (cuDNN converts each first: 7% of the H200 step); with model.keep_channels_last "
        f"({used}) {fed(kept)}"
    )
